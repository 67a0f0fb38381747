"""ANN engines side by side on the same embeddings, queries, k, depth and threads: the index the
build chose (FAISS IVF at a sweep of nprobe), our re-ranked engine as the service searches it
(index/rerank.py), FAISS HNSW32, hnswlib and usearch, and FAISS's own re-ranking indices it was chosen
from: inverted files of compact codes re-ranked exactly (``REFINED``).

Two workloads, both one query per call on one thread (as the service searches):

* **k = 10**: a search of 10 neighbours; recall@10.
* **service depth** (1,000): a search of ``depth`` neighbours, as the service does before
  thresholding; recall@10 of its first 10 and recall@depth (what a threshold counts passes among).

Recall is tie-aware against exact search (:func:`index.vector_index.recall_of_ids`). For each
engine the table keeps every setting tried; the summary picks per engine the fastest setting (p50)
that reaches the targets (k = 10: recall@10 >= 0.98; depth: also recall@depth >= 0.95) and names
the winner. Build time (every core) is from the embeddings, for ours too (the same factory rebuilt
and timed); memory is the serialised index size. hnswlib and usearch
are optional (the ``dev`` extra installs them); a missing one is reported, not an error.

    python -m bench.ann_peers --index bench-work/index-100000 --exact bench-work/exact-100000 \\
        --checkpoint bench-work/model/best --data bench-work/data
    python -m bench.ann_peers --vectors gallery.npy --query-vectors captions.npy --factory IVF4000,Flat
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from bench.floors import cores
from bench.stats import latency
from icr.index.graph import GraphIndex, build_graph
from icr.index.rerank import Rerank, RerankedIndex
from icr.index.vector_index import (
    ExactTopK,
    build_index,
    exact_depth,
    nlist_of,
    omp_threads,
    recall_of_ids,
    search,
)

K = 10
RECALL_TARGET = 0.98
DEPTH_TARGET = 0.95
# powers of two and the steps between the largest (as the build's tuning: index.vector_index.nprobe_grid)
NPROBES = (8, 16, 32, 64, 96, 128, 160, 192, 256)
# HNSW candidate-list sizes for k = 10, every graph engine alike: powers of two and steps between
EFS_K = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256)
EFS_DEPTH_MULTIPLES = (
    1,
    2,
)  # and for the depth, as multiples of it (a list shorter than the depth is useless)
HNSW_M = 32  # FAISS HNSW32, as the build's candidate
PEER_M = 16  # hnswlib / usearch connectivity: both libraries' documented default
PAIRED_ROUNDS = 5  # rounds of the re-timing that decides the winner (paired_p50)
PEER_EF_CONSTRUCTION = 200  # hnswlib's README value; usearch's expansion_add is set to the same
# Candidates for our own engine: an inverted file of compact codes (4-bit PQ scanned with SIMD,
# "fast-scan", or 8-bit scalar codes), its best k x k_factor candidates re-ranked exactly from the
# raw vectors (RFlat). k_factor per workload: a list of 10 needs far more candidates per neighbour
# than a list of 1,000 (measured on the demo model's embeddings:
# docs/results/2026-11-27-ann-candidates-1m.md).
REFINED = (
    ("IVF{nlist},PQ{half}x4fs,RFlat", {"k10": 128, "depth": 4}),
    ("IVF{nlist},SQ8,RFlat", {"k10": 2, "depth": 1}),
)


class Engine:
    """A built index: search one query for ``k`` neighbours at a setting; its size in bytes."""

    name: str
    knob: str
    build_seconds: float

    def settings(self, depth: int | None) -> list[int]:
        """Values of the knob swept for a search of ``depth`` neighbours (None: k = 10)."""
        return [m * depth for m in EFS_DEPTH_MULTIPLES] if depth else list(EFS_K)

    def prepare(self, depth: int | None) -> None:
        """Set what is fixed per workload (a search of ``depth`` neighbours; None: k = 10)."""

    def set(self, value: int) -> None:
        raise NotImplementedError

    def search(self, query: np.ndarray, k: int) -> np.ndarray:  # (D,) -> ids best first
        raise NotImplementedError

    def bytes(self) -> int:
        raise NotImplementedError


class FaissEngine(Engine):
    """A FAISS index; its knob is nprobe (IVF), efSearch (HNSW) or none (Flat: exact, one setting)."""

    def __init__(self, name: str, index: faiss.Index, build_seconds: float):
        self.name, self.index, self.build_seconds = name, index, build_seconds
        self.ivf = faiss.try_extract_index_ivf(index)
        self.hnsw = getattr(faiss.downcast_index(index), "hnsw", None)
        self.knob = "nprobe" if self.ivf is not None else "efSearch" if self.hnsw is not None else "exact"

    def settings(self, depth: int | None) -> list[int]:
        if self.ivf is not None:
            return [p for p in NPROBES if p <= self.ivf.nlist]
        if self.hnsw is not None:
            return super().settings(depth)  # a graph: swept like the peers'
        return [0]

    def set(self, value: int) -> None:
        if self.ivf is not None:
            self.ivf.nprobe = value
        elif self.hnsw is not None:
            self.hnsw.efSearch = value

    def search(self, query: np.ndarray, k: int) -> np.ndarray:
        return self.index.search(query[None], k)[1][0]

    def bytes(self) -> int:
        return int(faiss.serialize_index(self.index).size)


class RefinedEngine(FaissEngine):
    """An inverted file re-ranked exactly (``...,RFlat``): nprobe swept, k_factor set per workload."""

    def __init__(self, factory: str, vectors: np.ndarray, nlist: int, k_factors: dict[str, int]):
        factory = factory.format(nlist=nlist, half=vectors.shape[1] // 2)
        t0 = time.perf_counter()
        index = faiss.index_factory(vectors.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
        sample = np.random.default_rng(0).permutation(len(vectors))[: 50 * nlist]  # as build_index
        index.train(vectors[np.sort(sample)])
        index.add(vectors)
        name = f"faiss {factory} (k_factor {k_factors['k10']} at k=10, {k_factors['depth']} at depth)"
        super().__init__(name, index, time.perf_counter() - t0)
        self.k_factors = k_factors

    def prepare(self, depth: int | None) -> None:
        faiss.downcast_index(self.index).k_factor = self.k_factors["depth" if depth else "k10"]


class ServedRerankEngine(FaissEngine):
    """Ours as the service searches it: 8-bit codes under global ids scanned by the project's compiled
    kernel (index/list_scan.py) and re-ranked exactly from the raw vectors (index/rerank.py:
    ``max(k, 128)`` candidates), through the service's search function; nprobe swept."""

    def __init__(self, name: str, index: RerankedIndex, build_seconds: float):
        self.name, self.index, self.build_seconds, self.knob = name, index, build_seconds, "nprobe"
        self.ivf, self.hnsw = faiss.extract_index_ivf(index.codes), None

    @classmethod
    def built(cls, vectors: np.ndarray, nlist: int) -> ServedRerankEngine:
        factory = f"IVF{nlist},SQ8,RFlat"
        t0 = time.perf_counter()
        codes = build_index(vectors, vectors.shape[1], factory, gpu="off")
        index = RerankedIndex(codes, vectors, 0, Rerank.for_factory(factory))
        return cls(f"ours: {factory} (served)", index, time.perf_counter() - t0)

    def search(self, query: np.ndarray, k: int) -> np.ndarray:
        return search(self.index, query[None], k)[1][0]

    def bytes(self) -> int:  # the codes, the raw vectors and the scan's copy of the codes
        scan = self.index.list_scan.get()  # the one the searches made
        copy = 0 if scan is None else scan.codes.nbytes + scan.ids.nbytes
        return int(faiss.serialize_index(self.index.codes).size) + self.index.raw.nbytes + copy


