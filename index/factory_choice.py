"""``--factory auto`` by measurement: which ANN index serves the service's depth fastest.

The service searches ``depth`` (1,000) neighbours per query, because thresholds count what passes
them among those, and it searches one query at a time on one thread. So the candidates are judged
there, on the model's own held-out queries, not at k = 10: recall@k and recall@depth against exact
search, and the p50 / p99 of one query's search of ``depth`` neighbours. The fastest candidate (by
p50) reaching both recall targets is kept, and every trial is recorded with the reason.

Candidates, after the rule-based inverted file (:func:`index.vector_index.choose_factory`) is built
and its nprobe tuned:

* **IVF<k>,...** as built (a scan of the k centroids finds the lists to probe);
* **IVF<k>_HNSW32,...**: the same centroids and inverted lists, the lists found through an HNSW
  graph over the centroids (only that small graph is built; vectors stay in the lists the exact
  scan assigned them to), nprobe tuned again;
* **HNSW32** over every vector, where raw vectors and the graph fit the memory budget. A graph over
  1M vectors costs a minute on 2 cores (62 s for the demo's 1M embeddings), so above twice
  :data:`HNSW_SAMPLE` vectors graphs are first built on random samples of half of and all
  :data:`HNSW_SAMPLE` vectors and searched at efSearch = depth, the cheapest setting that can
  return ``depth`` neighbours; their p50 ratio, compounded per doubling up to the full size
  (:func:`extrapolated_p50`), predicts the full graph's p50, and the full graph is built only when
  that is not clearly slower than the best inverted file;
* **IVF<k>,SQ8,RFlat**: the same number of lists over 8-bit scalar codes scanned by the compiled
  kernel of :mod:`index.list_scan`, each search's candidates re-ranked exactly from the raw vectors
  (:mod:`index.rerank`), nprobe tuned; where the raw vectors, their copy and the codes (twice) fit
  the memory budget. On the demo's 1M embeddings it searched the depth in about 0.6x the time of
  FAISS's own SQ8 re-ranking at the same nprobe (docs/results/2026-11-28-sq8-scan.md); the 4-bit
  fast-scan codes tried before (``PQ<dim/2>x4fs``) took 0.72x the inverted file's time
  (docs/results/2026-11-27-rerank-served-1m.md).

The fastest is kept only when faster by more than :data:`NOISE_MARGIN`; otherwise the simpler
candidate earlier in the list stays.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, cast

import faiss
import numpy as np

from icr.index.rerank import Rerank, RerankedIndex
from icr.index.vector_index import (
    ExactTopK,
    build_index,
    omp_threads,
    parse_factory,
    random_training_sample,
    recall_lower_bound,
    recall_per_query,
    set_nprobe,
    tune_nprobe,
)

HNSW_M = 32  # graph degree: FAISS's usual choice for both the full graph and the coarse quantizer
HNSW_SAMPLE = 100_000  # vectors in the trial graphs that decide whether a full graph is worth building
# A full graph is built unless its extrapolated p50 is at least this times the best so far: the
# extrapolation is rough. On the 16-epoch demo model's 1M embeddings (2026-11-24) the samples took
# 0.97 and 1.24 ms and the full graph 2.53 ms (1.24x per doubling from 100k on, the samples' 1.28x):
# compounding predicts 2.80 ms, the straight line in log2(n) used before 2.14 ms, which built a
# 60 s graph that lost to IVF's 1.90 ms. (That line had overestimated an earlier model: 2.88 and
# 3.60 ms predicted, 2.38 ms built.)
PRUNE_SAFETY = 1.25
# A candidate replaces the simpler one only when faster by more than this share of the p50: 200
# queries' p50 moves by a few per cent between runs.
NOISE_MARGIN = 0.05
# efSearch tried, as multiples of the depth (a smaller efSearch cannot return depth neighbours)
EF_CHOICES = (1, 2, 4)
SEED = 0  # the HNSW trials' random samples


@dataclass
class Trial:
    """One candidate as measured (``setting``: nprobe or efSearch; latencies of one query's search of
    the depth on the service's thread count; None where the candidate was ruled out unbuilt)."""

    factory: str
    setting: dict[str, int]
    vectors: int
    recall_at_k: float | None = None
    recall_at_depth: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    build_seconds: float = 0.0
    meets_targets: bool = False
    note: str = ""


@dataclass
class Choice:
    """The kept index (the built inverted file, possibly with an HNSW coarse quantizer, a new HNSW
    graph, or new fast-scan codes re-ranked from the raw vectors), its factory, why, and every trial."""

    index: faiss.Index | RerankedIndex
    factory: str
    reason: str
    trials: list[Trial]
    nprobe: int | None
    ef_search: int | None
    recall: float
    recall_at_depth: float | None

    def trials_json(self) -> list[dict[str, Any]]:
        return [asdict(t) for t in self.trials]


@dataclass
class Targets:
    """recall@k >= ``recall`` and recall@depth >= ``depth_recall``, both tie-aware against exact."""

    k: int
    recall: float
    depth: int
    depth_recall: float

    def met(self, recall: float | None, deep: float | None) -> bool:
        return (recall or 0.0) >= self.recall and (deep or 0.0) >= self.depth_recall


def depth_latency(
    index: faiss.Index | RerankedIndex, queries: np.ndarray, depth: int, threads: int = 1
) -> tuple[float, float]:
    """(p50, p99) milliseconds of single-query searches of ``depth`` neighbours on ``threads`` threads,
    as the service runs them (``ICR_FAISS_THREADS`` defaults to 1)."""
    with omp_threads(threads):
        index.search(queries[:1], depth)  # warm-up: page in the structures
        times = []
        for q in queries:
            t0 = time.perf_counter()
            index.search(q[None], depth)
            times.append(time.perf_counter() - t0)
    ms = 1e3 * np.asarray(times)
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def swap_quantizer(index: faiss.Index, quantizer: Any) -> Any:
    """Make ``quantizer`` the coarse quantizer of the inverted file ``index`` (which then owns it);
    returns the previous quantizer, now owned by the returned Python object (SWIG's ``thisown``).
    Only for an index that owns its quantizer (``index_factory``, ``read_index``)."""
    ivf = faiss.extract_index_ivf(index)
    if not ivf.own_fields:
        raise ValueError("the index does not own its quantizer; swapping it would free it twice")
    previous: Any = ivf.quantizer
    previous.thisown = True  # freed with the returned object, not with the index
    ivf.quantizer = quantizer
    quantizer.thisown = False  # freed with the index
    return previous


def hnsw_quantizer(index: faiss.Index, m: int = HNSW_M) -> faiss.Index:
    """An HNSW graph over the centroids of the inverted file ``index`` (same ids as its lists)."""
    ivf = faiss.extract_index_ivf(index)
    centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist)  # (nlist, D)
    graph = faiss.IndexHNSWFlat(ivf.d, m, ivf.metric_type)
    graph.add(centroids)
    return graph


