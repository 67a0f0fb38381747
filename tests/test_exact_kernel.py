"""The batched exact kernel against a brute-force loop written here: every id and score, best first,
ties by lower id, for any block size, batch, k and gallery size (integer-valued vectors make every
dot product exact, so ties are real ties, not rounding)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icr.core.score_tiles import bf16_tiles
from icr.index import exact_kernel
from icr.index.exact_kernel import BF16_MAX_K, ExactKernel


def make_kernel(matrix: np.ndarray, scan: str, block: int) -> ExactKernel:
    """``scan``: fp32, bf16 (the compiled bf16 tiles where this CPU has them, else torch), or
    bf16-torch (torch multiplies the bf16 copy, as on a CPU without the tiles)."""
    made = ExactKernel(matrix, "bf16" if scan.startswith("bf16") else "fp32", block=block)
    if scan == "bf16-torch":
        made._bits = None
    return made


SCANS = ["fp32", "bf16", "bf16-torch"]


def brute_force(matrix: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    ids, scores = [], []
    for q in queries:
        exact = [(float(np.dot(row.astype(np.float64), q)), i) for i, row in enumerate(matrix)]
        best = sorted(exact, key=lambda pair: (-pair[0], pair[1]))[:k]  # best first, ties by id
        ids.append([i for _, i in best])
        scores.append([s for s, _ in best])
    return np.asarray(scores, np.float32), np.asarray(ids, np.int64)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 400),
    q=st.integers(1, 12),
    k=st.integers(1, 60),
    block=st.integers(1, 130),
    seed=st.integers(0, 2**16),
    scan=st.sampled_from(SCANS),
)
def test_every_hit_matches_a_brute_force_loop(n, q, k, block, seed, scan):
    rng = np.random.default_rng(seed)
    matrix = rng.integers(-2, 3, size=(n, 4)).astype(np.float32)  # few values: many tied scores
    queries = rng.integers(-2, 3, size=(q, 4)).astype(np.float32)
    scores, ids = make_kernel(matrix, scan, block).search(queries, k)
    want_scores, want_ids = brute_force(matrix, queries, k)
    assert ids.shape == (q, min(k, n))
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(scores, want_scores)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(40, 600),
    q=st.integers(2, 9),
    k=st.integers(4, 80),
    block=st.integers(1, 60),
    seed=st.integers(0, 2**16),
    scan=st.sampled_from(SCANS),
    sorted_gallery=st.booleans(),
)
def test_a_deep_search_from_a_sampled_cut_matches_a_brute_force_loop(
    n, q, k, block, seed, scan, sorted_gallery
):
    """The sample's cut (every 2nd row here, used from 2 expected sampled hits) and, where it was
    too high for a query, that query searched again without it: the brute-force loop's answer. A
    gallery with one query's best rows where the sample looks makes that cut too high."""
    rng = np.random.default_rng(seed)
    matrix = rng.integers(-3, 4, size=(n, 4)).astype(np.float32)  # few values: ties at every cut
    queries = rng.integers(-3, 4, size=(q, 4)).astype(np.float32)
    if sorted_gallery:  # query 0's best half on the sampled (even) rows: its cut comes out too high
        ranked = matrix[np.argsort(-(matrix @ queries[0]), kind="stable")]
        matrix = np.empty_like(matrix)
        half = (n + 1) // 2
        matrix[0::2], matrix[1::2] = ranked[:half], ranked[half:]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(exact_kernel, "SAMPLE_STRIDE", 2)
        patch.setattr(exact_kernel, "SAMPLE_MIN_EXPECTED", 2)
        made = make_kernel(matrix, scan, block)
        floors = []
        real = made._sample_floor
        patch.setattr(made, "_sample_floor", lambda *a: floors.append(real(*a)) or floors[-1])
        scores, ids = made.search(queries, k)
    want_scores, want_ids = brute_force(matrix, queries, k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(scores, want_scores)
    if scan == "fp32" or made._bits is not None:  # a fused pass (torch's bf16 scan takes no sample)
        assert len(floors) == 1 and (floors[0] is not None) == (n >= 2 * block)  # k / 2 >= 2 always


def test_queries_the_sampled_cut_failed_are_searched_again_without_it(monkeypatch):
    """A cut above every score (as a sample of unlucky rows would give): every query is searched
    again without one, and the answer is still exact."""
    rng = np.random.default_rng(2)
    matrix = rng.standard_normal((5000, 16)).astype(np.float32)
    queries = rng.standard_normal((6, 16)).astype(np.float32)
    for scan in ("fp32", "bf16"):
        made = make_kernel(matrix, scan, 500)
        calls = []
        real = made._search_fused

        def spy(queries, k, sampled=True, real=real, calls=calls):
            calls.append((len(queries), sampled))
            return real(queries, k, sampled)

        monkeypatch.setattr(made, "_search_fused", spy)
        monkeypatch.setattr(made, "_sample_floor", lambda *_: np.full(len(queries), 100.0, np.float32))
        scores, ids = made.search(queries, 300)
        want_scores, want_ids = brute_force(matrix, queries, 300)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)
        if made.precision_for(300) == "bf16" and made._bits is None:
            continue  # torch's bf16 scan: no fused pass, no sample
        assert calls == [(6, True), (6, False)]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 400),
    k=st.integers(1, 60),
    block=st.integers(1, 130),
    seed=st.integers(0, 2**16),
    precision=st.sampled_from(["fp32", "bf16"]),
)
def test_one_query_matches_a_brute_force_loop(n, k, block, seed, precision):
    """One query takes its own path (a matrix-vector scan selected in numpy), in either precision."""
    rng = np.random.default_rng(seed)
    matrix = rng.integers(-2, 3, size=(n, 4)).astype(np.float32)  # few values: ties across blocks
    query = rng.integers(-2, 3, size=(1, 4)).astype(np.float32)
    scores, ids = ExactKernel(matrix, precision, block=block).search(query, k)
    want_scores, want_ids = brute_force(matrix, query, k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(scores, want_scores)
    kernel = ExactKernel(matrix, precision, block=block)
    scanned = [b.numpy()[:, 0].copy() for _, b in kernel.score_blocks(query)]  # one buffer: copied
    np.testing.assert_array_equal(np.concatenate(scanned), matrix @ query[0])  # what bench times


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 600),
    q=st.integers(1, 8),
    k=st.integers(1, 80),
    block=st.integers(1, 200),
    seed=st.integers(0, 2**16),
    scan=st.sampled_from(["bf16", "bf16-torch"]),
    dim=st.sampled_from([15, 16]),
)
def test_the_bf16_scan_loses_no_true_neighbour(n, q, k, block, seed, scan, dim):
    """Vectors bf16 cannot hold: the scan's scores are off by up to its error bound, yet every hit
    is a true top-k one (float64 brute force, ties within float32 rounding) with its fp32 score."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((5, dim))
    matrix = (centres[rng.integers(0, 5, n)] + 0.05 * rng.standard_normal((n, dim))).astype(np.float32)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)  # clustered: many near-ties
    queries = matrix[rng.integers(0, n, q)] + 0.01 * rng.standard_normal((q, dim)).astype(np.float32)
    scores, ids = make_kernel(matrix, scan, block).search(queries, k)  # an odd dim: torch multiplies
    exact = queries.astype(np.float64) @ matrix.astype(np.float64).T  # (Q, N)
    kk = min(k, n)
    assert ids.shape == (q, kk)
    for row in range(q):
        kth = np.sort(exact[row])[::-1][kk - 1]
        assert len(set(ids[row].tolist())) == kk
        assert np.all(exact[row, ids[row]] >= kth - 1e-5)  # each hit is a true top-k one
        np.testing.assert_allclose(scores[row], exact[row, ids[row]], atol=1e-5)  # its fp32 score
        assert np.all(np.diff(scores[row]) <= 0)


@pytest.mark.parametrize("tiles", [False, True], ids=["torch", "compiled-tiles"])
def test_the_bf16_error_bound_holds_for_the_scan_it_guards(tiles):
    import torch

    if tiles and not bf16_tiles():
        pytest.skip("this CPU has no AVX512-BF16 for the compiled bf16 tiles")
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((20000, 128)).astype(np.float32) * rng.uniform(0.1, 3, (20000, 1))
    queries = rng.standard_normal((32, 128)).astype(np.float32)
    m32 = matrix.astype(np.float32)
    kernel = ExactKernel(m32, "bf16", block=4096)
    if not tiles:
        kernel._bits = None  # torch multiplies the bf16 copy, as where the CPU has no bf16 tiles
    assert (kernel._bits is not None) == tiles
    # the scoring pass the search selects from (and `icr bench` times alone), block by block: the
    # gallery in bf16, or in fp32 as it is; one buffer serves every block, so each is copied out
    blocks = [(start, s.clone()) for start, s in kernel.score_blocks(queries)]
    assert [start for start, _ in blocks] == list(range(0, 20000, 4096))
    scan = torch.cat([s for _, s in blocks])[:, :32].T.float().numpy()  # (32, 20000)
    xb, qb = torch.from_numpy(m32).bfloat16(), torch.from_numpy(queries).bfloat16()
    if tiles:  # exact products of the rounded inputs, summed in fp32
        rounded = (qb.double() @ xb.double().T).numpy()  # (32, 20000)
        assert scan.dtype == np.float32
        assert np.abs(scan - rounded).max() <= 128 * 2.0**-23 * np.abs(rounded).max()
    else:  # torch's bf16 matmul, rounded to bf16
        assert np.array_equal(scan, (xb @ qb.T).T.float().numpy())
    fp32 = torch.cat([s.clone() for _, s in ExactKernel(m32, block=4096).score_blocks(queries)])
    assert fp32.dtype == torch.float32 and np.allclose(fp32.numpy().T, queries @ m32.T, atol=1e-4)
    exact = queries.astype(np.float64) @ matrix.astype(np.float64).T  # (32, 20000)
    error = np.abs(scan - exact).max(axis=1)  # (32,)
    bound = kernel.error_bound(queries, rounded_scores=not tiles)
    assert np.all(error <= bound) and np.all(bound < 20 * error)  # holds, and is not vacuous
    if tiles:  # the tiles' window is the narrower one
        assert np.all(bound < kernel.error_bound(queries))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_realistic_gallery_with_duplicates(precision):
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((5000, 32)).astype(np.float32)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    matrix[4000:4100] = matrix[:100]  # exact duplicates: tied scores across blocks
    queries = np.concatenate([matrix[:3], rng.standard_normal((13, 32)).astype(np.float32)])  # (16, 32)
    scores, ids = ExactKernel(matrix, precision, block=1024).search(queries, 100)
    exact = queries.astype(np.float64) @ matrix.astype(np.float64).T  # (16, 5000)
    for row in range(len(queries)):
        kth = np.sort(exact[row])[::-1][99]
        assert np.all(exact[row, ids[row]] >= kth - 1e-4)  # every hit is in the top 100 (float32 sums)
        assert np.all(np.diff(scores[row]) <= 0)  # best first
    assert ids[0, 0] == 0 and ids[0, 1] == 4000  # a query equal to row 0 finds it, then its duplicate


@pytest.mark.parametrize("scan", ["bf16", "bf16-torch"])
def test_a_bf16_kernel_searches_deeper_than_its_limit_with_the_fp32_pass(monkeypatch, scan):
    """Through torch, beyond BF16_MAX_K the bf16 candidates cost more than the scan saves: the fp32
    pass answers, bit for bit as an fp32 kernel does, and nothing is rescored. The compiled tiles
    take every depth. Within its limit the bf16 scan answers, with the same ids."""
    rng = np.random.default_rng(1)
    matrix = rng.standard_normal((3000, 16)).astype(np.float32)
    queries = rng.standard_normal((5, 16)).astype(np.float32)
    bf16, fp32 = make_kernel(matrix, scan, 700), ExactKernel(matrix, "fp32", block=700)
    tiles = bf16._bits is not None
    assert bf16.precision_for(BF16_MAX_K) == "bf16"
    assert bf16.precision_for(BF16_MAX_K + 1) == ("bf16" if tiles else "fp32")
    assert fp32.precision_for(1) == "fp32"
    at_limit = bf16.search(queries, BF16_MAX_K)
    np.testing.assert_array_equal(at_limit[1], fp32.search(queries, BF16_MAX_K)[1])
    rescored = []
    real = bf16._rescored
    monkeypatch.setattr(bf16, "_rescored", lambda *a: rescored.append(1) or real(*a))
    deeper = bf16.search(queries, BF16_MAX_K + 1)
    want = fp32.search(queries, BF16_MAX_K + 1)
    assert bool(rescored) == tiles  # the tiles' candidates are rescored; the fp32 pass rescores nothing
    if not tiles:  # the fp32 pass itself
        np.testing.assert_array_equal(deeper[0], want[0])
    np.testing.assert_array_equal(deeper[1], want[1])


def test_bad_arguments_are_refused():
    kernel = ExactKernel(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"queries must be \(Q, 4\)"):
        kernel.search(np.zeros((2, 5), np.float32), 1)
    with pytest.raises(ValueError, match="k must be >= 1"):
        kernel.search(np.zeros((2, 4), np.float32), 0)
    with pytest.raises(ValueError, match="float32"):
        ExactKernel(np.zeros((3, 4), np.float64))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_service_gives_a_query_the_same_hits_alone_and_in_a_batch(threads):
    """A lone query goes to FAISS on one thread and to the kernel's one-query scan on more, a batch
    to the kernel (service.loaded_index._batcher); rescored, a query's hits and scores must not
    depend on which."""
    from icr.index.vector_index import batch_independent_rescorer, build_index
    from icr.service.loaded_index import _batcher

    rng = np.random.default_rng(0)
    base = rng.standard_normal((20_000, 64)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    index = build_index(base, 64, "Flat", gpu="off")
    batcher = _batcher(index, batch_independent_rescorer(index), max_batch=64, faiss_threads=threads)
    queries = base[:8] + 0.1 * rng.standard_normal((8, 64)).astype(np.float32)  # (8, D)
    together = batcher._search_fn(queries, 100)
    for q in range(8):
        alone = batcher._search_fn(queries[q : q + 1], 100)
        np.testing.assert_array_equal(alone[1][0], together[1][q])
        np.testing.assert_array_equal(alone[0][0], together[0][q])
        exact = base.astype(np.float64) @ queries[q].astype(np.float64)
        assert set(alone[1][0].tolist()) == set(np.argsort(-exact)[:100].tolist())


@pytest.mark.parametrize("k", [1, 3])
def test_a_short_first_block_then_long_ones(monkeypatch, k):
    """The fused search scores a short first block in full, then compares larger ones while scoring;
    a NaN row (thresholds left unset) makes a later block be scored in full into a larger buffer."""
    import icr.index.exact_kernel as exact_kernel

    monkeypatch.setattr(exact_kernel, "FIRST_BLOCK", 7)
    rng = np.random.default_rng(k)
    matrix = rng.integers(-2, 3, size=(3_000, 4)).astype(np.float32)
    queries = rng.integers(-2, 3, size=(5, 4)).astype(np.float32)
    kernel = ExactKernel(matrix, block=1_000)  # a first block of max(7, 64 k) rows, then 1,000-row ones
    scores, ids = kernel.search(queries, k)
    want_scores, want_ids = brute_force(matrix, queries, k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(scores, want_scores)
    matrix[: 64 * k] = np.nan  # the whole first block: no threshold can be set from it
    scores, ids = ExactKernel(matrix, block=1_000).search(queries, k)
    assert ids.shape == (5, k)


def test_warm_compiles_the_batch_pass_before_the_first_batch():
    """A fresh process has no compiled batch pass until something asks for one; ``warm`` (what the
    server calls when it loads a flat index) leaves it compiled, from numba's cache or from scratch."""
    script = """
import sys
import numpy as np
from icr.core.rescore import _gathered
from icr.core.threshold_scan import _fused
from icr.index.exact_kernel import ExactKernel
kernel = ExactKernel(np.random.default_rng(0).standard_normal((100, 8)).astype(np.float32), sys.argv[1], 8)
before = len(_fused.signatures), len(_gathered.signatures), int(kernel._sample is not None)
kernel.warm()
print(*before, len(_fused.signatures), len(_gathered.signatures), int(kernel._sample is not None))
"""
    for precision in ("fp32", "bf16"):
        done = subprocess.run(
            [sys.executable, "-c", script, precision], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        # one fused pass: fp32, or the bf16 tiles (through torch's bf16 scan: the fp32 pass of deep
        # searches); a bf16 kernel's rescoring; the sample
        want = ["0", "0", "0", "1", "1" if precision == "bf16" else "0", "1"]
        assert done.stdout.split() == want
