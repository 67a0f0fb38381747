"""``--factory auto`` by measurement: the quantizer swap keeps answers and memory ownership right,
efSearch tuning against a naive recall loop, and the choice keeps what its own trials say is fastest."""

from __future__ import annotations

import gc

import faiss
import numpy as np
import pytest

from icr.index import factory_choice
from icr.index.factory_choice import (
    Targets,
    choose_by_measurement,
    coarse_hnsw_factory,
    hnsw_quantizer,
    swap_quantizer,
    tune_ef_search,
)
from icr.index.rerank import RerankedIndex
from icr.index.vector_index import ExactTopK, build_index, load_index, parse_factory, save_index

DIM = 16
N = 3000
NLIST = 40


pytestmark = pytest.mark.usefixtures("faiss_one_thread")


def normalise(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def base() -> np.ndarray:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(30, DIM))
    return normalise(centres[rng.integers(0, 30, N)] + 0.4 * rng.normal(size=(N, DIM)))  # (N, D)


@pytest.fixture(scope="module")
def queries(base) -> np.ndarray:
    rng = np.random.default_rng(1)
    return normalise(base[rng.choice(N, 40, replace=False)] + 0.2 * rng.normal(size=(40, DIM)))  # (Q, D)


def naive_recall(found: np.ndarray, base: np.ndarray, queries: np.ndarray, k: int) -> float:
    """Tie-aware recall@k written independently: an id counts when its score reaches the k-th best."""
    total = 0.0
    for row, q in zip(found, queries, strict=True):
        scores = base @ q  # (N,)
        kth = np.sort(scores)[::-1][k - 1]
        total += sum(1 for i in row[:k] if i >= 0 and scores[i] >= kth - 1e-6) / k
    return total / len(queries)


def test_factory_strings():
    assert parse_factory("IVF64_HNSW32,Flat") == {"kind": "IVF", "nlist": 64, "coarse_hnsw": 32}
    assert parse_factory("IVF64,PQ8x4fs,RFlat") == {"kind": "IVF", "nlist": 64, "pq": 8, "rerank": 1}
    assert parse_factory("IVF64,SQ8,RFlat") == {"kind": "IVF", "nlist": 64, "sq": 8, "rerank": 1}
    with pytest.raises(ValueError, match="IVF<k>,PQ<m>x4fs,RFlat"):
        parse_factory("IVF64,PQ8x4fs")  # fast-scan codes alone: never served without re-ranking
    assert coarse_hnsw_factory("IVF4000,PQ16") == "IVF4000_HNSW32,PQ16"
    assert coarse_hnsw_factory("IVF64_HNSW32,Flat") == "IVF64_HNSW32,Flat"


def test_a_swapped_quantizer_answers_like_the_scan_and_survives_collection(base, queries, tmp_path):
    index = build_index(base, DIM, f"IVF{NLIST},Flat", gpu="off")
    faiss.extract_index_ivf(index).nprobe = NLIST  # every list: the answer is exact either way
    _, before = index.search(queries, 10)  # (Q, 10)
    scan = swap_quantizer(index, hnsw_quantizer(index))
    gc.collect()  # the graph now belongs to the index, the scan to ``scan``
    _, through_graph = index.search(queries, 10)
    assert naive_recall(through_graph, base, queries, 10) == naive_recall(before, base, queries, 10) == 1.0
    save_index(index, tmp_path / "g.faiss")
    loaded = load_index(tmp_path / "g.faiss")
    assert isinstance(faiss.downcast_index(faiss.extract_index_ivf(loaded).quantizer), faiss.IndexHNSWFlat)
    np.testing.assert_array_equal(loaded.search(queries, 10)[1], through_graph)
    graph = swap_quantizer(index, scan)  # and back
    del scan
    gc.collect()
    np.testing.assert_array_equal(index.search(queries, 10)[1], before)
    assert isinstance(faiss.downcast_index(graph), faiss.IndexHNSWFlat) and graph.ntotal == NLIST


def test_ef_search_is_the_smallest_listed_value_meeting_both_targets(base, queries):
    graph = faiss.IndexHNSWFlat(DIM, 8, faiss.METRIC_INNER_PRODUCT)  # a sparse graph: recall varies
    graph.add(base)
    depth = 200
    exact = ExactTopK(queries, depth + 100)
    exact.add(base)
    expected = None
    for multiple in factory_choice.EF_CHOICES:  # the naive loop: search depth, judge the first k and all
        graph.hnsw.efSearch = multiple * depth
        _, found = graph.search(queries, depth)
        r10, deep = naive_recall(found, base, queries, 10), naive_recall(found, base, queries, depth)
        if r10 >= 0.99 and deep >= 0.97:
            expected = (multiple * depth, r10, deep)
            break
    targets = Targets(10, 0.99, depth, 0.97)
    ef, recall, deep = tune_ef_search(graph, exact, queries, targets)
    if expected is None:  # none does: the largest is kept
        assert ef == factory_choice.EF_CHOICES[-1] * depth and not targets.met(recall, deep)
    else:
        assert (
            ef == expected[0] and recall == pytest.approx(expected[1]) and deep == pytest.approx(expected[2])
        )
    assert graph.hnsw.efSearch == ef


