"""In-process search figures at one gallery size: what the service does per query, stage by stage,
the ANN index against exact search, and exact search against the hardware floors.

* **end to end** (the service's code path, :class:`service.retriever.Retriever`): caption encoding,
  FAISS search of the service's depth, threshold filtering, metadata lookup; p50/p99 per stage and
  in all, one query at a time, with the service's settings.
* **ANN vs exact**: recall@10 of the index the build chose against exact search on the same
  vectors, and single-query latency (k = 10) of each; and at the service's depth, recall@10 and
  recall@depth of a depth search (tie-aware), whose latency is the end-to-end search stage.
* **exact (Flat, fp32) vs floors**: a single query (FAISS, and the kernel's matrix-vector scan that
  the service runs a lone query with when ``ICR_FAISS_THREADS`` > 1) on one thread and on every core
  against ``gallery bytes / read bandwidth``; batches of 16 and 64 queries through the service's batch
  kernel (:mod:`index.exact_kernel`) at k = 10 and at the depth, against ``2 N d Q / matmul rate``,
  with FAISS's own batch search beside it, and the kernel's block matmuls timed alone (what the
  search costs before it selects anything).
  ``faiss.cvar.distance_compute_blas_threshold`` is never written: doing so from Python slowed
  later one-thread single queries 2-2.5x with faiss-cpu 1.15 (found by this benchmark).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from bench.floors import cores, search_floor_ms
from bench.stats import latency, ratio, repeat, summary
from icr.index.exact_kernel import ExactKernel, kernel_for
from icr.index.vector_index import exact_depth, recall_of_ids

K = 10


def _single(
    index: faiss.Index | ExactKernel, queries: np.ndarray, k: int, threads: int
) -> tuple[list[float], np.ndarray]:
    from threadpoolctl import threadpool_limits

    faiss.omp_set_num_threads(threads)  # per calling thread (OpenMP); this thread does the searching
    with threadpool_limits(threads, user_api="blas"):  # the kernel's scan: numpy's BLAS
        index.search(queries[:1], k)  # warm-up
        times, ids = [], []
        for q in queries:
            t0 = time.perf_counter()
            _, i = index.search(q[None], k)
            times.append(time.perf_counter() - t0)
            ids.append(i[0])
    return times, np.stack(ids)


def _matmuls(kernel: ExactKernel, queries: np.ndarray) -> None:
    """The kernel's scoring pass alone, nothing selected: every score written out (the fused pass's
    scoring half, in fp32 or in bf16 tiles; bf16 without the tiles: torch's block matmuls)."""
    import torch

    with torch.inference_mode():
        for _ in kernel.score_blocks(queries):
            pass


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of the exact top-k found (ids; -1 padding never matches)."""
    return float(np.mean([len(set(f[f >= 0]) & set(t)) / len(t) for f, t in zip(found, truth, strict=True)]))


def run(
    checkpoint: Path,
    ann_dir: Path,
    exact_dir: Path,
    captions: list[str],
    floors: dict[str, Any],
    *,
    exact_queries: int,
    log,
) -> dict[str, Any]:
    from icr.index.index_folder import load_index_dir
    from icr.service.config import Settings
    from icr.service.retriever import Retriever

    settings = Settings(index=ann_dir)  # the service's defaults (ICR_* variables apply)
    retriever = Retriever.load(
        ann_dir, checkpoint, faiss_threads=settings.faiss_threads, micro_batch=settings.micro_batch
    )
    target = retriever.images
    n, dim = target.manifest.ntotal, target.manifest.dim
    log(f"in-process: {n:,} vectors ({target.manifest.factory}), {len(captions)} caption queries")

    # 1. the service's path, one query at a time
    stages: dict[str, list[float]] = {"encode_ms": [], "search_ms": [], "filter_ms": [], "metadata_ms": []}
    total, vectors = [], []
    for text in captions:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        q = retriever.encode_text(text)  # (1, D)
        timings["encode_ms"] = (time.perf_counter() - t0) * 1e3
        retriever.search(
            target, q, k=K, offset=0, depth=settings.search_depth, min_score=0.5, timings=timings
        )
        total.append(time.perf_counter() - t0)
        vectors.append(q[0])
        for key in stages:
            stages[key].append(timings[key] / 1e3)
    queries = np.stack(vectors).astype(np.float32)  # (Q, D)
    end_to_end = {"total": latency(total), **{k.removesuffix("_ms"): latency(v) for k, v in stages.items()}}

    # 2. ANN against exact search on the same vectors
    exact_index, _, metadata = load_index_dir(exact_dir)
    metadata.close()
    faiss.omp_set_num_threads(cores())
    _, truth = exact_index.search(queries, K)  # (Q, K) in one batched call
    ann_times, ann_ids = _single(target.index, queries, K, settings.faiss_threads)
    # the service's own search: depth neighbours, judged at 10 and at the depth (ties count)
    depth = min(settings.search_depth, n)
    deep_scores, deep_truth = exact_index.search(queries, min(exact_depth(depth), n))  # (Q, <=depth+100)
    _, deep_ids = _single(target.index, queries, depth, settings.faiss_threads)
    ann = {
        "factory": target.manifest.factory,
        "nprobe": target.manifest.recall_check.get("nprobe"),
        "ef_search": target.manifest.recall_check.get("ef_search"),
        "recall_at_10_vs_exact": recall(ann_ids, truth),
        "depth": depth,
        "depth_recall_at_10": recall_of_ids(deep_ids, deep_scores, deep_truth, K),
        "depth_recall_at_depth": recall_of_ids(deep_ids, deep_scores, deep_truth, depth),
        "k10_single": latency(ann_times),
        "depth_single": end_to_end["search"],
    }

    # 3. exact search against the floors
    gbps, gflops = floors["bandwidth"]["best_gbps"], floors["matmul"]["best_gflops"]
    sub = queries[:exact_queries]
    exact: dict[str, Any] = {"queries": len(sub), "bytes": n * dim * 4}
    kernel = kernel_for(exact_index)  # what the service's micro-batcher runs a batch of queries with
    assert kernel is not None
    for threads in sorted({1, cores()}):
        for name, engine in ((f"single_{threads}t", exact_index), (f"kernel_single_{threads}t", kernel)):
            times, ids = _single(engine, sub, K, threads)
            exact[name] = latency(times)
            assert recall(ids, truth[: len(sub)]) == 1.0
    floor1 = search_floor_ms(n, dim, 1, gbps, gflops)
    best1 = min(v["p50_ms"] for name, v in exact.items() if name.startswith(("single_", "kernel_single_")))
    exact["single_floor_ms"] = floor1
    exact["single_best_p50_vs_floor"] = ratio(best1, floor1)
    faiss.omp_set_num_threads(cores())
    exact["kernel_precision"] = kernel.precision
    batches = {}
    for size in (16, 64):
        batch = queries[np.arange(size) % len(queries)]
        row = {"floor_ms": search_floor_ms(n, dim, size, gbps, gflops)}
        row["depth_precision"] = kernel.precision_for(depth)  # a bf16 kernel's deep search may be fp32
        # 7 runs: the host drifts (3 runs of one 16-query search once read 42, 73 and 74 ms)
        row["search"] = summary(repeat(lambda b=batch: kernel.search(b, K), 7))
        row["vs_floor"] = ratio(row["search"]["median_ms"], row["floor_ms"])
        row["queries_per_s"] = size / row["search"]["median_ms"] * 1e3
        row["depth_search"] = summary(repeat(lambda b=batch: kernel.search(b, depth), 7))
        row["depth_vs_floor"] = ratio(row["depth_search"]["median_ms"], row["floor_ms"])
        row["matmul"] = summary(repeat(lambda b=batch: _matmuls(kernel, b), 3))
        # FAISS picks its own kernel: a scan per query below 20 queries, 1,024-row sgemm from 20
        row["faiss"] = summary(repeat(lambda b=batch: exact_index.search(b, K), 3))
        batches[str(size)] = row
    exact["batches"] = batches
    retriever.images.metadata.close()
    return {
        "vectors": n,
        "dim": dim,
        "faiss_threads": settings.faiss_threads,
        "search_depth": settings.search_depth,
        "cpu_count": os.cpu_count(),
        "end_to_end": end_to_end,
        "ann": ann,
        "exact": exact,
    }