class ServedGraphEngine(Engine):
    """Ours: hnswlib's graph in cluster order (index/graph.py, ``Graph<M>``), built as the build
    builds it and searched through the service's search function; its knob is ef."""

    knob = "ef"

    def __init__(self, vectors: np.ndarray):
        self.name = f"ours: Graph{PEER_M} (served)"
        self.folder = tempfile.TemporaryDirectory(prefix="icr-graph-")  # removed with the engine
        self.path = Path(self.folder.name) / "graph.hnsw"
        t0 = time.perf_counter()
        ids = np.arange(len(vectors), dtype=np.int64)
        self.index = build_graph(vectors, ids, PEER_M, self.path, threads=cores())
        self.build_seconds = time.perf_counter() - t0

    def set(self, value: int) -> None:
        self.index.ef = value

    def search(self, query: np.ndarray, k: int) -> np.ndarray:
        return search(self.index, query[None], k)[1][0]

    def bytes(self) -> int:
        return os.path.getsize(self.path)


class HnswlibEngine(Engine):
    knob = "ef"

    def __init__(self, vectors: np.ndarray):
        import hnswlib

        self.name = f"hnswlib M{PEER_M}"
        t0 = time.perf_counter()
        self.index = hnswlib.Index(space="ip", dim=vectors.shape[1])
        self.index.init_index(max_elements=len(vectors), ef_construction=PEER_EF_CONSTRUCTION, M=PEER_M)
        self.index.add_items(vectors, np.arange(len(vectors)), num_threads=cores())
        self.build_seconds = time.perf_counter() - t0
        self.index.set_num_threads(1)

    def set(self, value: int) -> None:
        self.index.set_ef(value)

    def search(self, query: np.ndarray, k: int) -> np.ndarray:
        return self.index.knn_query(query[None], k=k)[0][0].astype(np.int64)

    def bytes(self) -> int:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "index.bin")
            self.index.save_index(path)
            return os.path.getsize(path)


