"""Scatter-gather over index shards in separate processes, against one index holding everything.

The gallery is split into S contiguous shards; each is an exact (Flat) or IVF index in its own
process, answering top-``depth`` for a query with global ids. The coordinator sends every query to
all shards (scatter), takes their lists and merges them into one top-``depth`` (gather). For exact
shards the merged list must equal the single index's exactly (ids and scores), which is why
thresholds and calibration, functions of the top-``depth`` list, need no change when an index is
sharded; the figures say what the extra hop costs per query on this machine.

``python -m bench.scatter_gather --vectors V.npy --shards 2,4 --queries 200``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench.stats import latency


def _shard_server(path: str, lo: int, hi: int, factory: str, conn: Connection) -> None:
    """One shard: rows [lo, hi) of the .npy at ``path``; answers (query, depth) with global ids."""
    import faiss

    faiss.omp_set_num_threads(1)
    vectors = np.ascontiguousarray(np.load(path, mmap_mode="r")[lo:hi], dtype=np.float32)
    index = faiss.index_factory(vectors.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        index.train(vectors)
    index.add(vectors)
    conn.send("ready")
    while True:
        message = conn.recv()
        if message is None:
            return
        query, depth = message
        scores, ids = index.search(query, min(depth, index.ntotal))  # (1, d)
        keep = ids[0] >= 0
        conn.send((scores[0][keep], ids[0][keep] + lo))


def _same_up_to_ties(scores: np.ndarray, ids: np.ndarray, t_scores: np.ndarray, t_ids: np.ndarray) -> bool:
    """Equal lists, except for the order of tied scores and which of the ties at the cut-off made it."""
    if not np.array_equal(scores, t_scores):
        return False
    above = scores > scores[-1] if len(scores) else scores.astype(bool)
    return set(ids[above].tolist()) == set(t_ids[above].tolist())


def merge(lists: list[tuple[np.ndarray, np.ndarray]], depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``depth`` of several best-first (scores, ids) lists, best first, ties by id."""
    lists = [(s[o], i[o]) for s, i in lists for o in [np.lexsort((i, -s))]]  # ties by id within each
    heads = [((-float(s[0]), int(i[0])), n, 0) for n, (s, i) in enumerate(lists) if len(s)]
    heapq.heapify(heads)
    scores, ids = [], []
    while heads and len(scores) < depth:
        (neg, gid), n, pos = heapq.heappop(heads)
        scores.append(-neg)
        ids.append(gid)
        s, i = lists[n]
        if pos + 1 < len(s):
            heapq.heappush(heads, ((-float(s[pos + 1]), int(i[pos + 1])), n, pos + 1))
    return np.asarray(scores, np.float32), np.asarray(ids, np.int64)


def run(
    vectors_path: Path, shard_counts: list[int], queries: int, depth: int, factory: str = "Flat"
) -> dict[str, Any]:
    import faiss

    vectors = np.load(vectors_path, mmap_mode="r")
    n, dim = vectors.shape
    rng = np.random.default_rng(0)
    q = np.ascontiguousarray(vectors[rng.choice(n, queries, replace=False)], dtype=np.float32)
    q += 0.05 * rng.standard_normal(q.shape, dtype=np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)

    faiss.omp_set_num_threads(1)
    single = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    data = np.ascontiguousarray(vectors, dtype=np.float32)
    if not single.is_trained:
        single.train(data)
    single.add(data)
    del data
    single_times, truth = [], []
    for row in q:
        t0 = time.perf_counter()
        s, i = single.search(row[None], depth)
        single_times.append(time.perf_counter() - t0)
        truth.append((s[0], i[0]))
    out: dict[str, Any] = {"vectors": n, "dim": dim, "depth": depth, "queries": queries, "factory": factory}
    out["single"] = latency(single_times)
    context = mp.get_context("spawn")
    for shards in shard_counts:
        bounds = np.linspace(0, n, shards + 1).astype(int)
        pipes, procs = [], []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            parent, child = context.Pipe()
            proc = context.Process(
                target=_shard_server, args=(str(vectors_path), int(lo), int(hi), factory, child)
            )
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        try:
            for pipe in pipes:
                assert pipe.recv() == "ready"
            times, same_ids, score_gap = [], 0, 0.0
            for row, (t_s, t_i) in zip(q, truth, strict=True):
                t0 = time.perf_counter()
                for pipe in pipes:  # scatter
                    pipe.send((row[None], depth))
                scores, ids = merge([pipe.recv() for pipe in pipes], depth)  # gather
                times.append(time.perf_counter() - t0)
                same_ids += int(_same_up_to_ties(scores, ids, t_s, t_i))
                score_gap = max(score_gap, float(np.abs(scores - t_s).max()))
            out[f"{shards}_shards"] = {
                "latency": latency(times),
                "queries_with_identical_top_depth": same_ids,
                "max_score_difference": score_gap,
            }
        finally:
            for pipe in pipes:
                pipe.send(None)
            for proc in procs:
                proc.join(10)
    return out


def markdown(result: dict[str, Any]) -> list[str]:
    single = result["single"]
    lines = [
        f"## Scatter-gather simulation ({result['vectors']:,} vectors, dim {result['dim']}, "
        f"{result['factory']} shards in separate processes, top {result['depth']}, "
        f"{result['queries']} queries, 1 thread each)",
        "",
        "| layout | p50 ms | p99 ms | merged top-depth = single index's (up to tie order) | max score diff |",
        "|---|---:|---:|---:|---:|",
        f"| one index, in process | {single['p50_ms']:.2f} | {single['p99_ms']:.2f} | - | - |",
    ]
    for key, r in result.items():
        if key.endswith("_shards"):
            same = f"{r['queries_with_identical_top_depth']} / {result['queries']}"
            lines.append(
                f"| {key.split('_')[0]} shards, scatter-gather | {r['latency']['p50_ms']:.2f} | "
                f"{r['latency']['p99_ms']:.2f} | {same} | {r['max_score_difference']:.1e} |"
            )
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vectors", type=Path, required=True, help="(N, D) float32 unit rows (.npy)")
    parser.add_argument("--shards", default="2,4")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--depth", type=int, default=1000)
    parser.add_argument("--factory", default="Flat")
    args = parser.parse_args()
    result = run(
        args.vectors, [int(s) for s in args.shards.split(",")], args.queries, args.depth, args.factory
    )
    print(json.dumps(result, indent=2))
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
