"""Global calibration metrics over every (caption, image) pair: PR curve, PR-AUC, threshold metrics.

The Cross-Example Softmax paper measures global calibration by scoring all caption-image pairs
of the test set, sorting them by score and taking the area under the precision-recall curve
(COCO 5K: 125 M pairs, 25,000 relevant). One relevance-independent score threshold then means
the same thing for every query, which is what a search service with ``min_score`` needs.

Both areas are reported, because the paper does not say which it used:

* ``pr_auc`` = **average precision** (the primary number): ``sum over distinct relevant scores t,
  descending, of (newly recalled relevant pairs / P) * precision(t)``. Pairs with equal scores enter
  together (one threshold), so the value does not depend on the order of ties; it equals
  scikit-learn's ``average_precision_score``.
* ``pr_auc_trapezoid``: the trapezoidal area under the same curve (scikit-learn's
  ``auc(recall, precision)`` on ``precision_recall_curve``), slightly optimistic.

Memory stays bounded: every block of the similarity matrix is sorted on its own and only the
counts of block scores at or above each relevant score are kept (no global sort of 125 M scores).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from icr.training.evaluation.metrics.pair_blocks import pair_blocks, relevant_scores
from icr.training.evaluation.metrics.relevant_pairs import Relevance


@dataclass(frozen=True)
class PRCurve:
    """Counts at each distinct relevant score (descending): enough for AP, the curve and its area."""

    thresholds: np.ndarray  # (T,) distinct relevant scores, best first
    tp: np.ndarray  # (T,) relevant pairs scoring >= threshold
    fp: np.ndarray  # (T,) non-relevant pairs scoring >= threshold
    tp_above: np.ndarray  # (T,) relevant pairs scoring > threshold
    fp_above: np.ndarray  # (T,) non-relevant pairs scoring > threshold
    num_relevant: int
    num_pairs: int

    @property
    def precision(self) -> np.ndarray:
        precision: np.ndarray = self.tp / np.maximum(self.tp + self.fp, 1)
        return precision

    @property
    def recall(self) -> np.ndarray:
        return self.tp / max(self.num_relevant, 1)

    def average_precision(self) -> float:
        gained = (self.tp - self.tp_above) / max(self.num_relevant, 1)  # (T,) recall added at t
        return float(np.sum(gained * self.precision))

    def trapezoid_auc(self) -> float:
        above = self.tp_above + self.fp_above
        # The curve point just before t is the next higher threshold (precision 1 at the very top).
        prev_precision = np.where(above > 0, self.tp_above / np.maximum(above, 1), 1.0)
        gained = (self.tp - self.tp_above) / max(self.num_relevant, 1)
        return float(np.sum(gained * (prev_precision + self.precision) / 2))

    def best_f1(self) -> dict[str, float]:
        """The curve point with the highest F1 (F1 peaks where a relevant pair enters)."""
        p, r = self.precision, self.recall
        f1 = np.where(p + r > 0, 2 * p * r / np.maximum(p + r, 1e-300), 0.0)
        i = int(np.argmax(f1))
        return {
            "f1": float(f1[i]),
            "threshold": float(self.thresholds[i]),
            "precision": float(p[i]),
            "recall": float(r[i]),
        }

    def threshold_for_precision(self, target: float) -> dict[str, float] | None:
        """The lowest threshold whose precision is >= ``target`` (most recall), or None if none."""
        ok = np.flatnonzero(self.precision >= target)
        if ok.size == 0:
            return None
        i = int(ok[-1])
        return {
            "threshold": float(self.thresholds[i]),
            "precision": float(self.precision[i]),
            "recall": float(self.recall[i]),
        }

    def points(self, max_points: int = 2000) -> dict[str, list[float]]:
        """At most ``max_points`` (recall, precision, threshold) points, evenly spread, for plots."""
        keep = np.unique(
            np.linspace(0, len(self.thresholds) - 1, min(max_points, len(self.thresholds))).astype(int)
        )
        return {
            "recall": self.recall[keep].tolist(),
            "precision": self.precision[keep].tolist(),
            "threshold": self.thresholds[keep].tolist(),
        }


def _count_at_or_above(
    sim: np.ndarray | torch.Tensor, relevance: Relevance, probes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(#pairs >= probe, #pairs > probe) for each probe, one sorted block at a time."""
    at_least = np.zeros(probes.size, dtype=np.int64)
    above = np.zeros(probes.size, dtype=np.int64)
    for _, scores, _ in pair_blocks(sim, relevance):
        flat = np.sort(scores, axis=None)  # (b * N_cap,) ascending
        at_least += flat.size - np.searchsorted(flat, probes, side="left")
        above += flat.size - np.searchsorted(flat, probes, side="right")
    return at_least, above


