"""An index larger than the memory budget, built from shards and searched memory-mapped.

``python -m bench.on_disk_index (--vectors V.npy --query-vectors Q.npy | --source EMB.npy --count N)
--budget-mb B --out DIR --json OUT`` runs in its own process, so the peak RSS it reports (``VmHWM``,
:func:`icr.core.memory.peak_rss_mb`) is the build's and the search's alone.

The vectors, either:

- ``--vectors``: an (N, D) float32 ``.npy`` indexed as it is, read chunk by chunk (never mapped, so
  its pages do not count in this process's RSS), with ``--query-vectors`` as the queries: real
  embeddings, e.g. rendered distractors embedded by the demo model;
- ``--source``: N vectors resampled from real embeddings (at most 50,000 rows of them): each a random
  point on the segment between a real row and one of its 10 nearest real neighbours, plus a little
  noise, renormalised (SMOTE's upsampling), generated chunk by chunk from (seed, chunk) so the stream
  can be replayed for the exact top-10 without storing it; queries are fresh draws. Resampling a few
  rows into millions crowds near-ties around them, which hides what the codes lose; ``--vectors``
  is the measurement to quote.

The index is built by :func:`index.on_disk.build_on_disk` with the factory the budget picks (PQ codes
re-ranked from the raw vectors on disk, ``...,RFlat``). Searched one query at a time on one thread,
k = 10, against the exact top 10: per nprobe and number of re-ranked candidates, recall@10, p50 and
p99, with the codes' own recall beside; a first pass of 50 queries with the index's files dropped from
the page cache (cold), the others warm; and the memory the search holds, split into anonymous pages (the
process's own) and file pages (the mapped codes and raw vectors, which the kernel can reclaim).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from icr.core.memory import peak_rss_mb, resident_mb

CHUNK = 20_000
SOURCE_ROWS = 50_000
NEIGHBOURS = 10
NOISE = 0.02  # per-coordinate standard deviation before renormalising
NPROBES = (8, 16, 32, 64, 128)
CANDIDATES = (160, 640, 1280)  # re-ranked per query at k = 10 (1,280: the engine's default)
COLD_NPROBE, COLD_QUERIES = 32, 50  # each cold query reads ~1,300 random pages from the disk


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


def npy_blocks(path: Path, chunk: int = CHUNK) -> tuple[tuple[int, int], Callable[[], Iterator[np.ndarray]]]:
    """((N, D), a function streaming ``path``'s rows as (<= chunk, D) float32 blocks, read, not mapped)."""
    from icr.index.rerank import raw_blocks

    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read_header(f)
        offset = f.tell()
    if len(shape) != 2 or fortran or dtype != np.float32:
        raise ValueError(f"{path}: need a C-order (N, D) float32 array, got {shape} {dtype}")
    n, dim = shape
    return (n, dim), lambda: raw_blocks(path, dim, chunk, offset)


def drop_from_page_cache(paths: list[Path]) -> None:
    """Written back and evicted, so that the next read comes from the disk (Linux)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_pass(index: Any, queries: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    from icr.index.vector_index import search

    times, hits = [], 0.0
    for i in range(len(queries)):
        t1 = time.perf_counter()
        _, ids = search(index, queries[i : i + 1], 10)
        times.append(time.perf_counter() - t1)
        hits += len(set(ids[0].tolist()) & set(truth[i].tolist())) / 10
    return {
        "recall_at_10": hits / len(queries),
        "p50_ms": float(np.percentile(times, 50) * 1e3),
        "p99_ms": float(np.percentile(times, 99) * 1e3),
    }


def run(
    stream: Callable[[], Iterator[np.ndarray]], count: int, dim: int, q: np.ndarray, budget_mb: int, out: Path
) -> dict[str, Any]:
    import faiss

    from icr.index.on_disk import ONDISK_DATA, build_on_disk, choose_on_disk_factory, load_on_disk
    from icr.index.rerank import RAW_FILE, Rerank, RerankedIndex, is_reranked, load_raw
    from icr.index.vector_index import ExactTopK, search, set_nprobe

    budget = budget_mb << 20
    factory, reason = choose_on_disk_factory(count, dim, budget)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    built = build_on_disk(stream(), dim, factory, out, "index.faiss", memory_budget_bytes=budget)
    build_s = time.perf_counter() - t0
    rss_build = peak_rss_mb()

    t0 = time.perf_counter()
    exact = ExactTopK(q, 20)
    for block in stream():
        exact.add(block)
    exact_s = time.perf_counter() - t0
    truth = exact.ids[:, :10]
    files = [out / "index.faiss", out / ONDISK_DATA, *([out / RAW_FILE] if is_reranked(factory) else [])]
    drop_from_page_cache(files)
    codes = load_on_disk(out / "index.faiss")
    faiss.omp_set_num_threads(1)
    index: Any = codes
    if is_reranked(factory):
        index = RerankedIndex(codes, load_raw(out / RAW_FILE, count, dim, mmap=True))
    set_nprobe(codes, COLD_NPROBE)
    cold = {"nprobe": COLD_NPROBE, "queries": COLD_QUERIES, **timed_pass(index, q[:COLD_QUERIES], truth)}
    curve = []
    for nprobe in NPROBES:
        set_nprobe(codes, nprobe)
        search(codes, q[:1], 10)  # warm-up
        row: dict[str, Any] = {"nprobe": nprobe, "codes_only": timed_pass(codes, q, truth)}
        if isinstance(index, RerankedIndex):
            row["reranked"] = {
                str(c): timed_pass(RerankedIndex(codes, index.raw, 0, Rerank(1, c)), q, truth)
                for c in CANDIDATES
            }
        curve.append(row)
    return {
        "vectors": count,
        "dim": dim,
        "budget_mb": budget_mb,
        "factory": factory,
        "factory_reason": reason,
        "shards": built.shards,
        "train_points": built.train_points,
        "build_s": build_s,
        "stages_s": built.seconds,
        "peak_rss_mb_build": rss_build,
        "peak_rss_mb": peak_rss_mb(),
        "resident_after_search": resident_mb(),
        "ivfdata_mb": (out / ONDISK_DATA).stat().st_size / 2**20,
        "raw_mb": (out / RAW_FILE).stat().st_size / 2**20 if is_reranked(factory) else 0.0,
        "exact_top10_s": exact_s,
        "queries": len(q),
        "cold": cold,
        "search": curve,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--vectors", type=Path, help="(N, D) float32 .npy indexed as it is")
    given.add_argument("--source", type=Path, help="(n0, D) float32 .npy of real embeddings to resample")
    parser.add_argument("--query-vectors", type=Path, help="(Q, D) float32 .npy of queries (with --vectors)")
    parser.add_argument("--count", type=int, default=10_000_000, help="vectors resampled (with --source)")
    parser.add_argument("--budget-mb", type=int, default=4096)
    parser.add_argument("--out", type=Path, required=True, help="folder for the index (replaced)")
    parser.add_argument("--json", type=Path, required=True, help="where to write the figures")
    parser.add_argument("--queries", type=int, default=100, help="resampled queries (with --source)")
    args = parser.parse_args()
    if args.vectors is not None:
        if args.query_vectors is None:
            parser.error("--vectors needs --query-vectors")
        (count, dim), stream = npy_blocks(args.vectors)
        q = np.ascontiguousarray(np.load(args.query_vectors), dtype=np.float32)
        origin = {"vectors_file": str(args.vectors), "queries_file": str(args.query_vectors)}
    else:
        source = np.load(args.source, mmap_mode="r")
        step = max(1, len(source) // SOURCE_ROWS)
        source = np.ascontiguousarray(source[::step][:SOURCE_ROWS], dtype=np.float32)  # (n0, D)
        near = neighbours(source)  # (n0, NEIGHBOURS)
        count, dim = args.count, source.shape[1]

        def stream() -> Iterator[np.ndarray]:
            return resampled(source, near, count, 0)

        q = next(resampled(source, near, args.queries, 1))  # (Q, D) fresh draws
        origin = {"source_rows": len(source)}
    result = {**origin, **run(stream, count, dim, q, args.budget_mb, args.out)}
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