def coarse_hnsw_factory(factory: str, m: int = HNSW_M) -> str:
    """``IVF4000,Flat`` -> ``IVF4000_HNSW32,Flat`` (unchanged when it already has one)."""
    spec = parse_factory(factory)
    if "coarse_hnsw" in spec:
        return factory
    return f"IVF{spec['nlist']}_HNSW{m}," + factory.partition(",")[2]


def tune_ef_search(
    index: faiss.Index, exact: ExactTopK | np.ndarray | faiss.Index, queries: np.ndarray, targets: Targets
) -> tuple[int, float, float]:
    """(smallest efSearch of depth x :data:`EF_CHOICES` reaching both targets (by the lower
    confidence bound of the mean, as :func:`index.vector_index.tune_nprobe`), else the largest; the
    mean recall@k of the top k of a depth search (what the service shows); mean recall@depth);
    sets it. FAISS searches an HNSW graph with max(efSearch, k) candidates, so a depth search never
    uses fewer than the depth."""
    hnsw = cast(Any, faiss.downcast_index(index)).hnsw  # the stubs know only the base class
    recalls = deep = np.zeros(1)
    for multiple in EF_CHOICES:
        hnsw.efSearch = multiple * targets.depth
        # with efSearch >= depth a k-neighbour search walks the same candidates as a depth search
        recalls = recall_per_query(index, exact, queries, targets.k)  # (Q,)
        deep = recall_per_query(index, exact, queries, targets.depth)  # (Q,)
        if targets.met(recall_lower_bound(recalls), recall_lower_bound(deep)):
            break
    return int(hnsw.efSearch), float(recalls.mean()), float(deep.mean())