class UsearchEngine(Engine):
    knob = "expansion_search"

    def __init__(self, vectors: np.ndarray):
        from usearch.index import Index

        self.name = f"usearch M{PEER_M}"
        t0 = time.perf_counter()
        self.index = Index(
            ndim=vectors.shape[1],
            metric="ip",
            dtype="f32",
            connectivity=PEER_M,
            expansion_add=PEER_EF_CONSTRUCTION,
        )
        self.index.add(np.arange(len(vectors)), vectors, threads=cores())
        self.build_seconds = time.perf_counter() - t0

    def set(self, value: int) -> None:
        self.index.expansion_search = value

    def search(self, query: np.ndarray, k: int) -> np.ndarray:
        return np.asarray(self.index.search(query, k, threads=1).keys, dtype=np.int64)

    def bytes(self) -> int:
        return len(self.index.save())


def _timed_search(engine: Engine, queries: np.ndarray, k: int) -> tuple[list[float], list[np.ndarray]]:
    engine.search(queries[0], k)  # warm-up
    times, found = [], []
    for q in queries:
        t0 = time.perf_counter()
        ids = engine.search(q, k)
        times.append(time.perf_counter() - t0)
        found.append(ids)
    return times, found


def sweep(
    engine: Engine,
    settings: list[int],
    queries: np.ndarray,
    truth: tuple[np.ndarray, np.ndarray],
    k: int,
    depth: int | None,
) -> list[dict[str, Any]]:
    """One row per setting: recall@k (and @depth when searching ``depth``), latency, QPS."""
    rows = []
    engine.prepare(depth)
    with omp_threads(1):
        for value in settings:
            engine.set(value)
            times, found = _timed_search(engine, queries, depth or k)
            row: dict[str, Any] = {engine.knob: value, "recall_at_10": recall_of_ids(found, *truth, k)}
            if depth:
                row[f"recall_at_{depth}"] = recall_of_ids(found, *truth, depth)
            lat = latency(times)
            row.update(p50_ms=lat["p50_ms"], p99_ms=lat["p99_ms"], qps=1e3 / lat["mean_ms"])
            rows.append(row)
    return rows


def fastest(rows: list[dict[str, Any]], depth: int | None) -> dict[str, Any] | None:
    """The lowest-p50 row reaching recall@10 >= RECALL_TARGET (and recall@depth >= DEPTH_TARGET)."""
    ok = [
        r
        for r in rows
        if r["recall_at_10"] >= RECALL_TARGET and (depth is None or r[f"recall_at_{depth}"] >= DEPTH_TARGET)
    ]
    return min(ok, key=lambda r: r["p50_ms"]) if ok else None


