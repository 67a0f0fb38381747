"""What the hardware allows, measured in the same run as the searches it bounds.

* **Memory bandwidth**: a single-query exact search reads every gallery vector once, so its floor
  is ``gallery bytes / read bandwidth``. Measured on the gallery matrix itself, as the best of a
  matrix-vector product (BLAS sgemv) on one thread and on every core: the fastest way this machine
  can stream those bytes through the arithmetic a search needs.
* **Matmul rate**: a batch of Q queries does ``2 N d Q`` flops; its floor is that over the best
  fp32 matrix-multiply rate (a large square sgemm), or the bandwidth floor if that is larger.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from bench.stats import repeat


def cores() -> int:
    return len(os.sched_getaffinity(0))


def bandwidth(matrix: np.ndarray, repeats: int = 5) -> dict[str, Any]:
    """Read bandwidth in GB/s over ``matrix`` (N, d) float32, per thread count, and the best."""
    from threadpoolctl import threadpool_limits

    vector = np.ones(matrix.shape[1], np.float32)
    out: dict[str, Any] = {"bytes": int(matrix.nbytes)}
    best = 0.0
    for threads in sorted({1, cores()}):
        with threadpool_limits(threads):
            seconds = min(repeat(lambda: matrix @ vector, repeats))
        gbps = matrix.nbytes / seconds / 1e9
        out[f"sgemv_{threads}t_gbps"] = gbps
        best = max(best, gbps)
    out["best_gbps"] = best
    return out


def matmul_rate(size: int = 4096, repeats: int = 3) -> dict[str, Any]:
    """fp32 GFLOP/s of a ``size`` x ``size`` sgemm, per thread count, and the best."""
    from threadpoolctl import threadpool_limits

    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    out: dict[str, Any] = {"size": size}
    best = 0.0
    for threads in sorted({1, cores()}):
        with threadpool_limits(threads):
            seconds = min(repeat(lambda: a @ a, repeats))
        gflops = 2 * size**3 / seconds / 1e9
        out[f"sgemm_{threads}t_gflops"] = gflops
        best = max(best, gflops)
    out["best_gflops"] = best
    return out


def search_floor_ms(n: int, dim: int, batch: int, gbps: float, gflops: float) -> float:
    """Lower bound in ms of an exact fp32 inner-product search of ``batch`` queries over ``n`` x ``dim``."""
    read_s = n * dim * 4 / (gbps * 1e9)
    compute_s = 2.0 * n * dim * batch / (gflops * 1e9)
    return max(read_s, compute_s) * 1e3
