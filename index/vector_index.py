"""FAISS over L2-normalised float32 embeddings with the inner-product metric (= cosine).

Builds on the GPU when one is visible and always hands back the CPU form (the only form written to
disk), streams the vectors in chunks so a million distractors never sit in memory at once, and
measures ANN recall against exact search in a tie-aware way.

FAISS facts this module relies on: a search for more neighbours than an index holds (or than an
IVF probe reaches) pads the result with id -1, which :func:`search` drops; GPU indices have no range
search, so thresholds are applied to a top-k by the caller.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeAlias

import faiss
import numpy as np
import torch

from icr.core.top_k import RunningTopK, padded_queries
from icr.index.graph import GraphIndex, GraphParams, graph_links, is_graph
from icr.index.rerank import RerankedIndex, codes_factory

# Exact search below this many vectors: a flat scan of 100k x 256 is a few ms per query.
FLAT_LIMIT = 100_000
# FAISS's k-means wants at least 39 points per centroid; 50 leaves a margin without a long training.
TRAIN_POINTS_PER_LIST = 50
# PQ codebooks have 256 centroids each; k-means wants ~39 points per centroid.
PQ_TRAIN_POINTS = 10_000
# PQ sub-quantizer counts FAISS supports on both CPU and GPU (8-bit codes).
PQ_SIZES = (1, 2, 3, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 96)
# Identical dot products can differ in the last bits depending on BLAS blocking; cosine scores
# closer than this count as tied.
TIE_TOL = 1e-6
ADD_ROWS = 16_384  # vectors per add call (see _coalesced)
# Tuning stops at the first setting whose mean recall over the held-out queries is above the target
# by this many standard errors (one-sided 95 %): a mean just at the target (0.9507 for 0.95 on 200
# queries) left other queries below it (0.947 on the bench's search-section queries, 2026-11-24).
CONFIDENCE_Z = 1.645
GPU_CHOICES = ("auto", "on", "off")
# What searches like a FAISS index here: one, fast-scan codes re-ranked from raw vectors, or a graph
Searchable: TypeAlias = faiss.Index | RerankedIndex | GraphIndex

_FACTORY = re.compile(
    r"^(Flat|HNSW(?P<hnsw>\d+)|IVF(?P<nlist>\d+)(_HNSW(?P<coarse>\d+))?,(Flat|PQ(?P<pq>\d+)(?P<rerank>(x4fs)?,RFlat)?|(?P<sq>SQ8),RFlat))$"
)


# --- choosing and checking factories --------------------------------------------------------------
def parse_factory(factory: str) -> dict[str, int | str]:
    """{"kind": Flat|HNSW|IVF|Graph, "nlist", "m", "pq", "sq", "coarse_hnsw", "rerank"} of a supported
    factory string; ValueError otherwise. ``Graph<M>``: hnswlib's HNSW graph in cluster order
    (:mod:`index.graph`). ``IVF<k>_HNSW<m>,...`` is an inverted file whose coarse quantizer
    (the search for the nprobe nearest lists) is an HNSW graph over the k centroids instead of a scan.
    ``IVF<k>,PQ<m>x4fs,RFlat``: 4-bit PQ codes scanned with SIMD, re-ranked exactly from the raw
    vectors (:mod:`index.rerank`); ``IVF<k>,PQ<m>,RFlat``: 8-bit codes re-ranked the same way (the
    on-disk form: FAISS keeps no fast-scan lists on disk); ``IVF<k>,SQ8,RFlat``: 8-bit scalar codes
    (one byte per dimension) scanned by a compiled kernel (:mod:`index.list_scan`), re-ranked the
    same way."""
    if is_graph(factory):
        return {"kind": "Graph", "m": graph_links(factory)}
    match = _FACTORY.match(factory)
    if not match:
        raise ValueError(
            f"unsupported index factory {factory!r}; use auto, Flat, HNSW32, IVF<k>,Flat, IVF<k>,PQ<m>, "
            "IVF<k>,PQ<m>,RFlat, IVF<k>,PQ<m>x4fs,RFlat, IVF<k>,SQ8,RFlat, IVF<k>_HNSW32,Flat or Graph<M> "
            "(e.g. IVF4000,Flat, "
            "IVF4000,PQ32, IVF4000,PQ64x4fs,RFlat or Graph16)"
        )
    if factory == "Flat":
        return {"kind": "Flat"}
    if match["hnsw"]:
        return {"kind": "HNSW", "m": int(match["hnsw"])}
    parsed: dict[str, int | str] = {"kind": "IVF", "nlist": int(match["nlist"])}
    if match["pq"]:
        parsed["pq"] = int(match["pq"])
    if match["coarse"]:
        parsed["coarse_hnsw"] = int(match["coarse"])
    if match["sq"]:
        parsed["sq"] = 8
    if match["rerank"] or match["sq"]:
        parsed["rerank"] = 1
    return parsed


def has_gpu_form(factory: str) -> bool:
    """Whether faiss can hold ``factory`` (any factory string) on a GPU: not an HNSW graph (FAISS's
    or hnswlib's), nor an inverted file whose lists are found through one, nor fast-scan codes (CPU
    SIMD kernels)."""
    return "HNSW" not in factory and "x4fs" not in factory and not is_graph(factory)


def choose_factory(n: int, dim: int, memory_budget_bytes: int) -> tuple[str, str]:
    """(factory, reason) for ``n`` vectors of ``dim`` floats within ``memory_budget_bytes``.

    Exact ``Flat`` below :data:`FLAT_LIMIT` (within the budget); otherwise an inverted file with
    ``nlist ~ 4 sqrt(n)`` lists, storing raw vectors (exact scores inside the probed lists) when they
    fit the budget and product-quantised codes when they do not. This is where ``--factory auto``
    starts: an in-memory build then measures an HNSW coarse quantizer and a full HNSW graph beside
    the inverted file at the service's depth (:mod:`index.factory_choice`).
    """
    if n < 0 or dim < 1:
        raise ValueError(f"need n >= 0 and dim >= 1, got n={n}, dim={dim}")
    flat_bytes = n * dim * 4
    size = f"{n:,} x {dim} float32 = {flat_bytes / 2**20:,.0f} MiB"
    if n < FLAT_LIMIT and flat_bytes <= memory_budget_bytes:
        return "Flat", f"{n:,} vectors < {FLAT_LIMIT:,}: exact search is fast enough ({size})"
    nlist = max(1, round(4 * math.sqrt(n)))
    many = f"{n:,} vectors >= {FLAT_LIMIT:,}" if n >= FLAT_LIMIT else f"{n:,} vectors"
    if flat_bytes <= memory_budget_bytes:
        return (
            f"IVF{nlist},Flat",
            f"{many}: inverted file with 4*sqrt(n) = {nlist} lists; raw vectors "
            f"({size}) fit the memory budget of {memory_budget_bytes / 2**20:,.0f} MiB",
        )
    fitting = [m for m in PQ_SIZES if dim % m == 0 and n * m <= memory_budget_bytes]
    if not fitting:
        smallest = min(m for m in PQ_SIZES if dim % m == 0)
        raise ValueError(
            f"even {smallest}-byte PQ codes for {n:,} vectors ({n * smallest / 2**20:,.0f} MiB) exceed the "
            f"memory budget of {memory_budget_bytes / 2**20:,.0f} MiB; raise the budget or index fewer "
            "vectors"
        )
    m = max(fitting)
    return (
        f"IVF{nlist},PQ{m}",
        f"{many}: inverted file with 4*sqrt(n) = {nlist} lists; raw vectors "
        f"({size}) exceed the memory budget of {memory_budget_bytes / 2**20:,.0f} MiB, so {m}-byte PQ codes "
        f"({n * m / 2**20:,.0f} MiB)",
    )


# --- building -------------------------------------------------------------------------------------
def _as_matrix(x: np.ndarray, dim: int, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"{what} must be (N, {dim}), got shape {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _chunks(vectors: np.ndarray | Iterable[np.ndarray], dim: int, chunk: int = 65536) -> Iterator[np.ndarray]:
    """(b, D) float32 chunks of an array or of an iterator of arrays."""
    if isinstance(vectors, np.ndarray):
        if vectors.ndim != 2 or vectors.shape[1] != dim:
            raise ValueError(f"vectors must be (N, {dim}), got shape {vectors.shape}")
        # converted chunk by chunk: a memory-mapped array is never read whole
        for start in range(0, len(vectors), chunk):
            yield _as_matrix(vectors[start : start + chunk], dim, "vectors")
        return
    for block in vectors:
        yield _as_matrix(block, dim, "a chunk of vectors")


def _coalesced(blocks: Iterable[np.ndarray], rows: int) -> Iterator[np.ndarray]:
    """The same rows in (>= ``rows``, D) blocks (the last may be shorter): an inverted file's add
    pays a parallel region and a pass over the centroids per call, so a stream of 256-row batches
    added one by one cost 52 s of a 1M-vector build on 2 cores (5 s in 16,384-row blocks, 8 MiB
    each at dim 128)."""
    held: list[np.ndarray] = []
    count = 0
    for block in blocks:
        held.append(block)
        count += len(block)
        if count >= rows:
            yield np.concatenate(held) if len(held) > 1 else held[0]
            held, count = [], 0
    if held:
        yield np.concatenate(held) if len(held) > 1 else held[0]


def use_gpu(gpu: str) -> bool:
    """Whether to build on the GPU: ``on`` requires one, ``auto`` uses one when faiss sees it."""
    if gpu not in GPU_CHOICES:
        raise ValueError(f"gpu must be one of {GPU_CHOICES}, got {gpu!r}")
    if gpu == "off":
        return False
    available = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    if gpu == "on" and not available:
        raise ValueError(
            "--gpu on, but faiss sees no GPU (faiss-cpu installed, or no CUDA device visible); install the "
            "[gpu] extra on a GPU machine, or use --gpu auto / off"
        )
    return available


def _train_needed(spec: dict[str, int | str]) -> int:
    """The fewest training vectors FAISS accepts for this factory."""
    if spec["kind"] != "IVF":
        return 0
    centroids = 16 if "rerank" in spec else 256 if "pq" in spec else 1  # per PQ codebook: 4 or 8 bits
    return max(int(spec["nlist"]), centroids)


def build_index(
    vectors: np.ndarray | Iterable[np.ndarray],
    dim: int,
    factory: str,
    *,
    train_sample: np.ndarray | None = None,
    gpu: str = "auto",
    report: dict[str, str] | None = None,
) -> faiss.Index:
    """A CPU index holding ``vectors`` (ids 0..N-1 in order), built on the GPU when asked/available.

    ``vectors`` is an (N, D) array or an iterator of (b, D) arrays, consumed once: only the IVF
    training sample (``train_sample``, else the first ``50 * nlist`` streamed vectors, at least
    10,000 for PQ) is buffered. Vectors must already be L2-normalised; the metric is inner product.
    ``report``, if given, receives ``built_on`` (cpu | gpu) and, when ``gpu="auto"`` could not put
    this factory on the GPU, ``gpu_fallback`` (why it stayed on the CPU).
    """
    spec = parse_factory(factory)
    on_gpu = use_gpu(gpu)
    report = {} if report is None else report
    if on_gpu and not has_gpu_form(factory):
        if gpu == "on":
            raise ValueError(f"{factory} has no GPU form in faiss; use --gpu auto or off, or an IVF factory")
        on_gpu = False
        report["gpu_fallback"] = f"{factory} has no GPU form in faiss"
    index = empty_index(dim, factory)
    resources = None  # must outlive the GPU index: it holds the index's GPU memory and streams
    if on_gpu:
        index, resources = _to_gpu(index, factory, gpu, report)
        on_gpu = resources is not None
    report["built_on"] = "gpu" if on_gpu else "cpu"

    stream = _chunks(vectors, dim)
    pending = [] if index.is_trained else _train(index, stream, spec, train_sample, factory)
    for block in _coalesced(itertools.chain(pending, stream), ADD_ROWS):
        index.add(block)
    if on_gpu:
        index = faiss.index_gpu_to_cpu(index)
    return index


def empty_index(dim: int, factory: str) -> faiss.Index:
    """An untrained inner-product index of ``factory`` (any string FAISS parses; of a re-ranked
    factory, its codes: the raw vectors are kept beside the index, :mod:`index.rerank`).

    PQ codes skip polysemous training (on by default): ~12 s of annealing for codes that only a
    Hamming-filtered search uses, which this project never does.
    """
    index = faiss.index_factory(dim, codes_factory(factory), faiss.METRIC_INNER_PRODUCT)
    ivf = _ivf(index)
    if ivf is not None:
        ivfpq: Any = faiss.downcast_index(ivf)  # the stubs declare the base class
        if hasattr(ivfpq, "do_polysemous_training"):
            ivfpq.do_polysemous_training = False
    return index


def _to_gpu(index: faiss.Index, factory: str, gpu: str, report: dict[str, str]) -> tuple[faiss.Index, Any]:
    """(the GPU copy, its resources), or (``index``, None) where ``gpu="auto"`` falls back to the CPU."""
    resources = faiss.StandardGpuResources()
    options = faiss.GpuClonerOptions()
    # fp16 lookup tables let GPU IVF-PQ use up to 96 sub-quantizers; raw IVF/Flat vectors stay fp32
    options.useFloat16 = "pq" in parse_factory(factory)
    try:
        return faiss.index_cpu_to_gpu(resources, 0, index, options), resources
    except RuntimeError as err:  # e.g. a PQ layout the GPU kernels do not support
        if gpu == "on":
            raise ValueError(
                f"faiss cannot build {factory} on the GPU ({err}); use --gpu auto or off"
            ) from None
        report["gpu_fallback"] = f"faiss cannot build {factory} on the GPU: {str(err).strip()[:200]}"
        return index, None


def training_size(spec: dict[str, Any]) -> int:
    """How many vectors an IVF factory (:func:`parse_factory`) trains on."""
    wanted = TRAIN_POINTS_PER_LIST * int(spec["nlist"])
    return max(wanted, PQ_TRAIN_POINTS) if "pq" in spec else wanted


def random_training_sample(vectors: np.ndarray, factory: str, seed: int = 0) -> np.ndarray:
    """(T, D) float32: the rows ``factory`` trains on, drawn at random from all of ``vectors``
    (N, D), in row order (a memory-mapped array is read front to back). A stream's first vectors
    can be one corner of a collection: a photo folder streams in path order."""
    wanted = min(training_size(parse_factory(factory)), len(vectors))
    rows = np.sort(np.random.default_rng(seed).choice(len(vectors), size=wanted, replace=False))
    return np.ascontiguousarray(vectors[rows], dtype=np.float32)


def _train(
    index: faiss.Index,
    stream: Iterator[np.ndarray],
    spec: dict[str, Any],
    train_sample: np.ndarray | None,
    factory: str,
) -> list[np.ndarray]:
    """Train ``index`` on ``train_sample``, else on the first streamed vectors; returns the chunks it
    took from ``stream`` (still to be added)."""
    dim = index.d
    wanted = training_size(spec)
    pending: list[np.ndarray] = []  # streamed chunks held back until the index is trained
    if train_sample is None:
        held = 0
        for block in stream:
            pending.append(block)
            held += len(block)
            if held >= wanted:
                break
        sample = np.concatenate(pending) if pending else np.zeros((0, dim), np.float32)
    else:
        sample = _as_matrix(train_sample, dim, "train_sample")
    sample = sample[:wanted]  # (T, D)
    if len(sample) < _train_needed(spec):
        raise ValueError(
            f"{factory} needs at least {_train_needed(spec)} training vectors, got {len(sample)}; "
            "use fewer lists (IVF<k> with smaller k) or Flat for an index this small"
        )
    # The stream feeding the build waits while this trains, so the k-means takes every core, even
    # where the producer narrowed OpenMP for itself (distractor rendering leaves torch, and so
    # FAISS, which shares its OpenMP runtime, one thread: 200,000 x 4,002 lists took 15 s, not 9).
    with omp_threads(len(os.sched_getaffinity(0))):
        index.train(sample)
    return pending


@contextmanager
def omp_threads(n: int) -> Iterator[None]:
    """FAISS's OpenMP threads set to ``n`` inside, restored after."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


