"""The compiled rescoring against a float64 loop written here: every (query, id) pair's score,
-inf at the padding, the same score for a pair whatever else is rescored beside it, and clear
errors for ids or shapes that do not fit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icr.core.rescore import rescored_rows


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300),
    q=st.integers(1, 9),
    w=st.integers(0, 40),
    d=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_rescored_rows_match_a_loop(n, q, w, d, seed):
    rng = np.random.default_rng(seed)
    matrix = rng.standard_normal((n, d)).astype(np.float32)
    queries = rng.standard_normal((q, d)).astype(np.float32)
    ids = rng.integers(-1, n, size=(q, w))
    got = rescored_rows(matrix, queries, ids)
    assert got.shape == (q, w) and got.dtype == np.float32
    for i in range(q):
        for j in range(w):
            if ids[i, j] < 0:
                assert np.isneginf(got[i, j])
                continue
            exact = sum(float(matrix[ids[i, j], c]) * float(queries[i, c]) for c in range(d))
            magnitude = sum(abs(float(matrix[ids[i, j], c]) * float(queries[i, c])) for c in range(d))
            assert abs(got[i, j] - exact) <= d * 2.0**-23 * magnitude + 1e-30
    if q > 1 and w > 1:  # a pair's score does not depend on the rest of the batch
        np.testing.assert_array_equal(rescored_rows(matrix, queries[1:], ids[1:, 1:]), got[1:, 1:])


def test_rescored_rows_refuse_what_does_not_fit():
    matrix = np.zeros((5, 4), np.float32)
    with pytest.raises(ValueError, match="past the matrix's 5 rows"):
        rescored_rows(matrix, np.zeros((1, 4), np.float32), np.array([[5]]))
    with pytest.raises(ValueError, match=r"\(Q, 4\) queries"):
        rescored_rows(matrix, np.zeros((1, 3), np.float32), np.array([[0]]))
