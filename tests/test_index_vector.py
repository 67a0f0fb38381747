"""FAISS wrapper: every search against a numpy brute force (tie-aware), -1 padding, save/load,
factory choice, and recall@k on cases whose answer is known."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from icr.index.vector_index import (
    FLAT_LIMIT,
    ExactTopK,
    _coalesced,
    build_index,
    choose_factory,
    load_index,
    nprobe_grid,
    nprobe_of,
    omp_threads,
    parse_factory,
    recall_at_k,
    recall_lower_bound,
    save_index,
    search,
    set_nprobe,
    tune_nprobe,
)

DIM = 32
TOL = 1e-5


pytestmark = pytest.mark.usefixtures("faiss_one_thread")


def normalise(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def base() -> np.ndarray:
    """(2000, 32) clustered unit vectors, with exact duplicates so that ties occur."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(20, DIM))
    x = centres[rng.integers(0, 20, 2000)] + 0.3 * rng.normal(size=(2000, DIM))  # (N, D)
    x = normalise(x)
    x[1000:1100] = x[:100]  # duplicates: tied scores for every query
    return x


@pytest.fixture(scope="module")
def queries(base) -> np.ndarray:
    rng = np.random.default_rng(1)
    q = base[rng.choice(len(base), 50, replace=False)] + 0.1 * rng.normal(size=(50, DIM))  # (Q, D)
    return np.concatenate([normalise(q), base[:5]])  # the last five hit duplicated vectors exactly


def assert_brute_force(
    scores: list[np.ndarray], ids: list[np.ndarray], base: np.ndarray, queries: np.ndarray, k: int
) -> None:
    """Tie-aware: the returned ids are a valid exact top-k (any of several tied vectors will do)."""
    assert len(scores) == len(ids) == len(queries)
    for q, s, i in zip(queries, scores, ids, strict=True):
        exact = base @ q  # (N,), written independently of the module's exact search
        kk = min(k, len(base))
        top = np.sort(exact)[::-1][:kk]  # (kk,)
        assert len(i) == kk and len(set(i.tolist())) == kk
        assert (i >= 0).all()
        assert np.allclose(s, exact[i], atol=TOL)  # the scores are the ids' true scores
        assert np.all(exact[i] >= top[-1] - TOL)  # every returned id is in the top-k (ties count)
        assert np.allclose(s, top, atol=TOL)  # ...and best first
        assert np.all(np.diff(s) <= TOL)


def chunks(x: np.ndarray, size: int):
    for start in range(0, len(x), size):
        yield x[start : start + size]


def test_flat_matches_brute_force(base, queries):
    for vectors in (base, chunks(base, 300)):
        index = build_index(vectors, DIM, "Flat", gpu="off")
        assert index.ntotal == len(base)
        for k in (1, 10, 37):
            assert_brute_force(*search(index, queries, k), base, queries, k)


def test_ivf_with_every_list_probed_is_exact(base, queries):
    index = build_index(chunks(base, 256), DIM, "IVF16,Flat", gpu="off")
    assert index.ntotal == len(base)
    assert_brute_force(*search(index, queries, 10, nprobe=16), base, queries, 10)
    assert nprobe_of(index) == 1  # a per-call nprobe does not change the index
    set_nprobe(index, 16)
    assert_brute_force(*search(index, queries, 10), base, queries, 10)
    assert recall_at_k(index, base, queries, 10) == 1.0


def test_ivf_trains_on_a_given_sample_and_streams_the_rest(base, queries):
    index = build_index(chunks(base, 100), DIM, "IVF8,Flat", train_sample=base[::5], gpu="off")
    assert index.ntotal == len(base)
    assert_brute_force(*search(index, queries, 5, nprobe=8), base, queries, 5)


def test_streamed_chunks_are_added_in_large_blocks_with_every_row_in_order(base, queries, monkeypatch):
    sizes = [len(b) for b in _coalesced(chunks(base, 7), 100)]
    assert sum(sizes) == len(base) and all(s >= 100 for s in sizes[:-1]) and sizes[-1] <= 100 + 6
    assert np.array_equal(np.concatenate(list(_coalesced(chunks(base, 7), 100))), base)
    # a build whose producer narrowed OpenMP to one thread: the k-means gets every core, then the
    # producer's setting is back; ids stay in stream order
    monkeypatch.setattr("icr.index.vector_index.ADD_ROWS", 150)
    with omp_threads(1):
        index = build_index(chunks(base, 7), DIM, "IVF8,Flat", gpu="off")
        assert faiss.omp_get_max_threads() == 1
    assert_brute_force(*search(index, queries, 5, nprobe=8), base, queries, 5)