def choose_by_measurement(
    index: faiss.Index,
    factory: str,
    reason: str,
    exact: ExactTopK,
    queries: np.ndarray,
    targets: Targets,
    *,
    memory_budget_bytes: int,
    threads: int = 1,
    log: Callable[[str], None] | None = None,
) -> Choice:
    """Measure the built inverted file ``index`` (``factory``, chosen for ``reason``) against the
    alternatives of the module docstring and keep the fastest that meets ``targets`` (the inverted
    file when none does: it always reaches them by nprobe = nlist)."""
    say = log or (lambda _msg: None)
    targets = replace(targets, depth=min(targets.depth, index.ntotal))
    trials = [_ivf_trial(index, factory, exact, queries, targets, threads, 0.0)]
    say(_describe(trials[-1], targets))

    t0 = time.perf_counter()
    scan = swap_quantizer(index, hnsw_quantizer(index))
    coarse = _ivf_trial(
        index, coarse_hnsw_factory(factory), exact, queries, targets, threads, time.perf_counter() - t0
    )
    trials.append(coarse)
    say(_describe(coarse, targets))
    winner = trials[0]
    if _faster(coarse, winner):
        winner = coarse  # the index keeps the graph; the scan is freed with ``scan``
    else:
        swap_quantizer(index, scan)  # back to the scan; the graph is freed with the returned object
        set_nprobe(index, winner.setting["nprobe"])

    full, graph = _hnsw_trial(
        index, factory, exact, queries, targets, winner, memory_budget_bytes, threads, say
    )
    trials.append(full)
    say(_describe(full, targets))
    kept: faiss.Index | RerankedIndex = index
    if graph is not None and _faster(full, winner):
        kept, winner = graph, full

    reranked, trial = _rerank_trial(index, factory, exact, queries, targets, memory_budget_bytes, threads)
    trials.append(trial)
    say(_describe(trial, targets))
    if reranked is not None and _faster(trial, winner):
        kept, winner = reranked, trial
    why = (
        f"{reason}. Then measured at the service's depth ({targets.depth:,} neighbours per query, "
        f"{len(queries)} held-out queries, {threads} thread{'s' if threads > 1 else ''}; targets "
        f"recall@{targets.k} >= {targets.recall} and recall@{targets.depth} >= {targets.depth_recall}): "
        + "; ".join(_describe(t, targets) for t in trials)
        + f". Kept {winner.factory}: the fastest (p50) meeting both targets, by more than "
        f"{NOISE_MARGIN:.0%} over any simpler candidate"
        + (
            ""
            if any(t.meets_targets for t in trials)
            else " (none did; the inverted file at its largest nprobe)"
        )
    )
    return Choice(
        kept,
        winner.factory,
        why,
        trials,
        nprobe=winner.setting.get("nprobe"),
        ef_search=winner.setting.get("efSearch"),
        recall=float(winner.recall_at_k or 0.0),
        recall_at_depth=winner.recall_at_depth,
    )


def _faster(candidate: Trial, than: Trial) -> bool:
    """Whether ``candidate`` meets the targets and its p50 is below ``than``'s by more than the noise."""
    return (
        candidate.meets_targets
        and candidate.p50_ms is not None
        and than.p50_ms is not None
        and candidate.p50_ms < (1 - NOISE_MARGIN) * than.p50_ms
    )


