"""Text-to-image recall with extra distractor images in the gallery (the paper's "+3.3M" setting).

A caption query must find a relevant image among the test images *plus* N distractors. The
distractors stream past in batches and never sit in memory together: per caption only the best
relevant score seen so far and the ``max(K)`` highest non-relevant scores are kept, which is all
R@K needs (the best relevant item is in the top K iff fewer than K non-relevant items score at
least as high: ties pessimistic, as everywhere). On Flickr30k/COCO every distractor is
non-relevant; on the embedded benchmark a distractor that truly satisfies the caption counts as
relevant (its relevance block comes with the batch).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from icr.training.evaluation.metrics.pair_blocks import resolve_nan
from icr.training.evaluation.metrics.relevance import Relevance

DISTRACTOR_RECALL_AT: tuple[int, ...] = (1, 5, 10, 100)


class DistractorRecall:
    """Accumulates, per caption query, the best relevant score and the top-K non-relevant scores."""

    def __init__(self, num_queries: int, ks: tuple[int, ...] = DISTRACTOR_RECALL_AT) -> None:
        if not ks or min(ks) < 1:
            raise ValueError(f"recall cut-offs must be positive integers, got {ks}")
        self.ks = tuple(sorted(ks))
        self.best_relevant = np.full(num_queries, -np.inf)  # (Q,)
        self.relevant_seen = np.zeros(num_queries, dtype=np.int64)  # (Q,)
        # A query with a NaN relevant score ranks all its relevant items last, as in ranking.py.
        self.poisoned = np.zeros(num_queries, dtype=bool)  # (Q,)
        self.top_other = np.full((num_queries, max(self.ks)), -np.inf)  # (Q, K) unordered
        self.candidates = 0
        self.relevant_distractors = 0

    def add(self, scores: np.ndarray, relevant: np.ndarray | None = None, *, distractor: bool = True) -> None:
        """One gallery block: ``scores`` (Q, b) caption x image, ``relevant`` (Q, b) bool or None."""
        if relevant is None:
            relevant = np.zeros(scores.shape, dtype=bool)
        if scores.shape != relevant.shape or scores.shape[0] != self.best_relevant.size:
            raise ValueError(
                f"expected scores and relevance of shape ({self.best_relevant.size}, b), got "
                f"{scores.shape} and {relevant.shape}"
            )
        scores = np.asarray(scores, dtype=np.float64)
        self.relevant_seen += relevant.sum(axis=1)
        self.poisoned |= (np.isnan(scores) & relevant).any(axis=1)
        scores = resolve_nan(scores, relevant)
        self.candidates += scores.shape[1]
        if distractor:
            self.relevant_distractors += int(relevant.any(axis=0).sum())
        if relevant.any():
            np.maximum(
                self.best_relevant, np.where(relevant, scores, -np.inf).max(axis=1), out=self.best_relevant
            )
        merged = np.concatenate([self.top_other, np.where(relevant, -np.inf, scores)], axis=1)  # (Q, K + b)
        k = self.top_other.shape[1]
        self.top_other = np.partition(merged, merged.shape[1] - k, axis=1)[:, -k:]

    def metrics(self, prefix: str = "t2i") -> dict[str, float]:
        """``{prefix}_r{K}`` in percent over queries with a relevant image anywhere in the gallery."""
        has = self.relevant_seen > 0  # (Q,)
        best = np.where(self.poisoned, -np.inf, self.best_relevant)  # (Q,)
        beaten_by = (self.top_other >= best[:, None]).sum(axis=1)  # (Q,) capped at K
        # Ranked last (a -inf best): behind every non-relevant candidate, not behind the -inf padding
        # of top_other when fewer than K were seen.
        last = np.minimum(self.candidates - self.relevant_seen, self.top_other.shape[1])  # (Q,)
        beaten_by = np.where(best == -np.inf, last, beaten_by)
        out = {
            f"{prefix}_r{k}": float(100.0 * np.mean(beaten_by[has] < k)) if has.any() else 0.0
            for k in self.ks
        }
        out["gallery_size"] = float(self.candidates)
        out["queries_without_relevant"] = float((~has).sum())
        out["distractors_relevant_to_some_query"] = float(self.relevant_distractors)
        return out


def distractor_recall(
    cap_emb: np.ndarray,
    img_emb: np.ndarray,
    relevance: Relevance,
    distractors: Iterable[tuple[np.ndarray, np.ndarray | None]],
    *,
    ks: tuple[int, ...] = DISTRACTOR_RECALL_AT,
) -> dict[str, float]:
    """t2i R@K over the test images plus streamed distractors.

    ``cap_emb`` (N_cap, D), ``img_emb`` (N_img, D) L2-normalised; ``relevance`` of the test pairs;
    ``distractors`` yields ``(embeddings (b, D), relevant (N_cap, b) bool or None)`` batches.
    """
    acc = DistractorRecall(cap_emb.shape[0], ks)
    acc.add(
        cap_emb @ img_emb.T, relevance.caption_rows(0, relevance.n_cap), distractor=False
    )  # (N_cap, N_img)
    for emb, rel in distractors:
        acc.add(cap_emb @ np.asarray(emb, dtype=cap_emb.dtype).T, rel)  # (N_cap, b)
    return acc.metrics()
