"""IVF build and search at 10M / 100M vectors on a GPU (issue 43, item 5), from one command:

    python3 bench/gpu_device/scale.py OUT.jsonl [--sizes 10000000 100000000] [--budget-s 300]

The vectors are synthetic, dim 128, L2-normalised, with neighbour structure at two scales: 4,096
unit centres, 64 sub-centres around each (offset 0.7 / sqrt(d) per coordinate), isotropic noise
(0.5 / sqrt(d)) around those. On the CPU at 1M this gives IVF1024 recall@10 0.93 / 0.97 / 0.99 at
nprobe 4 / 16 / 64 and a 10th-neighbour score of 0.66 against 0.87 for the first, a curve like real
embeddings' (a single-level mixture either ties whole clusters or spreads them to uniform).
Every chunk is regenerated from its own seed, so the exact top 10 is computed by streaming the same
vectors again (torch matmul + running top-k on the GPU), never held as one array. Queries:
1,000 fresh draws from the same mixture (not indexed).

Per size: the build through ``icr.index.vector_index.build_index(gpu="on")`` (train + add, timed),
then the CPU index copied to the GPU and searched at several nprobe: recall@10 against the exact top
10 and the wall time of one query (median of 50) and of the 1,000 queries as one batch. At 100M the
index is IVF-PQ32 (4.8 GB of codes and ids); there recall is also given after re-ranking the top 100
and the top 1,000 by exact scores from fp16 copies of the vectors kept in host memory (25.6 GB), the
re-ranking that issue 43 asks for on the CPU, and the time of one query end to end (GPU search for
1,000 candidates, then the host's gather and exact scores). A size that would end after
``--budget-s`` is skipped and said so. ``--pq-from`` / ``--pq-factory`` pick the sizes that get PQ
codes (a CPU smoke run: ``--sizes 200000 --pq-from 100000 --pq-factory IVF256,PQ32``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path

import faiss
import numpy as np
import torch

from icr.index.vector_index import build_index

DIM, CENTRES, SUBS, CHUNK, QUERIES = 128, 4_096, 64, 1_000_000, 1_000
NPROBES, RERANK_DEPTHS = (8, 32, 128), (100, 1_000)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def mixture(seed: int, n: int, centres: torch.Tensor) -> torch.Tensor:
    """(n, DIM) unit vectors from ``seed`` alone: a random sub-centre each plus isotropic noise."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    pick = torch.randint(0, CENTRES * SUBS, (n,), generator=g, device=DEVICE)
    top, sub = centres[:CENTRES], centres[CENTRES:]
    x = top[pick // SUBS] + 0.7 * sub[pick] + 0.5 * torch.randn(n, DIM, generator=g, device=DEVICE) / DIM**0.5
    return torch.nn.functional.normalize(x, dim=1)


def chunks(n: int, centres: torch.Tensor) -> Iterator[torch.Tensor]:
    for i, start in enumerate(range(0, n, CHUNK)):
        yield mixture(1000 + i, min(CHUNK, n - start), centres)


def exact_top(n: int, centres: torch.Tensor, queries: torch.Tensor, k: int) -> np.ndarray:
    best_s = torch.full((len(queries), k), -2.0, device=DEVICE)
    best_i = torch.zeros((len(queries), k), dtype=torch.int64, device=DEVICE)
    start = 0
    for block in chunks(n, centres):
        s, i = (queries @ block.T).topk(k, dim=1)  # (Q, k) within the block
        best_s, pos = torch.cat([best_s, s], 1).topk(k, dim=1)
        best_i = torch.cat([best_i, i + start], 1).gather(1, pos)
        start += len(block)
    return best_i.cpu().numpy()


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(
        np.mean([len(set(f[: truth.shape[1]]) & set(t)) / len(t) for f, t in zip(found, truth, strict=True)])
    )


def rerank(q: np.ndarray, found: np.ndarray, host16: np.ndarray) -> np.ndarray:
    """(Q, 10) ids: ``found``'s (Q, d) candidates ordered by exact scores from the fp16 copies."""
    cand = np.where(found < 0, 0, found)
    scores = np.einsum("qd,qkd->qk", q, host16[cand].astype(np.float32))  # (Q, d)
    return np.take_along_axis(cand, np.argsort(-scores, axis=1)[:, :10], 1)


def one_size(n: int, factory: str, centres: torch.Tensor, queries: torch.Tensor, keep_fp16: bool) -> dict:
    row: dict = {
        "n": n,
        "factory": factory,
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
    }
    t0 = time.perf_counter()
    truth = exact_top(n, centres, queries, 10)
    row["exact_top10_s"] = round(time.perf_counter() - t0, 2)
    host16 = np.empty((n, DIM), np.float16) if keep_fp16 else None
    added = 0

    def stream() -> Iterator[np.ndarray]:
        nonlocal added
        for block in chunks(n, centres):
            x = block.cpu().numpy()
            if host16 is not None:
                host16[added : added + len(x)] = x
            added += len(x)
            yield x

    report: dict[str, str] = {}
    t0 = time.perf_counter()
    index = build_index(stream(), DIM, factory, gpu="on" if DEVICE == "cuda" else "off", report=report)
    row["build_s"] = round(time.perf_counter() - t0, 1)  # generation + copies included (a few s)
    row["built_on"] = report.get("built_on")
    q = queries.cpu().numpy()
    if DEVICE == "cuda":
        res = faiss.StandardGpuResources()
        opts = faiss.GpuClonerOptions()
        opts.useFloat16 = "PQ" in factory
        t0 = time.perf_counter()
        index = faiss.index_cpu_to_gpu(res, 0, index, opts)
        row["to_gpu_s"] = round(time.perf_counter() - t0, 1)
    sweeps = []
    depth = max(RERANK_DEPTHS) if host16 is not None else 100  # candidates asked of the index
    for nprobe in NPROBES:
        if DEVICE == "cuda":
            faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", nprobe)
        else:
            faiss.extract_index_ivf(index).nprobe = nprobe
        t0 = time.perf_counter()
        _, found = index.search(q, depth)
        batch_ms = (time.perf_counter() - t0) * 1e3
        singles = []
        for j in range(50):
            t1 = time.perf_counter()
            index.search(q[j : j + 1], 10)
            singles.append((time.perf_counter() - t1) * 1e3)
        cell = {
            "nprobe": nprobe,
            "recall10": round(recall(found, truth), 4),
            "one_query_p50_ms": round(float(np.median(singles)), 3),
            f"batch1000_k{depth}_ms": round(batch_ms, 1),
        }
        if host16 is not None:  # exact re-ranking of the top candidates from fp16 copies in host memory
            for d in RERANK_DEPTHS:
                cell[f"recall10_reranked{d}"] = round(recall(rerank(q, found[:, :d], host16), truth), 4)
            singles = []  # one query end to end: the GPU's top candidates, then the host's exact top 10
            for j in range(50):
                t1 = time.perf_counter()
                _, cand = index.search(q[j : j + 1], depth)
                rerank(q[j : j + 1], cand, host16)
                singles.append((time.perf_counter() - t1) * 1e3)
            cell[f"one_query_reranked{depth}_p50_ms"] = round(float(np.median(singles)), 3)
        sweeps.append(cell)
    row["sweep"] = sweeps
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 100_000_000])
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--pq-from", type=int, default=20_000_001, help="sizes from here get --pq-factory")
    ap.add_argument("--pq-factory", default="IVF65536,PQ32")
    args = ap.parse_args()
    started = time.perf_counter()
    g = torch.Generator(device=DEVICE).manual_seed(0)
    top = torch.nn.functional.normalize(torch.randn(CENTRES, DIM, generator=g, device=DEVICE), dim=1)
    sub = torch.randn(CENTRES * SUBS, DIM, generator=g, device=DEVICE) / DIM**0.5
    centres = torch.cat([top, sub])  # (CENTRES + CENTRES * SUBS, DIM): the unit centres, then the offsets
    queries = mixture(7, QUERIES, centres)
    per_million = None
    for n in args.sizes:
        factory = "IVF16384,Flat" if n < args.pq_from else args.pq_factory
        if (
            per_million is not None
            and time.perf_counter() - started + per_million * n / 1e6 * 1.5 > args.budget_s
        ):
            row = {
                "n": n,
                "skipped": f"would pass the {args.budget_s:.0f} s budget ({per_million:.1f} s per 1M so far)",
            }
        else:
            t0 = time.perf_counter()
            row = one_size(n, factory, centres, queries, keep_fp16="PQ" in factory)
            per_million = (time.perf_counter() - t0) / (n / 1e6)
            row["total_s"] = round(time.perf_counter() - t0, 1)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