def test_pq_and_hnsw_build_and_search(base, queries):
    pq = build_index(base, DIM, "IVF8,PQ8", gpu="off")
    assert pq.ntotal == len(base)
    assert 0.3 < recall_at_k(pq, base, queries, 10, nprobe=8) <= 1.0  # 8-byte codes are lossy
    hnsw = build_index(base[:500], DIM, "HNSW32", gpu="off")
    assert recall_at_k(hnsw, base[:500], queries, 10) > 0.9


def test_ivf_too_few_training_vectors_is_a_clear_error(base):
    with pytest.raises(ValueError, match="needs at least 64 training vectors"):
        build_index(base[:20], DIM, "IVF64,Flat", gpu="off")


def test_k_larger_than_the_index_drops_the_minus_one_padding(base, queries):
    small = build_index(base[:7], DIM, "Flat", gpu="off")
    raw_ids = small.search(queries, 10)[1]
    assert (raw_ids == -1).any()  # what FAISS itself returns
    scores, ids = search(small, queries, 10)
    assert all(len(i) == 7 and (i >= 0).all() for i in ids)
    assert_brute_force(scores, ids, base[:7], queries, 10)
    # An IVF probe can reach fewer than k vectors even when the index holds more: short rows.
    ivf = build_index(base[:200], DIM, "IVF32,Flat", gpu="off")
    _, ids = search(ivf, queries, 50, nprobe=1)
    assert all((i >= 0).all() and len(i) <= 50 for i in ids)
    assert any(len(i) < 50 for i in ids)
    empty = build_index(np.zeros((0, DIM), np.float32), DIM, "Flat", gpu="off")
    scores, ids = search(empty, queries[:3], 5)
    assert [len(i) for i in ids] == [0, 0, 0]


def test_search_checks_its_input(base):
    index = build_index(base[:10], DIM, "Flat", gpu="off")
    with pytest.raises(ValueError, match=r"\(N, 32\)"):
        search(index, base[:2, :16], 3)
    with pytest.raises(ValueError, match="k must be"):
        search(index, base[:2], 0)
    with pytest.raises(ValueError, match="IVF"):
        search(index, base[:2], 3, nprobe=4)


def test_save_load_round_trip(base, queries, tmp_path: Path):
    for factory in ("Flat", "IVF16,Flat"):
        index = build_index(base, DIM, factory, gpu="off")
        if factory.startswith("IVF"):
            set_nprobe(index, 4)
        before = search(index, queries, 10)
        path = save_index(index, tmp_path / "index.faiss")
        for mmap in (False, True):
            loaded = load_index(path, mmap=mmap)
            assert loaded.ntotal == index.ntotal and loaded.d == DIM
            assert nprobe_of(loaded) == nprobe_of(index)  # the tuned nprobe travels with the file
            after = search(loaded, queries, 10)
            for a, b in zip(before[1] + before[0], after[1] + after[0], strict=True):
                assert np.array_equal(a, b)


def test_load_names_a_missing_or_corrupt_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nowhere.faiss"):
        load_index(tmp_path / "nowhere.faiss")
    bad = tmp_path / "bad.faiss"
    bad.write_bytes(b"not an index at all")
    with pytest.raises(ValueError, match="bad.faiss: not a readable FAISS index"):
        load_index(bad)


def test_choose_factory():
    factory, reason = choose_factory(5000, 256, 1 << 30)
    assert factory == "Flat" and "exact" in reason
    assert choose_factory(FLAT_LIMIT - 1, 256, 1 << 30)[0] == "Flat"
    factory, reason = choose_factory(1_000_000, 256, 2 << 30)
    assert factory == "IVF4000,Flat" and "fit the memory budget" in reason
    factory, reason = choose_factory(1_000_000, 256, 256 << 20)  # 977 MiB of floats > 256 MiB
    assert factory == "IVF4000,PQ64" and "PQ" in reason  # 96 does not divide 256
    assert choose_factory(1_000_000, 256, 10 << 20)[0] == "IVF4000,PQ8"
    assert choose_factory(50_000, 4096, 100 << 20)[0] == "IVF894,PQ64"  # few but too wide for the budget
    with pytest.raises(ValueError, match="memory budget"):
        choose_factory(1_000_000, 256, 100_000)
    for factory in ("Flat", "HNSW32", "IVF4000,Flat", "IVF4000,PQ64"):
        parse_factory(factory)
    for bad in ("IVF,Flat", "LSH", "IVF10,PQ", "flat"):
        with pytest.raises(ValueError, match="unsupported index factory"):
            parse_factory(bad)


