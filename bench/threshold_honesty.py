"""Threshold honesty of the served index: ``icr index calibrate`` on the benchmark's largest gallery.

The held-out test captions search the index as the service does (depth 1,000, the tuned nprobe)
and are judged on the generated distractors with the generator's ground truth: what precision
``min_relevance`` 0.5 / 0.8 / 0.9 delivers, pooled and per query kind, P@10 per kind, per query what
the top 20 promise against what they deliver, whether out-of-domain queries pass anything, and the
cost of applying the per-query map to one query's 1,000 hits (it runs on every request).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.stats import repeat, summary

# Kinds with fewer held-out queries than this are reported but not held to the targets.
MIN_KIND_QUERIES = 20


def run(index_dir: Path, log, depth: int = 1000) -> dict[str, Any]:
    from icr.index.calibration import ServedCalibration, calibrate_index
    from icr.training.evaluation.metrics.query_calibration import N_QUERY_FEATURES

    log(f"relevance: calibrating {index_dir} (held-out captions searched to depth {depth})")
    t0 = time.perf_counter()
    info = calibrate_index(index_dir, depth=depth, progress=False)
    seconds = time.perf_counter() - t0
    served = ServedCalibration(info)
    out: dict[str, Any] = {"calibrate_s": seconds, "method": served.method, "labels": info["labels"]}
    if served.per_query is not None:
        rng = np.random.default_rng(0)
        scores = np.sort(rng.uniform(-0.2, 0.9, depth))[::-1]  # one query's best-first list
        # the query embedding's size: the inputs beyond the score-list and text features
        dim = served.per_query.feature_mean.shape[0] - N_QUERY_FEATURES - served.per_query.text_buckets
        query = rng.standard_normal((1, dim)).astype(np.float32)
        text = "a red circle to the left of a blue square"
        times = repeat(lambda: served.relevance(scores, query, text), 200, 20)
        out["per_query_map_ms"] = summary(times)
    evaluation = info.get("evaluation")
    if evaluation:
        out["evaluation"] = evaluation
        out["summary"] = summarise(evaluation)
        log(
            f"relevance: pooled P@10 {out['summary']['p_at_10']:.3f}, precision at 0.5 / 0.8: "
            f"{out['summary']['precision_at_0.5']} / {out['summary']['precision_at_0.8']}"
        )
    return out


def summarise(evaluation: dict[str, Any]) -> dict[str, Any]:
    """The figures the targets read from a calibration's held-out evaluation (its per-query map)."""
    per_query = evaluation["maps"]["per_query"]
    kinds = {k: g for k, g in per_query["by_kind"].items() if g["queries"] >= MIN_KIND_QUERIES}
    return {
        "p_at_10": per_query["pooled"]["p_at_10"],
        "worst_kind_p_at_10": min(
            (g["p_at_10"] for g in kinds.values() if g["p_at_10"] is not None), default=None
        ),
        **{
            f"precision_at_{t}": per_query["pooled"]["thresholds"][t]["precision"]
            for t in ("0.5", "0.8", "0.9")
        },
        **{f"worst_kind_precision_at_{t}": _worst(kinds, t) for t in ("0.5", "0.8")},
        "recall_at_0.5": per_query["pooled"]["thresholds"]["0.5"]["recall"],
        **_per_query_summary(per_query.get("queries"), evaluation.get("out_of_domain")),
    }


def _per_query_summary(honesty: dict[str, Any] | None, ood: dict[str, Any] | None) -> dict[str, Any]:
    """Per-query honesty (worst kind's MAE, shares over- and under-promised) and the out-of-domain
    queries' share passing any hit; None where a calibration predates them."""
    if not honesty:
        return {}
    kinds = {k: g for k, g in honesty["by_kind"].items() if g["queries"] >= MIN_KIND_QUERIES}
    worst = max(kinds, key=lambda k: kinds[k]["mae"], default=None)
    out = {
        "query_mae": honesty["pooled"]["mae"],
        "worst_kind_query_mae": None if worst is None else kinds[worst]["mae"],
        "over_promised": honesty["pooled"]["over"],
        "under_promised": honesty["pooled"]["under"],
    }
    if worst is not None and "chance_mae" in kinds[worst]:  # calibrations since 2026-11-28
        out["worst_query_kind"] = {"kind": worst, **kinds[worst]}
    if ood:
        out.update({f"ood_passing_at_{t}": share for t, share in ood["all"]["passing_any"].items()})
    return out


def _worst(kinds: dict[str, Any], target: str) -> float | None:
    """The lowest delivered precision among kinds with passing hits (None when no kind has any)."""
    values = [g["thresholds"][target]["precision"] for g in kinds.values()]
    values = [v for v in values if v is not None]
    return min(values) if values else None