def pr_curve(sim: np.ndarray | torch.Tensor, relevance: Relevance) -> PRCurve:
    """The global precision-recall curve over all (image, caption) pairs of ``sim`` (N_img, N_cap)."""
    positives = relevant_scores(sim, relevance)  # (P,) ascending
    if positives.size == 0:
        raise ValueError("no relevant pair: PR-AUC needs at least one relevant (image, caption) pair")
    thresholds = np.unique(positives)[::-1]  # (T,) descending
    all_ge, all_gt = _count_at_or_above(sim, relevance, thresholds)
    tp = positives.size - np.searchsorted(positives, thresholds, side="left")
    tp_above = positives.size - np.searchsorted(positives, thresholds, side="right")
    return PRCurve(
        thresholds=thresholds,
        tp=tp,
        fp=all_ge - tp,
        tp_above=tp_above,
        fp_above=all_gt - tp_above,
        num_relevant=int(positives.size),
        num_pairs=int(relevance.n_img * relevance.n_cap),
    )


def _query_max(sim: np.ndarray | torch.Tensor, relevance: Relevance) -> tuple[np.ndarray, np.ndarray]:
    """Best score of every image query (N_img,) and every caption query (N_cap,)."""
    row_max = np.empty(relevance.n_img)
    col_max = np.full(relevance.n_cap, -np.inf)
    for start, scores, _ in pair_blocks(sim, relevance):
        row_max[start : start + len(scores)] = scores.max(axis=1)
        np.maximum(col_max, scores.max(axis=0), out=col_max)
    return row_max, col_max


def threshold_metrics(
    sim: np.ndarray | torch.Tensor,
    relevance: Relevance,
    thresholds: Sequence[float],
    curve: PRCurve | None = None,
) -> list[dict[str, float | None]]:
    """Precision, recall, F1 of "every pair scoring >= t is returned", and empty queries, per ``t``.

    ``empty_i2t`` / ``empty_t2i``: fraction of image / caption queries with no candidate >= t (a
    search with ``min_score=t`` answers them with nothing). ``results_per_query_*``: mean number of
    candidates >= t. Precision is None when no pair passes. ``curve``: the :func:`pr_curve` of the
    same pairs, whose counts are reused for thresholds it already holds (best F1, precision
    targets), so only other thresholds cost a pass of sorting every block.
    """
    probes = np.asarray(sorted({float(t) for t in thresholds}), dtype=np.float64)
    returned = np.zeros(probes.size, dtype=np.int64)  # pairs >= t
    tp = np.zeros(probes.size, dtype=np.int64)  # relevant pairs >= t
    at = {} if curve is None else {float(t): i for i, t in enumerate(curve.thresholds)}
    known = np.array([t in at for t in probes], dtype=bool)
    for j in np.flatnonzero(known):
        assert curve is not None  # without a curve ``at`` is empty, so nothing is known
        i = at[probes[j]]
        tp[j], returned[j] = curve.tp[i], curve.tp[i] + curve.fp[i]
    if curve is not None and known.all():
        num_relevant = curve.num_relevant
    else:
        positives = relevant_scores(sim, relevance)
        num_relevant = positives.size
        returned[~known] = _count_at_or_above(sim, relevance, probes[~known])[0]
        tp[~known] = positives.size - np.searchsorted(positives, probes[~known], side="left")
    row_max, col_max = _query_max(sim, relevance)
    out: list[dict[str, float | None]] = []
    for t, n_ret, n_tp in zip(probes, returned, tp, strict=True):
        precision = float(n_tp / n_ret) if n_ret else None
        recall = float(n_tp / max(num_relevant, 1))
        f1 = 2 * precision * recall / (precision + recall) if precision and precision + recall > 0 else 0.0
        out.append(
            {
                "threshold": float(t),
                "precision": precision,
                "recall": recall,
                "f1": float(f1),
                "returned_pairs": int(n_ret),
                "empty_i2t": float(np.mean(row_max < t)),
                "empty_t2i": float(np.mean(col_max < t)),
                "results_per_query_i2t": float(n_ret / max(relevance.n_img, 1)),
                "results_per_query_t2i": float(n_ret / max(relevance.n_cap, 1)),
            }
        )
    return out


def global_metrics(curve: PRCurve) -> dict[str, float]:
    """Scalar summary of a :class:`PRCurve` (PR-AUC both ways, random baseline, best F1)."""
    best = curve.best_f1()
    return {
        "pr_auc": curve.average_precision(),
        "pr_auc_trapezoid": curve.trapezoid_auc(),
        "pr_auc_random": curve.num_relevant / max(curve.num_pairs, 1),
        "relevant_pairs": float(curve.num_relevant),
        "pairs": float(curve.num_pairs),
        "best_f1": best["f1"],
        "best_f1_threshold": best["threshold"],
        "best_f1_precision": best["precision"],
        "best_f1_recall": best["recall"],
    }