@pytest.mark.skipif(faiss.get_num_gpus() > 0, reason="a GPU is visible")
def test_gpu_on_without_a_gpu_is_a_clear_error(base):
    with pytest.raises(ValueError, match="--gpu on"):
        build_index(base, DIM, "Flat", gpu="on")
    with pytest.raises(ValueError, match="gpu must be one of"):
        build_index(base, DIM, "Flat", gpu="yes")
    report: dict[str, str] = {}
    assert build_index(base[:10], DIM, "Flat", gpu="auto", report=report).ntotal == 10
    assert report == {"built_on": "cpu"}  # auto uses the CPU when no GPU is visible


@pytest.mark.gpu
@pytest.mark.skipif(faiss.get_num_gpus() == 0, reason="needs faiss-gpu and a CUDA GPU")
def test_gpu_build_returns_the_cpu_form(base, queries):
    index = build_index(chunks(base, 256), DIM, "IVF16,Flat", gpu="on")
    assert not isinstance(index, faiss.GpuIndex)
    assert_brute_force(*search(index, queries, 10, nprobe=16), base, queries, 10)


def test_recall_at_k_known_cases():
    rng = np.random.default_rng(3)
    q = normalise(rng.normal(size=(1, DIM)))[0]
    # 20 vectors with scores 0.95, 0.90, ... against q: the exact top-10 is ids 0..9
    other = normalise(rng.normal(size=(20, DIM)) - np.outer(rng.normal(size=20), q))
    other = normalise(other - np.outer(other @ q, q))  # orthogonal to q
    target = np.linspace(0.95, 0.0, 20)[:, None]
    base = (target * q + np.sqrt(1 - target**2) * other).astype(np.float32)  # (20, D), base @ q = target
    queries = q[None].astype(np.float32)
    assert recall_at_k(build_index(base, DIM, "Flat", gpu="off"), base, queries, 10) == 1.0

    # An index that lost ids 0..4 (stored far away) returns 5..14: half the exact top-10.
    damaged = base.copy()
    damaged[:5] = -q
    assert recall_at_k(build_index(damaged, DIM, "Flat", gpu="off"), base, queries, 10) == pytest.approx(0.5)

    # Ties: vector 10 duplicates vector 9; an index returning 10 instead of 9 loses nothing.
    tied = base.copy()
    tied[10] = tied[9]
    swapped = tied.copy()
    swapped[9] = -q
    index = build_index(swapped, DIM, "Flat", gpu="off")
    assert 10 in search(index, queries, 10)[1][0] and 9 not in search(index, queries, 10)[1][0]
    assert recall_at_k(index, tied, queries, 10) == 1.0
    assert recall_at_k(index, base, queries, 10) == pytest.approx(0.9)  # without the tie: one miss

    # The same answers from a flat index and from a streamed exact top-k as the reference.
    acc = ExactTopK(queries, 20)
    for block in chunks(tied, 3):
        acc.add(block)
    flat = build_index(tied, DIM, "Flat", gpu="off")
    assert recall_at_k(index, acc, queries, 10) == recall_at_k(index, flat, queries, 10) == 1.0
    # k beyond the index: the denominator is the index size
    assert recall_at_k(build_index(base[:4], DIM, "Flat", gpu="off"), base[:4], queries, 10) == 1.0


@pytest.mark.parametrize("depth", [20, 700])
def test_exact_top_k_streaming_equals_one_pass(base, queries, depth):
    acc = ExactTopK(queries, depth)
    for block in chunks(base, 333):
        acc.add(block)
    scores = queries @ base.T  # (Q, N)
    order = np.lexsort((np.broadcast_to(np.arange(scores.shape[1]), scores.shape), -scores), axis=1)
    top = np.take_along_axis(scores, order, 1)[:, :depth]
    assert np.allclose(acc.scores, top, atol=TOL)
    assert np.allclose(np.take_along_axis(scores, acc.ids, axis=1), acc.scores, atol=TOL)
    assert np.all(np.diff(acc.scores, axis=1) <= 0)  # best first


