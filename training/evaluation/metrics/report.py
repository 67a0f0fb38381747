"""Every metric of a test similarity matrix in one call (what ``icr evaluate`` and the benchmarks run).

Sections of the returned dict:

* ``retrieval``: rank metrics under the protocol, fold-averaged (``retrieval_std`` across folds);
* ``global``: PR-AUC (average precision and trapezoid) over all pairs, random baseline, best F1;
* ``thresholds``: precision / recall / F1 / empty-query fractions at global score thresholds (the
  best-F1 threshold, the thresholds reaching precision 0.5 / 0.8 / 0.9, and any asked for);
* ``score_distribution``: per-query score statistics (Fig. 4 right of the Cross-Example paper);
* ``calibration``: ECE and the reliability table when a fitted :class:`Calibration` is given.

PR-AUC, thresholds and calibration always use every pair of the split (COCO 5K: 125 M pairs),
whatever the rank protocol, as in the Cross-Example Softmax paper.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from icr.training.evaluation.metrics.calibration import Calibration, calibration_error
from icr.training.evaluation.metrics.global_pr import global_metrics, pr_curve, threshold_metrics
from icr.training.evaluation.metrics.protocols import fold_metrics
from icr.training.evaluation.metrics.ranking import as_score_matrix
from icr.training.evaluation.metrics.relevant_pairs import Relevance
from icr.training.evaluation.metrics.score_distribution import score_distributions

PRECISION_TARGETS: tuple[float, ...] = (0.5, 0.8, 0.9)


def full_metrics(
    sim: np.ndarray | torch.Tensor,
    relevance: Relevance,
    img_of_cap: np.ndarray,
    *,
    protocol: str = "full",
    calibration: Calibration | None = None,
    thresholds: Sequence[float] = (),
    distribution_queries: int = 1000,
) -> dict[str, Any]:
    """All metric sections for ``sim`` (N_img, N_cap) against ``relevance`` (see module docstring).

    ``img_of_cap`` assigns captions to 1K folds. ``report["curve"]`` and the per-query curves in
    ``report["score_distribution"]`` are numpy arrays meant for plots; :func:`json_ready` drops them.
    """
    sim = as_score_matrix(sim)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    folds = fold_metrics(sim, relevance, img_of_cap, protocol)
    timings["ranking_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    curve = pr_curve(sim, relevance)
    scalars = global_metrics(curve)
    summary: dict[str, float | None] = dict(scalars)  # a precision no threshold reaches adds a None
    timings["pr_curve_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    probes = [scalars["best_f1_threshold"], *thresholds]
    for target in PRECISION_TARGETS:
        point = curve.threshold_for_precision(target)
        summary[f"threshold_precision_{target}"] = point["threshold"] if point else None
        summary[f"recall_at_precision_{target}"] = point["recall"] if point else 0.0
        if point:
            probes.append(point["threshold"])
    table = threshold_metrics(sim, relevance, probes, curve)
    timings["thresholds_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    distribution = score_distributions(sim, relevance, queries=distribution_queries)
    timings["score_distribution_s"] = time.perf_counter() - t0

    report: dict[str, Any] = {
        "protocol": {"name": folds["protocol"], "folds": folds["folds"]},
        "retrieval": folds["metrics"],
        "retrieval_std": folds["std"],
        "retrieval_per_fold": folds["per_fold"],
        "global": summary,
        "thresholds": table,
        "score_distribution": distribution,
        "curve": curve,
    }
    if calibration is not None:
        t0 = time.perf_counter()
        report["calibration"] = {
            "method": calibration.method,
            "fit": calibration.fit,
            **calibration_error(sim, relevance, calibration),
        }
        report["calibration"]["score_for_relevance"] = {
            str(p): calibration.score_for(p) for p in PRECISION_TARGETS
        }
        timings["calibration_s"] = time.perf_counter() - t0
    report["timings"] = timings
    return report


def json_ready(report: dict[str, Any]) -> dict[str, Any]:
    """A copy of a :func:`full_metrics` report for JSON: the curve as <= 2000 points, no per-query arrays."""
    out = dict(report)
    curve = out.pop("curve", None)
    if curve is not None:
        out["pr_curve_points"] = curve.points()
    if "score_distribution" in out:
        out["score_distribution"] = {
            d: {k: v for k, v in section.items() if k != "curves"}
            for d, section in out["score_distribution"].items()
        }
    return out