def _ivf_trial(
    index: faiss.Index | RerankedIndex,
    factory: str,
    exact: ExactTopK,
    queries: np.ndarray,
    targets: Targets,
    threads: int,
    build_seconds: float,
) -> Trial:
    nprobe, recall, deep = tune_nprobe(
        index,
        exact,
        queries,
        targets.k,
        targets.recall,
        depth=targets.depth,
        depth_target=targets.depth_recall,
    )
    p50, p99 = depth_latency(index, queries, targets.depth, threads)
    return Trial(
        factory,
        {"nprobe": nprobe},
        index.ntotal,
        recall,
        deep,
        p50,
        p99,
        build_seconds,
        targets.met(recall, deep),
    )


def _hnsw_trial(
    ivf_index: faiss.Index,
    ivf_factory: str,
    exact: ExactTopK,
    queries: np.ndarray,
    targets: Targets,
    best: Trial,
    memory_budget_bytes: int,
    threads: int,
    say: Callable[[str], None],
) -> tuple[Trial, faiss.Index | None]:
    """The HNSW candidate: ruled out unbuilt, ruled out by its samples, or built and measured in full."""
    n, dim = ivf_index.ntotal, ivf_index.d
    factory = f"HNSW{HNSW_M}"
    if "pq" in parse_factory(ivf_factory):
        return Trial(
            factory, {}, n, note="not built: the raw vectors it needs exceed the memory budget"
        ), None
    need = n * (4 * dim + 2 * HNSW_M * 4)  # raw vectors + the bottom layer's 2M neighbour ids
    if need > memory_budget_bytes:
        note = f"not built: vectors + graph ({need / 2**20:,.0f} MiB) exceed the memory budget"
        return Trial(factory, {}, n, note=note), None
    ivf = faiss.extract_index_ivf(ivf_index)
    ivf.make_direct_map()  # reconstruct by id (the vectors sit in the lists in list order)
    note = ""
    try:
        if n > 2 * HNSW_SAMPLE:  # below that a sample saves too little to be worth it
            predicted, note = _predicted_p50(ivf, queries, targets.depth, threads)
            assert best.p50_ms is not None
            if predicted >= PRUNE_SAFETY * best.p50_ms:
                note = (
                    f"not built in full: {note}, at least {PRUNE_SAFETY}x {best.factory}'s "
                    f"{best.p50_ms:.2f} ms"
                )
                return Trial(factory, {"efSearch": targets.depth}, n, p50_ms=predicted, note=note), None
            say(f"{factory}: {note}; building it on all {n:,}")
        t0 = time.perf_counter()
        graph = _graph(ivf, np.arange(n))
        built = time.perf_counter() - t0
    finally:
        ivf.set_direct_map_type(faiss.DirectMap.NoMap)  # type: ignore[attr-defined]
    ef, recall, deep = tune_ef_search(graph, exact, queries, targets)
    p50, p99 = depth_latency(graph, queries, targets.depth, threads)
    met = targets.met(recall, deep)
    return Trial(factory, {"efSearch": ef}, n, recall, deep, p50, p99, built, met, note), graph


def _rerank_trial(
    ivf_index: faiss.Index,
    ivf_factory: str,
    exact: ExactTopK,
    queries: np.ndarray,
    targets: Targets,
    memory_budget_bytes: int,
    threads: int,
) -> tuple[RerankedIndex | None, Trial]:
    """The re-ranked candidate (index/rerank.py): 8-bit scalar codes of dim bytes over the same number
    of lists, re-ranked from the raw vectors; built from the inverted file's raw vectors."""
    n, dim = ivf_index.ntotal, ivf_index.d
    spec = parse_factory(ivf_factory)
    factory = f"IVF{spec['nlist']},SQ8,RFlat"
    if "pq" in spec:
        return None, Trial(
            factory, {}, n, note="not built: the raw vectors it re-ranks from exceed the memory budget"
        )
    # the inverted file's vectors, their copy, the codes in FAISS's lists and in the scan's copy
    need = 2 * n * dim * 4 + 2 * n * dim
    if need > memory_budget_bytes:
        note = f"not built: both indices at once ({need / 2**20:,.0f} MiB) exceed the memory budget"
        return None, Trial(factory, {}, n, note=note)
    ivf = faiss.extract_index_ivf(ivf_index)
    ivf.make_direct_map()
    try:
        t0 = time.perf_counter()
        raw = np.ascontiguousarray(ivf.reconstruct_n(0, n), dtype=np.float32)  # (n, D) in id order
        sample = random_training_sample(raw, factory, SEED)  # as the build of this factory trains
        codes = build_index(raw, dim, factory, train_sample=sample, gpu="off")
        reranked = RerankedIndex(codes, raw, 0, Rerank.for_factory(factory))
        built = time.perf_counter() - t0
    finally:
        ivf.set_direct_map_type(faiss.DirectMap.NoMap)  # type: ignore[attr-defined]
    return reranked, _ivf_trial(reranked, factory, exact, queries, targets, threads, built)