def test_tune_nprobe_reaches_the_target_with_a_margin_for_unseen_queries(base, queries):
    import statistics

    def bound(values: list[float]) -> float:  # the mean less 1.645 standard errors, by hand
        return statistics.mean(values) - 1.645 * statistics.stdev(values) / len(values) ** 0.5

    def per_query(index, k: int, nprobe: int) -> list[float]:
        out = []
        for q in queries:  # brute force: exact top k (ties with the k-th accepted) vs what the index returns
            scores = base @ q
            kth = np.sort(scores)[::-1][k - 1]
            _, ids = search(index, q[None, :], k, nprobe=nprobe)
            out.append(sum(scores[i] >= kth - 1e-6 for i in ids[0]) / k)
        return out

    assert recall_lower_bound(np.array([0.5, 1.0, 1.0, 0.75])) == pytest.approx(bound([0.5, 1.0, 1.0, 0.75]))
    assert recall_lower_bound(np.array([0.9])) == 0.9
    index = build_index(base, DIM, "IVF32,Flat", gpu="off")
    grid = nprobe_grid(32)
    assert grid == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32]

    def before(n: int) -> int:  # the grid value below n (0 for the first)
        return max([g for g in grid if g < n], default=0)

    nprobe, recall, deep = tune_nprobe(index, base, queries, 10, target=0.99)
    assert nprobe_of(index) == nprobe and deep is None and nprobe in grid
    assert recall == pytest.approx(statistics.mean(per_query(index, 10, nprobe)))
    # the smallest grid value whose bound (not only whose mean) reaches the target
    assert bound(per_query(index, 10, nprobe)) >= 0.99
    assert nprobe == 1 or bound(per_query(index, 10, before(nprobe))) < 0.99
    # where the mean of the sample clears the target at the value below, the bound does not: the
    # margin is what keeps queries outside the sample above it
    margin, _, _ = tune_nprobe(index, base, queries, 10, target=0.96)
    assert margin > 1 and statistics.mean(per_query(index, 10, before(margin))) >= 0.96
    assert bound(per_query(index, 10, before(margin))) < 0.96 <= bound(per_query(index, 10, margin))
    # at the service's depth too: the smallest grid value reaching both targets
    depth = len(base) // 4
    nprobe_deep, recall, deep = tune_nprobe(index, base, queries, 10, 0.99, depth=depth, depth_target=0.97)
    assert nprobe_deep >= nprobe and bound(per_query(index, depth, nprobe_deep)) >= 0.97
    assert deep == pytest.approx(statistics.mean(per_query(index, depth, nprobe_deep)))
    assert nprobe_deep == nprobe or bound(per_query(index, depth, before(nprobe_deep))) < 0.97
    with pytest.raises(ValueError, match="IVF"):
        tune_nprobe(build_index(base[:10], DIM, "Flat", gpu="off"), base[:10], queries)