@pytest.mark.parametrize("sample", [N, 500])  # the full graph directly; a sample first
def test_the_choice_keeps_the_fastest_trial_meeting_the_targets(base, queries, sample, monkeypatch):
    monkeypatch.setattr(factory_choice, "HNSW_SAMPLE", sample)
    factory = f"IVF{NLIST},Flat"
    index = build_index(base, DIM, factory, gpu="off")
    exact = ExactTopK(queries, 400)
    exact.add(base)
    targets = Targets(10, 0.98, 300, 0.95)
    choice = choose_by_measurement(
        index, factory, "rule", exact, queries, targets, memory_budget_bytes=1 << 30
    )

    names = [t.factory for t in choice.trials]
    reranked = f"IVF{NLIST},SQ8,RFlat"
    assert names == [factory, f"IVF{NLIST}_HNSW32,Flat", "HNSW32", reranked]
    assert choice.trials[0].meets_targets  # the scan always gets there (nprobe up to nlist)
    # a later candidate replaces an earlier one only when it meets the targets and is faster beyond the noise
    scan, coarse, hnsw, rerank = choice.trials
    margin = 1 - factory_choice.NOISE_MARGIN
    ivf_winner = coarse if coarse.meets_targets and coarse.p50_ms < margin * scan.p50_ms else scan
    built = hnsw.recall_at_k is not None
    winner = hnsw if built and hnsw.meets_targets and hnsw.p50_ms < margin * ivf_winner.p50_ms else ivf_winner
    if rerank.meets_targets and rerank.p50_ms < margin * winner.p50_ms:
        winner = rerank
    assert rerank.vectors == N and rerank.recall_at_k is not None  # built (the budget allows it)
    assert choice.factory == winner.factory
    for t in choice.trials:  # a trial's verdict is its own numbers
        if t.recall_at_k is not None:
            assert t.meets_targets == targets.met(t.recall_at_k, t.recall_at_depth)
        assert t.factory in choice.reason
    if not built:  # ruled out by its samples: only when predicted clearly slower
        assert sample < N and "not built in full: random samples of 250 and 500 vectors" in hnsw.note
        assert hnsw.p50_ms >= factory_choice.PRUNE_SAFETY * ivf_winner.p50_ms
    else:
        assert hnsw.vectors == N and hnsw.setting["efSearch"] % targets.depth == 0

    # the kept index is what the winning trial measured, and it meets the targets when re-checked
    kept = choice.index
    assert kept.ntotal == N
    if winner.factory == reranked:
        assert isinstance(kept, RerankedIndex) and choice.nprobe == winner.setting["nprobe"]
        np.testing.assert_array_equal(kept.raw, base)  # the inverted file's vectors, in id order
    elif winner.factory == "HNSW32":
        assert isinstance(faiss.downcast_index(kept), faiss.IndexHNSWFlat)
        assert faiss.downcast_index(kept).hnsw.efSearch == choice.ef_search
    else:
        ivf = faiss.extract_index_ivf(kept)
        assert ivf.nprobe == choice.nprobe == winner.setting["nprobe"]
        quantizer = faiss.downcast_index(ivf.quantizer)
        assert isinstance(quantizer, faiss.IndexHNSWFlat) == ("HNSW" in winner.factory)
    _, found = kept.search(queries, targets.depth)
    assert naive_recall(found, base, queries, 10) >= targets.recall
    assert naive_recall(found, base, queries, targets.depth) >= targets.depth_recall


def test_no_hnsw_graph_where_the_raw_vectors_do_not_fit(base, queries):
    factory = f"IVF{NLIST},Flat"
    index = build_index(base, DIM, factory, gpu="off")
    exact = ExactTopK(queries, 400)
    exact.add(base)
    choice = choose_by_measurement(
        index, factory, "rule", exact, queries, Targets(10, 0.98, 300, 0.95), memory_budget_bytes=N * DIM * 4
    )
    assert "exceed the memory budget" in choice.trials[2].note and choice.factory != "HNSW32"
    assert "exceed the memory budget" in choice.trials[3].note and not choice.factory.endswith("RFlat")


def test_the_full_graph_p50_is_extrapolated_by_compounding_the_samples_ratio() -> None:
    # the 2026-11-24 demo embeddings: 0.97 and 1.24 ms at 50k and 100k, 2.53 ms built on 1,001,000
    doublings = float(np.log2(1_001_000 / 100_000))
    assert factory_choice.extrapolated_p50(0.97, 1.24, doublings) == pytest.approx(
        1.24 * (1.24 / 0.97) ** doublings
    )
    assert factory_choice.extrapolated_p50(0.97, 1.24, doublings) == pytest.approx(2.80, abs=0.01)
    assert factory_choice.extrapolated_p50(1.0, 1.0, 5.0) == 1.0  # no growth
    assert factory_choice.extrapolated_p50(1.2, 1.0, 3.0) == 1.0  # noise: a larger graph is not faster
    assert factory_choice.extrapolated_p50(0.5, 1.0, 0.0) == 1.0
