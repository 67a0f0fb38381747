"""Threshold honesty: does ``min_relevance = p`` deliver precision p, for every kind of query?

Measured where thresholds act in the service: each held-out query's top-``depth`` hits of a
gallery, every hit judged with the best labels there are (the embedded benchmark's ground truth,
or annotations / CxC). Only *judged* hits enter the threshold figures: on the embedded benchmark
the generated distractors (no caption was written for them, as no query is written for a user's
photo), on Flickr30k/COCO every image but the caption's own. Rank figures (P@10, R-precision)
read every hit, with R = the query's truly relevant items in the whole gallery.

Per group of queries (all pooled, and per query kind where kinds are known):

* ``p_at_10``: relevant hits in the top 10 divided by min(10, R), averaged over queries with R > 0;
  ``r_precision``: relevant hits in the top min(R, depth), divided by that number;
* ``ece``: expected calibration error over the judged top-depth hits (15 equal-width bins of
  predicted relevance), the reliability bins beside it; relevance NaN (a query outside the
  calibration's evidence, shown no relevance) leaves its hits out of it and passes no target;
* per target p: ``passing`` judged hits with relevance >= p, their ``precision`` (the fraction truly
  relevant) and ``expected_precision`` (their mean predicted relevance: what the service promises),
  ``recall`` (relevant passing hits over all relevant judged items of the gallery, so it is bounded
  by depth / R), the queries left with at least one passing hit and ``share_below``, the share of
  those whose own precision is below p - 0.1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from icr.core.top_k import RunningTopK, padded_queries
from icr.training.evaluation.metrics.calibration import reliability_table

TARGETS: tuple[float, ...] = (0.5, 0.8, 0.9)
# A query "misses" a target when its own precision falls this far below it.
QUERY_SLACK = 0.1
ECE_BINS = 15


@dataclass(frozen=True)
class HitLists:
    """Every query's top-``depth`` hits, best first, with their labels."""

    scores: np.ndarray  # (Q, depth) float, each row non-increasing
    relevant: np.ndarray  # (Q, depth) bool: the hit is truly relevant
    judged: np.ndarray  # (Q, depth) bool: the hit counts for threshold figures
    n_relevant: np.ndarray  # (Q,) relevant items in the whole gallery (R)
    n_relevant_judged: np.ndarray  # (Q,) relevant judged items in the whole gallery
    kinds: np.ndarray | None = None  # (Q,) str, or None where kinds are unknown

    def __post_init__(self) -> None:
        q, depth = self.scores.shape
        for name in ("relevant", "judged"):
            if getattr(self, name).shape != (q, depth):
                raise ValueError(f"{name} must be {(q, depth)}, got {getattr(self, name).shape}")
        for name in ("n_relevant", "n_relevant_judged"):
            if getattr(self, name).shape != (q,):
                raise ValueError(f"{name} must be ({q},), got {getattr(self, name).shape}")
        if self.kinds is not None and len(self.kinds) != q:
            raise ValueError(f"kinds must have {q} entries, got {len(self.kinds)}")

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    @classmethod
    def concat(cls, parts: Sequence[HitLists]) -> HitLists:
        """Several queries' hit lists (of one depth) as one; kinds kept only where every part has them."""

        def joined(name: str) -> np.ndarray:
            return np.concatenate([getattr(p, name) for p in parts])

        kinds = None if any(p.kinds is None for p in parts) else joined("kinds")
        return cls(
            joined("scores"),
            joined("relevant"),
            joined("judged"),
            joined("n_relevant"),
            joined("n_relevant_judged"),
            kinds,
        )

    def select(self, rows: np.ndarray) -> HitLists:
        return HitLists(
            self.scores[rows],
            self.relevant[rows],
            self.judged[rows],
            self.n_relevant[rows],
            self.n_relevant_judged[rows],
            None if self.kinds is None else self.kinds[rows],
        )