@pytest.mark.parametrize("factory", ["Flat", "IVF16,Flat", "IVF8,PQ8"])
def test_rescored_scores_do_not_depend_on_the_batch(factory: str) -> None:
    from icr.index.vector_index import batch_independent_rescorer, rescored

    rng = np.random.default_rng(0)
    base = rng.standard_normal((3000, 32)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    index = build_index(base, 32, factory, gpu="off")
    if nprobe_of(index) is not None:
        set_nprobe(index, 16)
    rescore = batch_independent_rescorer(index)
    assert rescore is not None
    query = base[:1] + 0.1 * rng.standard_normal((1, 32)).astype(np.float32)
    results = []
    for batch in (1, 19, 21, 64):  # FAISS switches to BLAS at 20 queries
        queries = np.concatenate([query, rng.standard_normal((batch - 1, 32)).astype(np.float32)])
        scores, ids = rescored(rescore, queries, search(index, queries, 100)[1])
        results.append((scores[0], ids[0]))
    for scores, ids in results[1:]:
        assert np.array_equal(scores, results[0][0]) and np.array_equal(ids, results[0][1])
    scores, ids = results[0]
    # oracle: the stored (or decoded) vectors' dot product in float64, rounded once; best first, ties by id
    stored = np.stack([index.reconstruct(int(i)) for i in ids])
    expected = (stored.astype(np.float64) @ query[0].astype(np.float64)).astype(np.float32)
    assert np.array_equal(scores, expected)
    pairs = zip(scores[:-1], scores[1:], ids[:-1], ids[1:], strict=True)
    assert all((a > b) or (a == b and i < j) for a, b, i, j in pairs)
    if factory == "Flat":  # nothing approximate: the same hits as exact search
        exact = np.argsort(-(base @ query[0]), kind="stable")[:100]
        assert set(ids.tolist()) == set(exact.tolist())


def test_raw_scores_depend_on_the_batch_at_scale_and_rescored_ones_do_not() -> None:
    """The test above where it matters. At the API tests' size (32 dims, 440 vectors) FAISS gives a
    query the same scores in any batch, so they cannot tell whether rescoring is needed. At 256
    dims x 20,000 vectors a lone query searched on several threads (ICR_FAISS_THREADS > 1: FAISS
    splits the gallery over them) gets scores that differ from the same query's in a batch by
    ~2e-7 (measured 2.4e-7 and 4.8e-7 on 2 threads; on one thread they agree), enough to move a
    hit across a threshold. Rescored as the service does (``loaded_index._batcher``), they are equal."""

    from icr.index.vector_index import batch_independent_rescorer, rescored

    rng = np.random.default_rng(0)
    dim = 256
    base = rng.standard_normal((20_000, dim)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    index = build_index(base, dim, "Flat", gpu="off")
    rescore = batch_independent_rescorer(index)
    assert rescore is not None
    queries = base[:8] + 0.1 * rng.standard_normal((8, dim)).astype(np.float32)  # (8, D)
    batch = np.concatenate([queries, rng.standard_normal((56, dim)).astype(np.float32)])  # (64, D)
    with omp_threads(2):  # as the batcher sets them per search; forced: CI may have one core
        alone = [search(index, queries[q : q + 1], 100) for q in range(8)]  # each query by itself
        together = search(index, batch, 100)
    raw_diff = max(float(np.abs(alone[q][0][0] - together[0][q]).max()) for q in range(8))
    assert 0 < raw_diff < 1e-5, raw_diff  # FAISS's own scores moved with the batch
    batch_rescored = rescored(rescore, batch, together[1])
    for q in range(8):
        scores, ids = rescored(rescore, queries[q : q + 1], alone[q][1])
        assert np.array_equal(scores[0], batch_rescored[0][q]) and np.array_equal(
            ids[0], batch_rescored[1][q]
        )


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "HNSW16"])
def test_search_with_a_selector_sees_only_the_selected_ids(factory):
    """Against brute force over the selected rows; the index's own nprobe / efSearch are kept."""
    import faiss

    from icr.index.vector_index import build_index, search, set_nprobe

    rng = np.random.default_rng(3)
    x = rng.normal(size=(600, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    index = build_index(x, 16, factory, gpu="off")
    if factory.startswith("IVF"):
        set_nprobe(index, 8)  # every list: exact
    if factory.startswith("HNSW"):
        index.hnsw.efSearch = 600
    chosen = np.sort(rng.choice(600, 90, replace=False))
    bitmap = np.packbits(np.isin(np.arange(600), chosen), bitorder="little")
    selector = faiss.IDSelectorBitmap(600, faiss.swig_ptr(bitmap))
    queries = x[:5] + 0.1 * rng.normal(size=(5, 16)).astype(np.float32)
    scores, ids = search(index, queries, 20, selector=selector)
    for q, (s, i) in enumerate(zip(scores, ids, strict=True)):
        assert set(i.tolist()) <= set(chosen.tolist())
        truth = chosen[np.argsort(-(x[chosen] @ queries[q]), kind="stable")[:20]]
        assert i.tolist() == truth.tolist()
        np.testing.assert_allclose(s, x[i] @ queries[q], atol=1e-5)
    if factory.startswith("IVF"):
        set_nprobe(index, 1)  # the index's setting carries into the selector's parameters
        _, one = search(index, queries, 20, selector=selector)
        assert sum(len(r) for r in one) < sum(len(r) for r in ids)
