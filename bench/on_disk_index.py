"""An index larger than the memory budget, built from shards and searched memory-mapped.

``python -m bench.on_disk_index --source EMB.npy --count N --budget-mb B --out DIR --json OUT`` runs in
its own process, so the peak RSS it reports (``VmHWM``, :func:`training.memory.peak_rss_mb`) is the
build's and the search's alone.

The N vectors are resampled from real embeddings (the model's own, ``--source``, at most 50,000 rows
of it): each is a random point on the segment between a real row and one of its 10 nearest real
neighbours, plus a little noise, renormalised (SMOTE's upsampling: it keeps the embeddings' cluster
structure and adds no exact duplicates), generated chunk by chunk from (seed, chunk) so the stream
can be replayed for the exact top-10 without storing it. Gaussian draws with the embeddings' mean and
covariance were tried and dropped: they lose the clusters (recall@10 of IVF-PQ flat in nprobe). The
index is built by :func:`index.on_disk.build_on_disk` with the factory the budget picks; recall@10 against
exact search is measured on ``--queries`` fresh resampled vectors, with single-query latency, per nprobe.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from icr.core.memory import peak_rss_mb

CHUNK = 20_000
SOURCE_ROWS = 50_000
NEIGHBOURS = 10
NOISE = 0.02  # per-coordinate standard deviation before renormalising


def neighbours(source: np.ndarray) -> np.ndarray:
    """(n0, NEIGHBOURS) the nearest other rows of each row (inner product)."""
    import faiss

    flat = faiss.IndexFlatIP(source.shape[1])
    flat.add(source)
    _, ids = flat.search(source, NEIGHBOURS + 1)  # (n0, 11), the row itself first
    return ids[:, 1:]


def resampled(source: np.ndarray, near: np.ndarray, count: int, seed: int) -> Iterator[np.ndarray]:
    """(b, D) unit rows between real rows and their neighbours; a pure function of the arguments."""
    for c, lo in enumerate(range(0, count, CHUNK)):
        rng = np.random.default_rng([seed, c])
        n = min(CHUNK, count - lo)
        i = rng.integers(0, len(source), n)
        j = near[i, rng.integers(0, NEIGHBOURS, n)]
        t = rng.random((n, 1), dtype=np.float32)
        v = source[i] + t * (source[j] - source[i])  # (b, D)
        v += NOISE * rng.standard_normal(v.shape, dtype=np.float32)
        yield v / np.linalg.norm(v, axis=1, keepdims=True)


def run(source_path: Path, count: int, budget_mb: int, out: Path, queries: int) -> dict[str, Any]:
    import faiss

    from icr.index.on_disk import ONDISK_DATA, build_on_disk, choose_on_disk_factory, load_on_disk
    from icr.index.vector_index import ExactTopK, search, set_nprobe

    source = np.load(source_path, mmap_mode="r")
    step = max(1, len(source) // SOURCE_ROWS)
    source = np.ascontiguousarray(source[::step][:SOURCE_ROWS], dtype=np.float32)  # (n0, D)
    near = neighbours(source)  # (n0, NEIGHBOURS)
    dim = source.shape[1]
    budget = budget_mb << 20
    factory, reason = choose_on_disk_factory(count, dim, budget)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    built = build_on_disk(
        resampled(source, near, count, 0), dim, factory, out, "index.faiss", memory_budget_bytes=budget
    )
    build_s = time.perf_counter() - t0
    rss_build = peak_rss_mb()

    q = next(resampled(source, near, queries, 1))  # (Q, D) fresh draws
    t0 = time.perf_counter()
    exact = ExactTopK(q, 20)
    for block in resampled(source, near, count, 0):
        exact.add(block)
    exact_s = time.perf_counter() - t0
    index = load_on_disk(out / "index.faiss")
    faiss.omp_set_num_threads(1)
    curve = []
    for nprobe in (8, 16, 32, 64, 128):
        set_nprobe(index, nprobe)
        search(index, q[:1], 10)  # warm-up
        times, hits = [], 0.0
        for i in range(len(q)):
            t1 = time.perf_counter()
            _, ids = search(index, q[i : i + 1], 10)
            times.append(time.perf_counter() - t1)
            hits += len(set(ids[0].tolist()) & set(exact.ids[i, :10].tolist())) / 10
        curve.append(
            {
                "nprobe": nprobe,
                "recall_at_10": hits / len(q),
                "p50_ms": float(np.percentile(times, 50) * 1e3),
                "p99_ms": float(np.percentile(times, 99) * 1e3),
            }
        )
    return {
        "vectors": count,
        "dim": dim,
        "source_rows": len(source),
        "budget_mb": budget_mb,
        "factory": factory,
        "factory_reason": reason,
        "shards": built.shards,
        "train_points": built.train_points,
        "build_s": build_s,
        "stages_s": built.seconds,
        "peak_rss_mb_build": rss_build,
        "peak_rss_mb": peak_rss_mb(),
        "ivfdata_mb": (out / ONDISK_DATA).stat().st_size / 2**20,
        "exact_top10_s": exact_s,
        "queries": len(q),
        "search": curve,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="(n0, D) float32 .npy of real embeddings")
    parser.add_argument("--count", type=int, default=10_000_000)
    parser.add_argument("--budget-mb", type=int, default=4096)
    parser.add_argument("--out", type=Path, required=True, help="folder for the index (replaced)")
    parser.add_argument("--json", type=Path, required=True, help="where to write the figures")
    parser.add_argument("--queries", type=int, default=100)
    args = parser.parse_args()
    result = run(args.source, args.count, args.budget_mb, args.out, args.queries)
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