def _engines(
    ann: faiss.Index | RerankedIndex,
    factory: str,
    vectors: np.ndarray,
    log: Callable[[str], None],
    only: tuple[str, ...] = (),
) -> tuple[list[Engine], dict[str, str]]:
    """Ours (the built index; its build time is that of the same factory rebuilt here from the
    embeddings, as every engine's is), our re-ranked engine (unless the build chose it), FAISS
    HNSW32, FAISS's re-ranking indices, hnswlib, our graph and usearch where installed; ``only``:
    the names (prefixes) of those to build beside ours, all when empty; ``missing``: why a peer is
    absent."""
    faiss.omp_set_num_threads(cores())
    t0 = time.perf_counter()
    build_index(vectors, vectors.shape[1], factory, gpu="off")  # timed only: the built one is searched
    built_s = time.perf_counter() - t0
    engines: list[Engine] = [
        ServedRerankEngine(f"ours: {factory}", ann, built_s)
        if isinstance(ann, RerankedIndex)
        else FaissEngine(f"ours: {factory}", ann, built_s)
    ]
    log(f"peers: ours ({factory}) rebuilt from the embeddings in {engines[0].build_seconds:.1f} s")
    nlist = nlist_of(ann) or max(1, int(4 * np.sqrt(len(vectors))))
    rerank = f"IVF{nlist},SQ8,RFlat"
    makers: list[tuple[str, Callable[[], Engine]]] = [(f"faiss HNSW{HNSW_M}", lambda: _faiss_hnsw(vectors))]
    if not isinstance(ann, RerankedIndex):
        makers.append((f"ours: {rerank} (served)", lambda: ServedRerankEngine.built(vectors, nlist)))
    for candidate, k_factors in REFINED:
        label = "faiss " + candidate.format(nlist=nlist, half=vectors.shape[1] // 2)
        makers.append((label, partial(RefinedEngine, candidate, vectors, nlist, k_factors)))
    makers += [
        (f"hnswlib M{PEER_M}", lambda: HnswlibEngine(vectors)),
        (f"ours: Graph{PEER_M} (served)", lambda: ServedGraphEngine(vectors)),  # hnswlib underneath
        (f"usearch M{PEER_M}", lambda: UsearchEngine(vectors)),
    ]
    missing = {}
    for label, make in makers:
        if only and not any(label.startswith(o) for o in only):
            continue
        try:
            engines.append(make())
        except ImportError as err:
            missing[label] = f"not installed ({err}); pip install -e '.[dev]'"
            continue
        log(f"peers: {engines[-1].name} built in {engines[-1].build_seconds:.1f} s")
    return engines, missing


def _faiss_hnsw(vectors: np.ndarray) -> FaissEngine:
    t0 = time.perf_counter()
    hnsw = faiss.IndexHNSWFlat(vectors.shape[1], HNSW_M, faiss.METRIC_INNER_PRODUCT)
    hnsw.add(vectors)
    return FaissEngine(f"faiss HNSW{HNSW_M}", hnsw, time.perf_counter() - t0)


def run(
    ann: faiss.Index | RerankedIndex,
    factory: str,
    vectors: np.ndarray,
    queries: np.ndarray,
    depth: int,
    log: Callable[[str], None],
    only: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The peers section: every engine (``only``: ours and those named, see :func:`_engines`) at
    k = 10 and at ``depth`` on ``vectors`` (N, D) and ``queries`` (Q, D), both L2-normalised
    float32, ids in the same order for every engine."""
    depth = min(depth, len(vectors))
    exact = ExactTopK(queries, exact_depth(depth))
    for start in range(0, len(vectors), 65_536):
        exact.add(vectors[start : start + 65_536])
    truth = (exact.scores, exact.ids)
    engines, missing = _engines(ann, factory, vectors, log, only)
    out: dict[str, Any] = {
        "vectors": len(vectors),
        "dim": vectors.shape[1],
        "queries": len(queries),
        "k": K,
        "depth": depth,
        "threads": 1,
        "build_threads": cores(),
        "targets": {"recall_at_10": RECALL_TARGET, f"recall_at_{depth}": DEPTH_TARGET},
        "missing": missing,
        "engines": [],
    }
    for engine in engines:
        at_k, at_depth = engine.settings(None), engine.settings(depth)
        log(f"peers: {engine.name}: {len(at_k)} + {len(at_depth)} settings x {len(queries)} queries")
        k_rows = sweep(engine, at_k, queries, truth, K, None)
        depth_rows = sweep(engine, at_depth, queries, truth, K, depth)
        out["engines"].append(
            {
                "engine": engine.name,
                "knob": engine.knob,
                "build_s": engine.build_seconds,
                "bytes": engine.bytes(),
                "k10": k_rows,
                "depth": depth_rows,
                "best_k10": fastest(k_rows, None),
                "best_depth": fastest(depth_rows, depth),
            }
        )
    for workload, k in (("k10", K), ("depth", depth)):
        chosen = [
            (engine, e) for engine, e in zip(engines, out["engines"], strict=True) if e[f"best_{workload}"]
        ]
        paired = paired_p50(chosen, workload, queries, k)
        for (_, e), p50 in zip(chosen, paired, strict=True):
            e[f"best_{workload}"]["paired_p50_ms"] = p50
        ranked = [(p50, e["engine"]) for (_, e), p50 in zip(chosen, paired, strict=True)]
        out[f"winner_{workload}"] = min(ranked)[1] if ranked else None
    out["paired_rounds"] = PAIRED_ROUNDS
    return out


def paired_p50(
    chosen: list[tuple[Engine, dict[str, Any]]], workload: str, queries: np.ndarray, k: int
) -> list[float]:
    """Each engine's p50 at its chosen setting, timed again in :data:`PAIRED_ROUNDS` rounds that
    rotate the engines' order: every engine searches all queries in turn, once per round. The sweeps
    run one engine after another over minutes, and this machine's speed drifts by 7-15 % between
    runs (docs/results/2026-11-27-rerank-served-1m.md), so the winner is decided here."""
    times: list[list[float]] = [[] for _ in chosen]
    with omp_threads(1):
        for r in range(PAIRED_ROUNDS):
            for j in np.roll(np.arange(len(chosen)), -r):
                engine, e = chosen[j]
                engine.prepare(None if workload == "k10" else k)
                engine.set(e[f"best_{workload}"][engine.knob])
                times[j] += _timed_search(engine, queries, k)[0]
    return [latency(t)["p50_ms"] for t in times]


def markdown(section: dict[str, Any]) -> list[str]:
    depth = section["depth"]
    lines = [
        f"## ANN engines side by side: {section['vectors']:,} vectors (dim {section['dim']}), "
        f"{section['queries']} caption queries, one query per call on one thread",
        "",
        f"Fastest setting per engine reaching recall@10 >= {RECALL_TARGET} (k = 10) and, at the "
        f"service's depth ({depth:,} neighbours), also recall@{depth} >= {DEPTH_TARGET}. Build on "
        f"{section['build_threads']} threads; size = serialised index. The winner is decided by the "
        f"paired p50: each engine's chosen setting timed again in {section.get('paired_rounds', 0)} rounds "
        "that rotate the engines' order, so that the machine's drift over the sweeps does not pick it.",
        "",
        "| engine | build s | size MiB | k=10: setting | recall@10 | p50 ms | paired p50 ms | p99 ms | QPS "
        f"| depth {depth}: setting | recall@10 | recall@{depth} | p50 ms | paired p50 ms | p99 ms | QPS |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for e in section["engines"]:
        cells = [e["engine"], f"{e['build_s']:.1f}", f"{e['bytes'] / 2**20:,.0f}"]
        for workload, keys in (("k10", ("recall_at_10",)), ("depth", ("recall_at_10", f"recall_at_{depth}"))):
            best = e[f"best_{workload}"]
            if best is None:
                cells += [f"none reaches the target ({e['knob']} up to {e[workload][-1][e['knob']]:,})"]
                cells += [""] * (len(keys) + 4)
                continue
            cells.append(f"{e['knob']} {best[e['knob']]:,}")
            cells += [f"{best[key]:.3f}" for key in keys]
            paired = f"{best['paired_p50_ms']:.2f}" if "paired_p50_ms" in best else ""
            cells += [f"{best['p50_ms']:.2f}", paired, f"{best['p99_ms']:.2f}", f"{best['qps']:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Winner at k = 10: **{section['winner_k10']}**; "
        f"at the service's depth: **{section['winner_depth']}**.",
    ]
    for name, why in section["missing"].items():
        lines.append(f"- {name}: {why}")
    lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--index", type=Path, help="an ANN index folder (icr index build)")
    parser.add_argument("--exact", type=Path, help="its Flat twin (the same vectors in id order)")
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--data", type=Path, help="the synthetic benchmark (test captions)")
    parser.add_argument("--vectors", type=Path, help="or: the gallery's unit vectors, an (N, D) .npy")
    parser.add_argument("--query-vectors", type=Path, help="with --vectors: unit query vectors, (Q, D) .npy")
    parser.add_argument("--factory", default="IVF4000,Flat", help="with --vectors: ours, built here")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--depth", type=int, default=1000)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--only",
        nargs="+",
        default=(),
        metavar="NAME",
        help="build only these beside ours (name prefixes: 'hnswlib', 'ours: Graph', 'faiss HNSW', ...)",
    )
    args = parser.parse_args()
    only = tuple(args.only)
    if args.vectors is not None:
        if args.query_vectors is None:
            parser.error("--vectors needs --query-vectors")
        vectors = np.ascontiguousarray(np.load(args.vectors), dtype=np.float32)  # (N, D)
        queries = np.ascontiguousarray(np.load(args.query_vectors)[: args.queries], dtype=np.float32)
        ann = build_index(vectors, vectors.shape[1], args.factory, gpu="off")
        section = run(ann, args.factory, vectors, queries, args.depth, print, only)
    elif None in (args.index, args.exact, args.checkpoint, args.data):
        parser.error("give --index, --exact, --checkpoint and --data, or --vectors and --query-vectors")
    else:
        section = run_dirs(
            args.index, args.exact, args.checkpoint, args.data, args.queries, args.depth, print, only
        )
    print("\n".join(markdown(section)))
    if args.json:
        args.json.write_text(json.dumps(section, indent=1) + "\n")


def run_dirs(
    index_dir: Path,
    exact_dir: Path,
    checkpoint: Path,
    data: Path,
    queries: int,
    depth: int,
    log: Callable[[str], None],
    only: tuple[str, ...] = (),
) -> dict[str, Any]:
    """:func:`run` on built index folders, with held-out test captions encoded by ``checkpoint``."""
    from icr.index.index_folder import load_index_dir
    from icr.training.checkpoint import load_checkpoint
    from icr.training.data.training_data import open_split
    from icr.training.embedding import embed_captions

    ann, manifest, meta = load_index_dir(index_dir)
    meta.close()
    if isinstance(ann, GraphIndex):
        raise ValueError(
            f"{index_dir}: a graph ({manifest.factory}); the peers section compares a FAISS build and "
            "measures the graph engine itself (ours: Graph16)"
        )
    nprobe = manifest.recall_check.get("nprobe")
    flat, _, meta = load_index_dir(exact_dir)
    meta.close()
    vectors = flat.reconstruct_n(0, flat.ntotal)  # (N, D) the ANN index's vectors, in its id order
    del flat
    model, _ = load_checkpoint(checkpoint)
    captions = open_split(data, "test").captions[:queries]
    encoded = np.ascontiguousarray(embed_captions(model, captions), dtype=np.float32)  # (Q, D)
    log(
        f"peers: {len(vectors):,} vectors, {len(encoded)} queries, {manifest.factory} (tuned nprobe {nprobe})"
    )
    return run(ann, manifest.factory, vectors, encoded, depth, log, only)


if __name__ == "__main__":
    main()
