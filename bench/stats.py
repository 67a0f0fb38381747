"""Summaries of repeated timings: medians with their spread, latency percentiles, throughput."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def summary(seconds: list[float] | np.ndarray) -> dict[str, float]:
    """Median and spread (min, max, interquartile range) in milliseconds, with the repeat count."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    q1, q3 = np.percentile(ms, [25, 75])
    return {
        "median_ms": float(np.median(ms)),
        "iqr_ms": float(q3 - q1),
        "min_ms": float(ms.min()),
        "max_ms": float(ms.max()),
        "n": int(ms.size),
    }


def latency(seconds: list[float] | np.ndarray) -> dict[str, float]:
    """p50 / p90 / p99 / mean in milliseconds of per-request latencies."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "p50_ms": float(p50),
        "p90_ms": float(p90),
        "p99_ms": float(p99),
        "mean_ms": float(ms.mean()),
        "n": int(ms.size),
    }


def repeat(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def ratio(numerator: float, denominator: float) -> float | None:
    return None if not denominator else float(numerator / denominator)