def extrapolated_p50(half: float, full: float, doublings: float) -> float:
    """The p50 of a graph ``doublings`` times the size of the one that took ``full`` ms, when one of
    half that size took ``half`` ms: the ratio per doubling compounded (never below 1, a larger
    graph is not faster). Compounding follows the cache misses that grow with the graph, which a
    straight line in log2(n) underestimates (see :data:`PRUNE_SAFETY`)."""
    ratio = max(1.0, full / half) if half > 0 else 1.0
    return float(full * ratio**doublings)


def _predicted_p50(ivf: faiss.IndexIVF, queries: np.ndarray, depth: int, threads: int) -> tuple[float, str]:
    """(p50 ms of a depth search of the full graph at efSearch = depth, extrapolated from random
    samples of half of and all :data:`HNSW_SAMPLE` vectors (:func:`extrapolated_p50`), a sentence
    saying so)."""
    n = ivf.ntotal
    ids = np.random.default_rng(SEED).choice(n, HNSW_SAMPLE, replace=False)
    p50s = []
    for size in (HNSW_SAMPLE // 2, HNSW_SAMPLE):  # nested samples: the half is the first half
        graph = _graph(ivf, np.sort(ids[:size]))
        graph.hnsw.efSearch = depth  # the cheapest setting that returns depth neighbours
        p50s.append(depth_latency(graph, queries, depth, threads)[0])
    predicted = extrapolated_p50(p50s[0], p50s[1], float(np.log2(n / HNSW_SAMPLE)))
    return predicted, (
        f"random samples of {HNSW_SAMPLE // 2:,} and {HNSW_SAMPLE:,} vectors take p50 {p50s[0]:.2f} and "
        f"{p50s[1]:.2f} ms per search of {depth:,} at efSearch {depth:,}, so about {predicted:.2f} ms "
        f"on all {n:,}"
    )


def _graph(ivf: faiss.IndexIVF, ids: np.ndarray, chunk: int = 65_536) -> Any:
    """An HNSW graph over the vectors ``ids`` of ``ivf`` (reconstructed chunk by chunk), ids 0..len-1."""
    graph = faiss.IndexHNSWFlat(ivf.d, HNSW_M, ivf.metric_type)
    for start in range(0, len(ids), chunk):
        graph.add(ivf.reconstruct_batch(ids[start : start + chunk]))  # (b, D)
    return graph


def _describe(t: Trial, targets: Targets) -> str:
    setting = ", ".join(f"{k} {v:,}" for k, v in t.setting.items())
    head = f"{t.factory}" + (f" ({setting})" if setting else "")
    if t.recall_at_k is None:
        return f"{head}: {t.note}"
    return (
        f"{head}: recall@{targets.k} {t.recall_at_k:.3f}, recall@{targets.depth:,} {t.recall_at_depth:.3f}, "
        f"p50 {t.p50_ms:.2f} ms, p99 {t.p99_ms:.2f} ms"
        + (f", built in {t.build_seconds:.1f} s" if t.build_seconds else "")
        + ("" if t.meets_targets else " (misses a target)")
    )
