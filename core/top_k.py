"""Exact running top-k of score blocks that stream past in id order, thresholded.

Each query keeps its k best (score, id) so far and the k-th best as a threshold; a new block's
scores are compared with it in one pass, and only the few that pass are gathered and merged. After
the first blocks almost nothing passes, so selecting costs about one read of the scores instead of
a top-k over every block. The first block's own top k are taken outright (no comparison pass) when
no tie crosses its cut: a gallery of one block is then one top-k. Used by the exact search kernel
(:mod:`icr.index.exact_kernel`) over a stored gallery and by ``icr evaluate`` over distractors
streamed from the generator or a file.

Order: best first, ties by lower id. Blocks come in id order, so with exact scores a later score
equal to the current k-th can never displace it: only strictly greater scores are candidates.
"""

from __future__ import annotations

import numpy as np
import torch

from icr.core.threshold_scan import ThresholdScan

SAMPLE = 16  # every SAMPLE-th row of a first block sets the cut its top k are looked for above
# ... for at most this many wanted (query, rank) pairs: about twice as many (row, column, score)
# triples pass that cut (40 MB here), where a 25,000-query evaluation at depth 1,000 would write 1 GB
SAMPLED_MAX = 1 << 20
FLUSH = 1  # pending candidates are merged (tightening the thresholds) past FLUSH x k x Q


