"""The compiled threshold passes against naive loops written here: every (row, column, score) that
reaches its column's cut and nothing else, with ties at the cut, NaN and infinite scores, infinite
cuts, odd row counts, several parts per thread and output buffers that must grow; the fused pass's
scores against a float64 product (integer-valued inputs make them exact)."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icr.core.score_tiles import wide_vectors
from icr.core.threshold_scan import FusedScan, ThresholdScan, tile_rows


def reaching_loop(block: np.ndarray, cut: np.ndarray) -> list[tuple[int, int, float]]:
    out = []
    for r in range(block.shape[0]):
        for c in range(block.shape[1]):
            if block[r, c] >= cut[c]:  # False for NaN
                out.append((r, c, float(block[r, c])))
    return out


def triples(rows: np.ndarray, cols: np.ndarray, scores: np.ndarray) -> list[tuple[int, int, float]]:
    return list(zip(rows.tolist(), cols.tolist(), scores.astype(np.float64).tolist(), strict=True))


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(0, 300),
    w=st.integers(1, 20),
    capacity=st.integers(1, 50),
    seed=st.integers(0, 2**16),
)
def test_threshold_scan_matches_a_loop(b, w, capacity, seed):
    rng = np.random.default_rng(seed)
    block = rng.integers(-3, 4, size=(b, w)).astype(np.float32)  # few values: ties at the cut
    specials = rng.random((b, w))
    block[specials < 0.03] = np.nan
    block[(specials >= 0.03) & (specials < 0.05)] = np.inf
    block[(specials >= 0.05) & (specials < 0.07)] = -np.inf
    cut = rng.integers(-3, 4, size=w).astype(np.float32)
    cut[rng.random(w) < 0.1] = np.inf  # a padding column: nothing passes
    cut[rng.random(w) < 0.1] = -np.inf  # a query with no threshold yet: every non-NaN passes
    rows, cols, scores = ThresholdScan(capacity).reaching(block, cut)
    assert triples(rows, cols, scores) == reaching_loop(block, cut)  # row-major order too


def test_threshold_scan_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="cut"):
        ThresholdScan().reaching(np.zeros((3, 4), np.float32), np.zeros(5, np.float32))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 700),  # tiles of 4, 6 or 12 rows and the rows left over
    width=st.integers(1, 40),  # past one group of 16 queries, padded or not
    d=st.integers(1, 40),
    rows=st.sampled_from([None, 4, 6, 12]),  # None: this CPU's choice; else each shape on any CPU
    seed=st.integers(0, 2**16),
)
def test_fused_scores_match_a_float64_product(n, width, d, rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(-4, 5, size=(n, d)).astype(np.float32)  # integer sums: exact in fp32
    q = rng.integers(-4, 5, size=(width, d)).astype(np.float32)
    out = np.full((n + 3, len(q)), np.nan, np.float32)
    scan = FusedScan(q)
    scan._step = rows or scan._step
    got = scan.scores(x, out)
    np.testing.assert_array_equal(got, (x.astype(np.float64) @ q.T.astype(np.float64)).astype(np.float32))
    assert np.isnan(out[n:]).all()  # nothing written past the block's rows


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 700),
    width=st.integers(1, 24),
    capacity=st.integers(1, 40),
    threads=st.sampled_from([1, 2]),
    rows=st.sampled_from([None, 4, 6, 12]),
    seed=st.integers(0, 2**16),
)
def test_fused_reaching_matches_a_loop(n, width, capacity, threads, rows, seed):
    """The same triples as scoring everything and comparing in a loop, in any number of parts (one per
    numba thread), each part's buffer grown when it overflows."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, size=(n, 6)).astype(np.float32)
    q = rng.integers(-2, 3, size=(width, 6)).astype(np.float32)
    cut = rng.integers(-4, 5, size=len(q)).astype(np.float32)  # integers: ties at the cut
    cut[rng.random(len(q)) < 0.15] = np.inf
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        scan = FusedScan(q, capacity)
        scan._step = rows or scan._step
        rows, cols, scores = scan.reaching(x, cut)
    finally:
        numba.set_num_threads(before)
    want = reaching_loop(x.astype(np.float64) @ q.T.astype(np.float64), cut.astype(np.float64))
    assert sorted(triples(rows, cols, scores)) == want
    assert np.all(np.diff(rows) >= 0)  # parts come in row order, each in row order


def test_fused_scan_refuses_what_it_cannot_score():
    with pytest.raises(ValueError, match="Q >= 1"):
        FusedScan(np.zeros((0, 8), np.float32))
    scan = FusedScan(np.zeros((8, 4), np.float32))
    with pytest.raises(ValueError, match="cut"):
        scan.reaching(np.zeros((5, 4), np.float32), np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="output"):
        scan.scores(np.zeros((5, 4), np.float32), np.zeros((4, 8), np.float32))  # one row short


def test_tiles_of_twelve_rows_only_where_numba_compiles_for_avx512(monkeypatch):
    """12-row tiles of 16-lane vectors need AVX-512's 32 registers; elsewhere 6 rows of two 8-lane
    vectors, and one group of 16 queries always takes 4 rows."""
    monkeypatch.setattr(numba.config, "CPU_NAME", None)
    for features, wide in (("+avx2,+fma,+avx512f,+avx512vl", True), ("+avx2,+fma", False)):
        monkeypatch.setattr(numba.config, "CPU_FEATURES", features)
        wide_vectors.cache_clear()
        assert wide_vectors() is wide
        assert tile_rows(16) == 4 and tile_rows(32) == (12 if wide else 6)
    monkeypatch.setattr(numba.config, "CPU_FEATURES", None)
    monkeypatch.setattr(numba.config, "CPU_NAME", "generic")  # a portable cache's target
    wide_vectors.cache_clear()
    assert not wide_vectors()
    wide_vectors.cache_clear()
