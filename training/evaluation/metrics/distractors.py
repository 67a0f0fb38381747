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

import numpy as np
import torch

from icr.core.top_k import RunningTopK

DISTRACTOR_RECALL_AT: tuple[int, ...] = (1, 5, 10, 100)


class DistractorRecall:
    """Accumulates, per caption query, the best relevant score and the top-K non-relevant scores.

    Blocks come gallery-major, (b, Q) image x caption, as a matrix multiply of the gallery rows
    with the queries gives them; the top-K keeps a running threshold per query
    (:class:`~icr.core.top_k.RunningTopK`), so a block costs about one read
    of its scores.
    """

    def __init__(self, num_queries: int, ks: tuple[int, ...] = DISTRACTOR_RECALL_AT) -> None:
        if not ks or min(ks) < 1:
            raise ValueError(f"recall cut-offs must be positive integers, got {ks}")
        self.ks = tuple(sorted(ks))
        self.num_queries = num_queries
        self.best_relevant = np.full(num_queries, -np.inf)  # (Q,)
        self.relevant_seen = np.zeros(num_queries, dtype=np.int64)  # (Q,)
        # A query with a NaN relevant score ranks all its relevant items last, as in ranking.py.
        self.poisoned = np.zeros(num_queries, dtype=bool)  # (Q,)
        self._others = RunningTopK(num_queries, max(self.ks), None)  # the K best non-relevant scores
        self.candidates = 0
        self.relevant_distractors = 0

    def add(
        self,
        scores: np.ndarray | torch.Tensor,
        relevant: np.ndarray | None = None,
        *,
        distractor: bool = True,
    ) -> None:
        """One gallery block: ``scores`` (b, Q') image x caption with Q' >= Q (columns past Q, e.g.
        padding, are ignored), ``relevant`` (b, Q) bool or None (nothing relevant)."""
        block = torch.as_tensor(scores)
        q = self.num_queries
        if (
            block.ndim != 2
            or block.shape[1] < q
            or (relevant is not None and relevant.shape != (len(block), q))
        ):
            raise ValueError(
                f"expected scores of shape (b, >={q}) and relevance of shape (b, {q}), got "
                f"{tuple(block.shape)} and {None if relevant is None else relevant.shape}"
            )
        block = block.float()  # (b, Q') no copy when float32 already
        self.candidates += len(block)
        # a NaN makes the sum NaN: one cheap reduction instead of a (b, Q) mask, in the common case
        clean = bool(torch.isfinite(block[:, :q].sum()))
        if not clean or (relevant is not None and relevant.any()):
            nan = torch.isnan(block[:, :q]).numpy()  # (b, Q)
            rel = np.zeros_like(nan) if relevant is None else np.asarray(relevant, dtype=bool)
            self.relevant_seen += rel.sum(axis=0)
            self.poisoned |= (nan & rel).any(axis=0)
            if distractor:
                self.relevant_distractors += int(rel.any(axis=1).sum())
            values = block[:, :q].numpy()  # (b, Q)
            np.maximum(
                self.best_relevant, np.where(rel & ~nan, values, -np.inf).max(axis=0), out=self.best_relevant
            )
            # a NaN non-relevant score ranks above everything (pessimistic, as in pair_blocks)
            others = np.where(rel, -np.inf, np.where(nan, np.inf, values)).astype(np.float32)
            block = torch.from_numpy(others)  # (b, Q)
        self._others.offer(block, 0)  # ids are not needed: only the values count against the best

    def metrics(self, prefix: str = "t2i") -> dict[str, float]:
        """``{prefix}_r{K}`` in percent over queries with a relevant image anywhere in the gallery."""
        has = self.relevant_seen > 0  # (Q,)
        best = np.where(self.poisoned, -np.inf, self.best_relevant)  # (Q,)
        top_other = self._others.result()[0]  # (Q, <= K) -inf padded
        beaten_by = (top_other >= best[:, None]).sum(axis=1)  # (Q,) capped at K
        # Ranked last (a -inf best): behind every non-relevant candidate, not behind the -inf padding
        # of top_other when fewer than K were seen.
        last = np.minimum(self.candidates - self.relevant_seen, max(self.ks))  # (Q,)
        beaten_by = np.where(best == -np.inf, last, beaten_by)
        out = {
            f"{prefix}_r{k}": float(100.0 * np.mean(beaten_by[has] < k)) if has.any() else 0.0
            for k in self.ks
        }
        out["gallery_size"] = float(self.candidates)
        out["queries_without_relevant"] = float((~has).sum())
        out["distractors_relevant_to_some_query"] = float(self.relevant_distractors)
        return out