def padded_queries(queries: np.ndarray) -> np.ndarray:
    """(Q8, D) float32: ``queries`` (Q, D) with zero rows up to a multiple of 8 (one query stays
    one), the layout :meth:`RunningTopK.offer` reads its blocks in."""
    # a (b, 8m) bool mask then reads as int64 words, so "does this gallery row beat any query's
    # cut" is one cheap pass
    padded = np.zeros((-(-len(queries) // 8) * 8 if len(queries) > 1 else 1, queries.shape[1]), np.float32)
    padded[: len(queries)] = queries
    return padded


class RunningTopK:
    """Per query, the k best (score, id) seen so far (``window`` None), or every one within
    ``window`` (Q,) of the k-th best; unordered, -inf / -1 padded. ``threshold`` (Q,): what a new
    score must beat (fp32) or reach (with a window)."""

    def __init__(self, q: int, k: int, window: np.ndarray | None, floor: np.ndarray | None = None):
        """``floor`` (Q,) float32: an optimistic cut (e.g. from a sample of the gallery): only
        scores at or above it are ever offered. What it may have cut off is told by :meth:`unsure`."""
        self.q, self.k, self.window = q, k, window
        self.scores = np.full((q, 0), -np.inf, np.float32)
        self.ids = np.full((q, 0), -1, np.int64)
        self.floor = None if floor is None else np.asarray(floor, np.float32)
        # the threshold :meth:`cut` passes a score from: fp32 strictly above, a window from one float below
        self._least = np.full(q, -np.inf, np.float32)
        if self.floor is not None:
            self._least = self.floor if window is not None else np.nextafter(self.floor, np.float32(-np.inf))
        self.threshold = self._least.copy()
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (rows, scores, ids)
        self._count = 0
        self._scan = ThresholdScan()  # its output buffers are reused block after block

    def offer(self, block: torch.Tensor, start: int) -> None:
        """Consider ``block`` (b, Q8), the scores of ids start .. start + b - 1 for the queries
        padded to a multiple of 8 (columns past Q are ignored): one compiled pass compares it with
        each query's threshold (:mod:`icr.core.threshold_scan`) and keeps only what passes."""
        window = self.window is not None
        fresh = not window and self.floor is None and self.ids.shape[1] == 0 and not self._pending
        # a long block's k + 1 best: the running k best outright, or its k-th a provisional cut
        ranked = (
            top_rows(block, self.q, self.k + 1, self._scan)
            if len(block) > self.k and (fresh or not self.settled)
            else None
        )
        if fresh and ranked is not None and self._take_top(ranked, start):
            return
        if not self.settled and len(block) >= self.k:
            # a row still short of k hits: this block's own k-th best is a valid provisional cut
            if ranked is None:
                ranked = torch.topk(block[:, : self.q], self.k, dim=0)
            kth = ranked[0][self.k - 1].float().numpy()  # (Q,)
            unset = ~np.isfinite(self.threshold)
            # fp32 compares strictly, so the k-th's ties must pass this first cut: one float below
            provisional = kth - self.window if window else np.nextafter(kth, -np.inf)
            self.threshold[unset] = provisional[unset]
        # compared in fp32 (a bf16 block is widened first): the cut is then exact in either dtype
        values = block.float().numpy()  # (b, Q8) the same memory when float32 already
        rows, cols, scores = self._scan.reaching(values, self.cut(block.shape[1]))
        self.add(cols, scores, rows + start)

    @property
    def settled(self) -> bool:
        """Whether every query has a finite threshold: :meth:`cut` then passes little."""
        return bool(np.isfinite(self.threshold).all())

    def cut(self, width: int) -> np.ndarray:
        """(width,) float32: what a score of each column must reach (``>=``) to be a candidate; the
        columns past Q (padding) are +inf and pass nothing."""
        cut = np.full(width, np.inf, np.float32)
        if self.window is None:  # strictly above the k-th best: at least the next float up
            cut[: self.q] = np.nextafter(self.threshold, np.float32(np.inf))
        else:  # kth - window was rounded to the nearest float: one float lower keeps every tie
            cut[: self.q] = np.nextafter(self.threshold, np.float32(-np.inf))
        return cut

    def add(self, cols: np.ndarray, scores: np.ndarray, ids: np.ndarray) -> None:
        """Candidates that reached :meth:`cut`: query (column) ``cols``, ``scores``, gallery ``ids``."""
        if len(cols) == 0:
            return
        self._pending.append((cols, scores, ids))
        self._count += len(scores)
        if self._count > FLUSH * self.k * self.q or not self.settled:
            self._merge()

    def _take_top(self, ranked: tuple[torch.Tensor, torch.Tensor], start: int) -> bool:
        """The first block's exact top k (``ranked``: its k + 1 best values and rows, (k+1, Q) each,
        best first) become the running k best outright (no comparison pass), unless a query's
        (k+1)-th score equals its k-th: ties at the cut are then settled by id through the
        comparison path. Returns whether it took them."""
        values, rows = ranked
        if bool((values[-1] == values[-2]).any()):
            return False
        self.scores = np.ascontiguousarray(values[:-1].T.numpy())  # (Q, k)
        self.ids = np.ascontiguousarray(rows[:-1].T.numpy()) + start  # (Q, k)
        self.threshold = self.scores[:, -1].copy()  # the k-th best: what a later score must beat
        return True

    def _merge(self) -> None:
        if not self._pending:
            return
        rows = np.concatenate([p[0] for p in self._pending])
        scores = np.concatenate([p[1] for p in self._pending])
        ids = np.concatenate([p[2] for p in self._pending])
        self._pending, self._count = [], 0
        pad_s, pad_i = grouped_by_row(rows, scores, ids, self.q)
        self._keep(np.concatenate([self.scores, pad_s], 1), np.concatenate([self.ids, pad_i], 1))

    def _keep(self, scores: np.ndarray, ids: np.ndarray) -> None:
        """From (Q, n) ``scores`` / ``ids``, keep the k best per row, or all within the window."""
        n = scores.shape[1]
        if self.window is None:
            keep = best_columns(scores, ids, self.k)  # (Q, min(k, n))
            self.scores = np.take_along_axis(scores, keep, 1)
            self.ids = np.take_along_axis(ids, keep, 1)
            full = self.scores.shape[1] == self.k
            kth = self.scores.min(axis=1) if full else np.full(self.q, -np.inf, np.float32)
            self.threshold = np.maximum(kth, self._least)
            return
        if n < self.k:  # not k yet: keep everything
            self.scores, self.ids = scores, ids
            return
        kth = np.partition(scores, n - self.k, axis=1)[:, n - self.k]  # (Q,) the k-th best
        # -inf while a row has padding in its k
        self.threshold = np.maximum((kth - self.window).astype(np.float32), self._least)
        rows, cols = np.nonzero(scores >= self.threshold[:, None])
        self.scores, self.ids = grouped_by_row(rows, scores[rows, cols], ids[rows, cols], self.q)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """fp32: (scores, ids) best first, ties by id."""
        self._merge()
        order = np.lexsort((self.ids, -self.scores), axis=1)
        return np.take_along_axis(self.scores, order, 1), np.take_along_axis(self.ids, order, 1)

    def unsure(self) -> np.ndarray:
        """(Q,) bool: the queries whose floor may have cut off part of their answer (fewer than k
        found, or a window reaching below the floor): search them again without one. Otherwise
        every score not offered was below the floor, hence below the k-th best (or its window)."""
        self._merge()
        if self.floor is None:
            return np.zeros(self.q, bool)
        short: np.ndarray = (self.ids >= 0).sum(1) < self.k  # (Q,)
        width = self.ids.shape[1]
        if self.window is None or width < self.k:
            return short
        kth = np.partition(self.scores, width - self.k, axis=1)[:, width - self.k]  # (Q,)
        unsure: np.ndarray = short | ((kth - self.window).astype(np.float32) < self.floor)
        return unsure

    def candidates(self) -> np.ndarray:
        """bf16: (Q, W) the ids kept (-1 padding)."""
        self._merge()
        return self.ids


def top_rows(
    block: torch.Tensor, q: int, count: int, scan: ThresholdScan
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(block[:, :q], count, dim=0)`` (values, rows; (count, q) each, best first) of a
    long fp32 block (b, Q8), found among the entries that reach a cut taken from every SAMPLE-th
    row (one compiled comparison pass with ``scan``, then a top-k of about 2 ``count`` candidates a
    query): a top-k of 1,001 over the 64,000 rows of a depth-1,000 search's first block cost 27 of
    its 165 ms for 64 queries, and torch's top-k along the rows is slow at any count for 64 columns
    (17 ms for 96 of 62,500 rows). Falls back to the full top-k where the cut lets fewer than
    ``count`` through, and for more than SAMPLED_MAX (query, rank) pairs."""
    b = len(block)
    if block.dtype != torch.float32 or b < 2 * SAMPLE * count or q * count > SAMPLED_MAX:
        return torch.topk(block[:, :q], count, dim=0)
    sample = block[::SAMPLE, :q]  # (b / SAMPLE, Q)
    # about 2 count rows of the block are expected at or above the sample's r-th best
    rank = min(len(sample), 2 * -(-count // SAMPLE) + 8)
    cut = np.full(block.shape[1], np.inf, np.float32)  # (Q8,) padding columns pass nothing
    cut[:q] = torch.topk(sample, rank, dim=0).values[-1].numpy()
    rows, cols, scores = scan.reaching(block.numpy(), cut)
    if np.bincount(cols, minlength=q).min() < count:  # an unlucky sample: rank everything
        return torch.topk(block[:, :q], count, dim=0)
    pad_s, pad_r = grouped_by_row(cols, scores, rows, q)  # (Q, n) each
    values, at = torch.topk(torch.from_numpy(pad_s), count, dim=1)  # (Q, count) each
    return values.T, torch.from_numpy(np.take_along_axis(pad_r, at.numpy(), 1)).T


def grouped_by_row(
    rows: np.ndarray, scores: np.ndarray, ids: np.ndarray, q: int
) -> tuple[np.ndarray, np.ndarray]:
    """(Q, longest) scores / ids of (row, score, id) triples, grouped by row, -inf / -1 padded."""
    if len(rows) > 1 and np.any(rows[1:] < rows[:-1]):
        # numpy's stable sort is a radix sort for keys of 16 bits or less (int64: a merge sort,
        # 10x slower on the 25 million candidates of a 25,000-query evaluation's first blocks)
        key = rows.astype(np.uint16 if q <= 1 << 16 else np.int32)
        order = np.argsort(key, kind="stable")
        rows, scores, ids = rows[order], scores[order], ids[order]
    rows = rows.astype(np.int64, copy=False)
    counts = np.bincount(rows, minlength=q)  # (Q,)
    width = int(counts.max()) if len(rows) else 0
    # flat positions row * width + rank within the row: one scatter into each padded array
    flat = np.arange(len(rows)) + (rows * width - (np.cumsum(counts) - counts)[rows])
    pad_s = np.full(q * width, -np.inf, np.float32)
    pad_i = np.full(q * width, -1, np.int64)
    pad_s[flat], pad_i[flat] = scores, ids
    return pad_s.reshape(q, width), pad_i.reshape(q, width)


def best_columns(scores: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    """(Q, min(k, n)) column indices of the k best per row, ties at the k-th settled by lower id."""
    if scores.shape[1] <= k:
        return np.broadcast_to(np.arange(scores.shape[1]), scores.shape).copy()
    keep = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # the k best, any of several tied k-th
    kth = np.take_along_axis(scores, keep[:, k - 1 : k], 1)  # (Q, 1) the k-th best score
    tied = (scores == kth).sum(1) > (np.take_along_axis(scores, keep, 1) == kth).sum(1)
    for row in np.flatnonzero(tied):  # a tie crosses the cut: rare with float scores, settled exactly
        keep[row] = np.lexsort((ids[row], -scores[row]))[:k]
    return keep