class TopDepth:
    """Each query's ``depth`` best items of a gallery whose vectors stream past in id order.

    Keeps (Q, depth) scores and ids, never the gallery: millions of distractors pass batch by
    batch, each scored in one matrix multiply and selected against each query's running threshold
    (:class:`~icr.core.top_k.RunningTopK`), so selecting costs about one
    read of the scores. Exact; best first, ties by lower id.
    """

    def __init__(self, queries: np.ndarray, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.queries = torch.from_numpy(padded_queries(np.asarray(queries, dtype=np.float32)))  # (Q8, D)
        self.depth = depth
        self.ntotal = 0
        self._top = RunningTopK(len(queries), depth, None)
        self._result: tuple[np.ndarray, np.ndarray] | None = None

    def score(self, vectors: np.ndarray) -> Any:
        """(b, Q8) torch float32 scores of the next gallery ``vectors`` (b, D): what :meth:`offer` takes."""
        # copies only a read-only array (a memory map's slice: torch cannot wrap one) or another dtype
        v = torch.from_numpy(np.require(vectors, np.float32, ("C", "W")))  # (b, D)
        with torch.inference_mode():
            return torch.mm(v, self.queries.T)  # (b, Q8)

    def offer(self, scores: Any) -> None:
        """The next ``len(scores)`` gallery items (ids ntotal, ntotal + 1, ...) by their (b, Q8)
        scores against these queries, as :meth:`score` gives them (e.g. shared with another pass)."""
        self._top.offer(scores, self.ntotal)
        self.ntotal += len(scores)
        self._result = None

    def add(self, vectors: np.ndarray) -> None:
        """Score and keep the next ``len(vectors)`` gallery items."""
        self.offer(self.score(vectors))

    def _lists(self) -> tuple[np.ndarray, np.ndarray]:
        if self._result is None:
            self._result = self._top.result()  # (Q, min(depth, ntotal)): every row is full
        return self._result

    @property
    def scores(self) -> np.ndarray:
        return self._lists()[0]  # (Q, min(depth, ntotal)) float32, best first

    @property
    def ids(self) -> np.ndarray:
        return self._lists()[1]


def reliability(predicted: np.ndarray, relevant: np.ndarray, bins: int = ECE_BINS) -> dict[str, Any]:
    """ECE and the reliability table of predicted probabilities against 0/1 outcomes (any shapes)."""
    p = np.asarray(predicted, dtype=np.float64).ravel()
    rel = np.asarray(relevant, dtype=bool).ravel()
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    return reliability_table(
        np.bincount(idx, minlength=bins),
        np.bincount(idx, weights=p, minlength=bins),
        np.bincount(idx[rel], minlength=bins),
    )


def rank_figures(hits: HitLists) -> dict[str, float | None]:
    """Mean P@10 (over min(10, R)) and R-precision (R capped at the depth) over queries with R > 0."""
    depth = hits.scores.shape[1]
    found = hits.n_relevant > 0
    if not found.any():
        return {"p_at_10": None, "r_precision": None}
    cum = np.cumsum(hits.relevant[found], axis=1)  # (Q', depth)
    r = hits.n_relevant[found]
    at10 = cum[:, min(10, depth) - 1] / np.minimum(min(10, depth), r)
    cut = np.minimum(r, depth)
    rprec = cum[np.arange(len(r)), cut - 1] / cut
    return {"p_at_10": float(at10.mean()), "r_precision": float(rprec.mean())}


def target_figures(hits: HitLists, relevance: np.ndarray, target: float) -> dict[str, Any]:
    """What ``min_relevance = target`` delivers on the judged hits (see the module docstring)."""
    passing = hits.judged & (relevance >= target)  # (Q, depth)
    good = passing & hits.relevant
    n_pass, n_good = passing.sum(axis=1), good.sum(axis=1)  # (Q,)
    total, total_good = int(n_pass.sum()), int(n_good.sum())
    with_hits = n_pass > 0
    own = n_good[with_hits] / n_pass[with_hits]
    all_relevant = int(hits.n_relevant_judged.sum())
    return {
        "passing": total,
        "precision": total_good / total if total else None,
        "expected_precision": float(relevance[passing].mean()) if total else None,
        "recall": total_good / all_relevant if all_relevant else None,
        "queries_with_hits": int(with_hits.sum()),
        "share_below": float(np.mean(own < target - QUERY_SLACK)) if with_hits.any() else None,
    }


def group_figures(
    hits: HitLists, relevance: np.ndarray, targets: Sequence[float] = TARGETS
) -> dict[str, Any]:
    """Every figure of the module docstring for one group of queries."""
    promised = hits.judged & ~np.isnan(relevance)  # a query given no promise has no relevance to check
    rel = reliability(relevance[promised], hits.relevant[promised])
    return {
        "queries": len(hits),
        **rank_figures(hits),
        "judged_hits": int(hits.judged.sum()),
        "ece": rel["ece"],
        "reliability": rel["bins"],
        "thresholds": {str(t): target_figures(hits, relevance, t) for t in targets},
    }


def threshold_honesty(
    hits: HitLists, relevance: np.ndarray, targets: Sequence[float] = TARGETS
) -> dict[str, Any]:
    """``{"pooled": figures, "by_kind": {kind: figures}}`` for predicted ``relevance`` (Q, depth)."""
    relevance = np.asarray(relevance, dtype=np.float64)
    if relevance.shape != hits.scores.shape:
        raise ValueError(f"relevance must be {hits.scores.shape}, got {relevance.shape}")
    out: dict[str, Any] = {"pooled": group_figures(hits, relevance, targets), "by_kind": {}}
    if hits.kinds is not None:
        for kind in sorted(set(hits.kinds.tolist())):
            rows = np.flatnonzero(hits.kinds == kind)
            out["by_kind"][kind] = group_figures(hits.select(rows), relevance[rows], targets)
    return out
