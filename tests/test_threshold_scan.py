"""The compiled threshold passes against naive loops written here: every (row, column, score) that
reaches its column's cut and nothing else, with ties at the cut, NaN and infinite scores, infinite
cuts, odd row counts, several parts per thread and output buffers that must grow; the fused pass's
scores against a float64 product (integer-valued inputs make them exact), in fp32 and, where the CPU
has AVX512-BF16, from bfloat16 bits."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icr.core.score_tiles import bf16_bits, bf16_tiles, wide_vectors
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


needs_bf16 = pytest.mark.skipif(not bf16_tiles(), reason="this CPU has no AVX512-BF16 for the bf16 tiles")


def as_bits(values: np.ndarray) -> np.ndarray:
    """The bfloat16 bits torch rounds ``values`` to (an implementation independent of bf16_bits)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(values)).bfloat16().view(torch.int16).numpy().view(np.uint16)


def from_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def test_bf16_bits_round_as_torch_does():
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(200_000) * np.exp(4 * rng.standard_normal(200_000))).astype(np.float32)
    halfway = (np.arange(1, 2000, dtype=np.uint32) << 16 | np.uint32(0x8000)).view(np.float32)  # ties
    for v in (values, halfway, -halfway, np.array([0.0, -0.0, 1e-40, 3.4e38], np.float32)):
        np.testing.assert_array_equal(bf16_bits(v), as_bits(v))


@needs_bf16
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 700),
    width=st.integers(1, 40),
    pairs=st.integers(1, 20),
    rows=st.sampled_from([None, 4, 6, 12]),
    integers=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bf16_fused_scores_match_a_float64_product_of_the_rounded_values(
    n, width, pairs, rows, integers, seed
):
    """Integer inputs are held exactly and sum exactly; others are rounded to bf16 first, and the sum
    of their exact products is off by at most fp32 summation error."""
    rng = np.random.default_rng(seed)
    d = 2 * pairs
    if integers:
        x = rng.integers(-4, 5, size=(n, d)).astype(np.float32)
        q = rng.integers(-4, 5, size=(width, d)).astype(np.float32)
    else:
        x = rng.standard_normal((n, d)).astype(np.float32)
        q = rng.standard_normal((width, d)).astype(np.float32)
    out = np.full((n + 3, width), np.nan, np.float32)
    scan = FusedScan(q, bf16=True)
    scan._step = rows or scan._step
    got = scan.scores(as_bits(x), out)
    want = from_bits(as_bits(x)) @ from_bits(as_bits(q)).T  # (n, width)
    if integers:
        np.testing.assert_array_equal(got, want.astype(np.float32))
    else:
        magnitude = np.abs(from_bits(as_bits(x))) @ np.abs(from_bits(as_bits(q))).T
        assert np.all(np.abs(got - want) <= d * 2.0**-23 * magnitude + 1e-30)
    assert np.isnan(out[n:]).all()


@needs_bf16
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 700),
    width=st.integers(1, 24),
    capacity=st.integers(1, 40),
    rows=st.sampled_from([None, 4, 6, 12]),
    seed=st.integers(0, 2**16),
)
def test_bf16_fused_reaching_matches_a_loop(n, width, capacity, rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, size=(n, 6)).astype(np.float32)
    q = rng.integers(-2, 3, size=(width, 6)).astype(np.float32)
    cut = rng.integers(-4, 5, size=len(q)).astype(np.float32)  # integers: ties at the cut
    cut[rng.random(len(q)) < 0.15] = np.inf
    scan = FusedScan(q, capacity, bf16=True)
    scan._step = rows or scan._step
    rows, cols, scores = scan.reaching(as_bits(x), cut)
    want = reaching_loop(x.astype(np.float64) @ q.T.astype(np.float64), cut.astype(np.float64))
    assert sorted(triples(rows, cols, scores)) == want


def test_fused_scan_refuses_what_it_cannot_score():
    with pytest.raises(ValueError, match="Q >= 1"):
        FusedScan(np.zeros((0, 8), np.float32))
    scan = FusedScan(np.zeros((8, 4), np.float32))
    with pytest.raises(ValueError, match="cut"):
        scan.reaching(np.zeros((5, 4), np.float32), np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="output"):
        scan.scores(np.zeros((5, 4), np.float32), np.zeros((4, 8), np.float32))  # one row short
    with pytest.raises(ValueError, match="AVX512-BF16 and an even dimension"):
        FusedScan(np.zeros((8, 5), np.float32), bf16=True)


def test_tiles_of_twelve_rows_only_where_numba_compiles_for_avx512(monkeypatch):
    """12-row tiles of 16-lane vectors need AVX-512's 32 registers; elsewhere 6 rows of two 8-lane
    vectors, and one group of 16 queries always takes 4 rows. bf16 tiles only with AVX512-BF16."""
    monkeypatch.setattr(numba.config, "CPU_NAME", None)
    for features, wide, bf16 in (
        ("+avx2,+fma,+avx512f,+avx512vl,+avx512bf16", True, True),
        ("+avx2,+fma,+avx512f,+avx512vl", True, False),
        ("+avx2,+fma", False, False),
    ):
        monkeypatch.setattr(numba.config, "CPU_FEATURES", features)
        wide_vectors.cache_clear()
        bf16_tiles.cache_clear()
        assert wide_vectors() is wide and bf16_tiles() is bf16
        assert tile_rows(16) == 4 and tile_rows(32) == (12 if wide else 6)
        assert tile_rows(16, bf16=True) == tile_rows(64, bf16=True) == 6
    monkeypatch.setattr(numba.config, "CPU_FEATURES", None)
    monkeypatch.setattr(numba.config, "CPU_NAME", "generic")  # a portable cache's target
    wide_vectors.cache_clear()
    bf16_tiles.cache_clear()
    assert not wide_vectors() and not bf16_tiles()
    wide_vectors.cache_clear()
    bf16_tiles.cache_clear()