def set_nprobe(index: Searchable, nprobe: int) -> None:
    """Number of inverted lists an IVF index scans per query (stored with the index on save)."""
    ivf = _ivf(index)
    if ivf is None:
        raise ValueError(f"nprobe applies to IVF indices only, not {type(index).__name__}")
    ivf.nprobe = max(1, min(int(nprobe), ivf.nlist))


def _ivf(index: Searchable) -> faiss.IndexIVF | None:
    if isinstance(index, GraphIndex):
        return None
    try:
        return faiss.extract_index_ivf(index.codes if isinstance(index, RerankedIndex) else index)
    except RuntimeError:
        return None


def nlist_of(index: Searchable) -> int | None:
    ivf = _ivf(index)
    return None if ivf is None else int(ivf.nlist)


def nprobe_of(index: Searchable) -> int | None:
    ivf = _ivf(index)
    return None if ivf is None else int(ivf.nprobe)


# --- searching ------------------------------------------------------------------------------------
def search(
    index: Searchable, queries: np.ndarray, k: int, *, nprobe: int | None = None, selector: Any = None
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Top-``k`` (scores, ids) per query as ragged lists, best first, FAISS's -1 padding dropped.

    Rows are ragged because a row is short when ``k`` exceeds the index size, and an IVF row can be
    short on its own when the probed lists hold fewer than ``k`` vectors. ``nprobe`` (IVF only)
    applies to this call alone, without changing the index, so concurrent callers do not interfere.
    ``selector`` (a ``faiss.IDSelector``): search only among the ids it selects; RuntimeError from
    indices that cannot (FAISS GPU indices before 1.9).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    queries = _as_matrix(queries, index.d, "queries")  # (Q, D)
    if index.ntotal == 0:
        empty = [np.zeros(0, np.float32) for _ in range(len(queries))]
        return empty, [np.zeros(0, np.int64) for _ in range(len(queries))]
    kk = min(k, index.ntotal)  # asking for more only allocates -1 padding
    params = _search_parameters(index, nprobe, selector)
    scores, ids = index.search(queries, kk, params=params)  # (Q, kk) each
    if ids.min() >= 0:  # nothing to drop: rows as they are (a few us less per search at k = 10)
        return list(scores), list(ids)
    keep = ids >= 0
    return (
        [s[m] for s, m in zip(scores, keep, strict=True)],
        [i[m] for i, m in zip(ids, keep, strict=True)],
    )


def _search_parameters(index: Searchable, nprobe: int | None, selector: Any) -> Any:
    """Per-call parameters, or None for the index's own settings. Parameters replace all of the
    index's settings for the call, so the index's current nprobe / efSearch are carried over."""
    if nprobe is None and selector is None:
        return None
    ivf = _ivf(index)
    if nprobe is not None and ivf is None:
        raise ValueError(f"nprobe applies to IVF indices only, not {type(index).__name__}")
    params: Any  # the stubs know neither SearchParametersHNSW nor the subclass relation
    if isinstance(index, GraphIndex):
        return GraphParams(selector)
    if ivf is not None:
        params = faiss.SearchParametersIVF()
        params.nprobe = max(1, min(int(nprobe if nprobe is not None else ivf.nprobe), ivf.nlist))
    elif hasattr(index, "hnsw"):
        params = faiss.SearchParametersHNSW()  # type: ignore[attr-defined]
        params.efSearch = index.hnsw.efSearch
    else:
        params = faiss.SearchParameters()
    if selector is not None:
        params.sel = selector
    return params


Rescorer = Callable[[np.ndarray, np.ndarray], np.ndarray]
VectorReader = Callable[[np.ndarray], np.ndarray]


def stored_vectors(index: Searchable) -> VectorReader | None:
    """``read(ids (n,)) -> (n, D) float32``: the vectors stored under ``ids``, as the index holds
    them (decoded from its codes for PQ or SQ: an approximation of what was added). An inverted
    file gets its direct map (id -> list position, 8 bytes per vector). None when this index cannot
    give its vectors back (FAISS GPU inverted files, an empty index). A re-ranked index gives the
    raw vectors it re-ranks with, and a graph the vectors it holds: exactly what was added."""
    if index.ntotal == 0:
        return None
    if isinstance(index, RerankedIndex | GraphIndex):
        return index.read
    try:
        ivf = _ivf(index)
        if ivf is not None and ivf.direct_map.no():  # made once: the rescorer asks too
            try:
                ivf.make_direct_map()  # an array: ids 0..n-1
            except RuntimeError:  # a compacted index's ids have holes: a hash table
                ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
        index.reconstruct_batch(np.full(1, _some_id(index), np.int64))
    except RuntimeError:
        return None

    def read(ids: np.ndarray) -> np.ndarray:
        return np.asarray(index.reconstruct_batch(np.ascontiguousarray(ids, dtype=np.int64)), np.float32)

    return read


def _some_id(index: faiss.Index) -> int:
    """An id ``index`` holds (a compacted index's ids have holes: 0 may be one)."""
    downcast: Any = faiss.downcast_index(index)
    if isinstance(downcast, faiss.IndexIDMap2 | faiss.IndexIDMap):
        return int(faiss.vector_to_array(downcast.id_map)[0])
    ivf = _ivf(index)
    if ivf is not None and ivf.invlists is not None:
        lists: Any = ivf.invlists  # the stubs lack get_single_id
        for i in range(ivf.nlist):
            if lists.list_size(i):
                return int(lists.get_single_id(i, 0))
    return 0


def batch_independent_rescorer(index: Searchable) -> Rescorer | None:
    """``rescore(query (D,), ids (n,)) -> (n,) float32``: the hits' scores recomputed from the stored
    vectors in float64 and rounded once, so a query gets the same scores whichever batch it was
    searched in (FAISS picks a BLAS kernel by batch size, and its float32 sums then differ by ~1e-7,
    enough to move a hit across a threshold). None when this index cannot reconstruct its vectors
    (e.g. an IVF index on a GPU): FAISS's scores are used as they are; and for a re-ranked index or
    a graph, whose search scores every hit pair by pair already (the same bits in any batch)."""
    if isinstance(index, RerankedIndex | GraphIndex):
        return None
    read = stored_vectors(index)
    if read is None:
        return None

    def rescore(query: np.ndarray, ids: np.ndarray) -> np.ndarray:
        if len(ids) == 0:
            return np.zeros(0, np.float32)
        vectors = read(ids)  # (n, D)
        return (vectors.astype(np.float64) @ np.asarray(query, np.float64)).astype(np.float32)  # (n,)

    return rescore


def rescored(
    rescore: Rescorer, queries: np.ndarray, ids: list[np.ndarray]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The ids of a :func:`search` result, each row rescored exactly, best first, ties by id
    (deterministic); FAISS's own scores are not needed."""
    out_s, out_i = [], []
    for query, row in zip(queries, ids, strict=True):
        exact = rescore(query, row)  # (n,)
        order = np.lexsort((row, -exact))
        out_s.append(exact[order])
        out_i.append(row[order])
    return out_s, out_i


class ExactTopK:
    """Exact top-``depth`` of fixed queries over vectors streamed in order (ids 0, 1, ...).

    Lets a build measure ANN recall against exact search without keeping the vectors: each chunk
    is scored against the queries while it streams past and offered to the same running top-k the
    exact search kernel selects with (:class:`icr.core.top_k.RunningTopK`: one comparison with each
    query's k-th best so far, only what beats it kept). ``scores`` / ``ids`` are sorted best first,
    ties by id. ``depth`` should exceed the recall ``k`` so that vectors tied with the k-th are known
    too.
    """

    def __init__(self, queries: np.ndarray, depth: int):
        self.queries = np.ascontiguousarray(queries, dtype=np.float32)  # (Q, D)
        self.depth = depth
        self.ntotal = 0
        self._padded_t = np.ascontiguousarray(padded_queries(self.queries).T)  # (D, Q8)
        self._top = RunningTopK(len(self.queries), depth, None)
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None

    def add(self, vectors: np.ndarray) -> None:
        vectors = _as_matrix(vectors, self.queries.shape[1], "vectors")  # (b, D)
        self._top.offer(torch.from_numpy(vectors @ self._padded_t), self.ntotal)  # (b, Q8) scores
        self.ntotal += len(vectors)
        self._sorted = None

    def _best_first(self) -> tuple[np.ndarray, np.ndarray]:
        if self._sorted is None:
            self._sorted = self._top.result()
        return self._sorted

    @property
    def scores(self) -> np.ndarray:
        """(Q, <=depth) best first."""
        return self._best_first()[0]

    @property
    def ids(self) -> np.ndarray:
        """(Q, <=depth) the vectors' ids, in the order of :attr:`scores` (ties by id)."""
        return self._best_first()[1]


def exact_top_k(
    exact: np.ndarray | faiss.Index | ExactTopK, queries: np.ndarray, depth: int
) -> tuple[np.ndarray, np.ndarray]:
    """(scores (Q, d), ids (Q, d)) of the exact search, best first; d = min(depth, N)."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    if isinstance(exact, ExactTopK):
        if exact.queries.shape != queries.shape or not np.array_equal(exact.queries, queries):
            raise ValueError("the ExactTopK accumulator was built for other queries")
        if exact.depth < depth and exact.ntotal > exact.depth:
            raise ValueError(f"the ExactTopK accumulator keeps {exact.depth} results, {depth} needed")
        return exact.scores[:, :depth], exact.ids[:, :depth]
    if isinstance(exact, np.ndarray):
        acc = ExactTopK(queries, depth)
        for block in _chunks(exact, queries.shape[1]):
            acc.add(block)
        return acc.scores, acc.ids
    if not isinstance(exact, faiss.IndexFlat) or exact.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise ValueError(f"exact search needs an (N, D) array or a flat index, not {type(exact).__name__}")
    scores, ids = exact.search(queries, max(1, min(depth, exact.ntotal)))
    return scores, ids


def exact_depth(k: int) -> int:
    """How deep the exact list must be to judge recall@k with ties: 2k, or k + 100 for large k."""
    return 2 * k if k <= 100 else k + 100


def recall_at_k(
    index: Searchable,
    exact: np.ndarray | faiss.Index | ExactTopK,
    queries: np.ndarray,
    k: int = 10,
    *,
    nprobe: int | None = None,
) -> float:
    """Mean fraction of the ANN top-``k`` that is in the exact top-``k``, counting ties.

    A returned id counts when its exact score is at least the k-th exact score (less
    :data:`TIE_TOL`), so an index that returns a different one of several tied vectors is not
    penalised. With fewer than ``k`` vectors the denominator is the index size.
    """
    return float(recall_per_query(index, exact, queries, k, nprobe=nprobe).mean())


def recall_per_query(
    index: Searchable,
    exact: np.ndarray | faiss.Index | ExactTopK,
    queries: np.ndarray,
    k: int = 10,
    *,
    nprobe: int | None = None,
) -> np.ndarray:
    """(Q,) each query's tie-aware recall@``k`` (see :func:`recall_at_k`)."""
    queries = _as_matrix(queries, index.d, "queries")  # (Q, D)
    if len(queries) == 0 or index.ntotal == 0:
        raise ValueError("recall needs at least one query and a non-empty index")
    # deeper than k: vectors tied with the k-th beyond position k are known to be acceptable too
    ex_scores, ex_ids = exact_top_k(exact, queries, exact_depth(k))  # (Q, <=exact_depth(k)) each
    _, ann_ids = search(index, queries, k, nprobe=nprobe)
    return recalls_of_ids(ann_ids, ex_scores, ex_ids, k)


def recall_of_ids(
    found: Iterable[np.ndarray], exact_scores: np.ndarray, exact_ids: np.ndarray, k: int
) -> float:
    """Mean tie-aware recall@``k`` of ``found`` (per query, ids best first; any engine's) against an
    exact top list at least :func:`exact_depth` (k) deep (-1 ids are padding). See :func:`recall_at_k`."""
    return float(recalls_of_ids(found, exact_scores, exact_ids, k).mean())


def recalls_of_ids(
    found: Iterable[np.ndarray], exact_scores: np.ndarray, exact_ids: np.ndarray, k: int
) -> np.ndarray:
    """(Q,) the per-query values :func:`recall_of_ids` averages."""
    out = []
    for row, ex_s, ex_i in zip(found, exact_scores, exact_ids, strict=True):
        valid = ex_i >= 0
        scores, ids = ex_s[valid], ex_i[valid]
        kk = min(k, len(ids))
        kth = scores[kk - 1]
        acceptable = set(ids[scores >= kth - TIE_TOL].tolist())
        out.append(sum(int(i) in acceptable for i in np.asarray(row)[:kk]) / kk)
    return np.asarray(out, dtype=np.float64)


def recall_lower_bound(recalls: np.ndarray) -> float:
    """One-sided 95 % lower confidence bound of the mean of per-query ``recalls``: the mean less
    :data:`CONFIDENCE_Z` standard errors (the mean itself for a single query)."""
    recalls = np.asarray(recalls, dtype=np.float64)
    if len(recalls) < 2:
        return float(recalls.mean())
    return float(recalls.mean() - CONFIDENCE_Z * recalls.std(ddof=1) / np.sqrt(len(recalls)))


def tune_nprobe(
    index: Searchable,
    exact: np.ndarray | faiss.Index | ExactTopK,
    queries: np.ndarray,
    k: int = 10,
    target: float = 0.95,
    *,
    depth: int | None = None,
    depth_target: float = 0.95,
) -> tuple[int, float, float | None]:
    """(smallest nprobe of :func:`nprobe_grid` reaching ``target`` recall@k and, with ``depth``, also
    ``depth_target`` recall@depth (else nlist); its mean recall@k; its mean recall@depth or None);
    sets it. "Reaching" means the lower confidence bound of the mean over ``queries``
    (:func:`recall_lower_bound`), so that queries not in the sample reach the targets too. Powers of
    two are tried first, then the steps between the first reaching and the one before it.

    ``depth`` is the service's search depth: thresholds count the hits passing them among the top
    ``depth``, so an nprobe tuned for recall@10 alone undercounts them. Tuned on the model's own
    embeddings: random vectors defeat every IVF setting and clustered ones make any look perfect.
    """
    nlist = nlist_of(index)
    if nlist is None:
        raise ValueError(f"nprobe applies to IVF indices only, not {type(index).__name__}")
    depth = None if depth is None else min(depth, index.ntotal)

    def measured(nprobe: int) -> tuple[bool, np.ndarray, np.ndarray | None]:
        return _reaches(index, exact, queries, (k, target), (depth, depth_target), nprobe >= nlist, nprobe)

    nprobe, recalls, deep = _smallest_reaching(nprobe_grid(nlist), measured)
    set_nprobe(index, nprobe)
    return nprobe, float(recalls.mean()), None if deep is None else float(deep.mean())


Measured = Callable[[int], tuple[bool, np.ndarray, np.ndarray | None]]


def _reaches(
    index: Searchable,
    exact: np.ndarray | faiss.Index | ExactTopK,
    queries: np.ndarray,
    at_k: tuple[int, float],
    at_depth: tuple[int | None, float],
    last: bool,
    nprobe: int | None = None,
) -> tuple[bool, np.ndarray, np.ndarray | None]:
    """(whether the lower confidence bounds reach ``at_k`` = (k, target) and, with a depth,
    ``at_depth`` = (depth, target); per-query recall@k; per-query recall@depth, measured where @k
    reached or on the ``last`` setting, else None)."""
    (k, target), (depth, depth_target) = at_k, at_depth
    recalls = recall_per_query(index, exact, queries, k, nprobe=nprobe)  # (Q,)
    reached = recall_lower_bound(recalls) >= target
    deep = None
    if depth and (reached or last):
        deep = recall_per_query(index, exact, queries, depth, nprobe=nprobe)  # (Q,)
        reached = reached and recall_lower_bound(deep) >= depth_target
    return reached, recalls, deep


def _smallest_reaching(grid: list[int], measured: Measured) -> tuple[int, np.ndarray, np.ndarray | None]:
    """(the smallest setting of ``grid`` (ascending) that ``measured`` says reaches its targets,
    else the last; its recalls) trying the powers of two (and the last) first, then the steps
    between the last miss and the first hit."""
    powers = [p for p in grid if p & (p - 1) == 0 or p == grid[-1]]
    below = 0  # the largest setting known to miss
    for value in powers:
        reached, recalls, deep = measured(value)
        if reached:
            break
        below = value
    for step in (p for p in grid if below < p < value):  # finer: between the last miss and the hit
        step_reached, step_recalls, step_deep = measured(step)
        if step_reached:
            return step, step_recalls, step_deep
    return value, recalls, deep


def tune_ef(
    index: GraphIndex,
    exact: np.ndarray | faiss.Index | ExactTopK,
    queries: np.ndarray,
    k: int = 10,
    target: float = 0.95,
    *,
    depth: int | None = None,
    depth_target: float = 0.95,
    most: int = 4096,
) -> tuple[int, float, float | None]:
    """:func:`tune_nprobe` for a graph: (smallest ef of :func:`nprobe_grid` (from ``k``, up to
    ``most``) reaching ``target`` recall@k and, with ``depth``, ``depth_target`` recall@depth by the
    lower confidence bound; its mean recall@k; its mean recall@depth or None); sets it. hnswlib
    searches with max(ef, k) candidates, so a search of ``depth`` is the same at every ef up to it."""
    depth = None if depth is None else min(depth, index.ntotal)

    def measured(ef: int) -> tuple[bool, np.ndarray, np.ndarray | None]:
        index.ef = ef
        return _reaches(index, exact, queries, (k, target), (depth, depth_target), ef >= most)

    ef, recalls, deep = _smallest_reaching([e for e in nprobe_grid(most) if e >= k] or [k], measured)
    index.ef = ef
    return ef, float(recalls.mean()), None if deep is None else float(deep.mean())


def nprobe_grid(nlist: int) -> list[int]:
    """The nprobe values tuning tries, up to ``nlist``: powers of two and three steps between each
    and the next (x 1.25, 1.5, 1.75). Doubling alone overshoots by up to 2x: on the 1M demo
    embeddings re-ranked (index/rerank.py) nprobe 128 missed recall@1000 0.95 by 0.0001, and 256
    searched 1.16x slower than the 160 that reached it (1.73 against 1.49 ms,
    docs/results/2026-11-27-rerank-served-1m.md)."""
    values = {nlist}
    p = 1
    while p < nlist:
        values.update((p, round(1.25 * p), round(1.5 * p), round(1.75 * p)))
        p *= 2
    return sorted(v for v in values if v <= nlist)


# --- saving ---------------------------------------------------------------------------------------
def save_index(index: faiss.Index, path: str | os.PathLike[str]) -> Path:
    """Write the CPU form of ``index`` to ``path`` (a GPU index is copied back first)."""
    path = Path(path)
    if hasattr(faiss, "GpuIndex") and isinstance(index, faiss.GpuIndex):
        index = faiss.index_gpu_to_cpu(index)
    faiss.write_index(index, str(path))
    return path


def load_index(path: str | os.PathLike[str], *, mmap: bool = False, on_disk: bool = False) -> faiss.Index:
    """Read an index written by :func:`save_index`; ``mmap`` maps it instead of reading it all;
    ``on_disk``: its inverted lists are a file beside it (``index.on_disk``), mapped from there."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: index file not found")
    flags = faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY if mmap else 0
    if on_disk:
        flags = faiss.IO_FLAG_ONDISK_SAME_DIR
    try:
        return faiss.read_index(str(path), flags)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[-1] if str(err).strip() else "unreadable"
        raise ValueError(f"{path}: not a readable FAISS index, truncated or corrupt ({first})") from None
