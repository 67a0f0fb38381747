"""Exact top-k inner-product search of a batch of queries in one pass over the gallery.

faiss-cpu's flat search scans the gallery once per query below 20 queries and multiplies 1,024-row
blocks above, so a batch of 16 or 64 cost 9.5x / 8.1x the matmul floor (icr bench, 2026-11-21) and
micro-batching brought no throughput. Here a batch reads the gallery once, in large blocks, each
one matrix multiply (torch, i.e. MKL / oneDNN); the running top-k of each query is kept beside a
threshold, and a block's scores are only looked at where they reach it. After the first blocks that
is rare, so the pass costs about one matrix multiply over the gallery.

Two precisions of that scan, the same answer:

* ``fp32``: the scores are the answer. A candidate must beat the query's k-th best so far.
* ``bf16``: the scan multiplies a bfloat16 copy of the gallery (half the bytes; on CPUs with AMX,
  e.g. Sapphire Rapids, 3-5x faster than fp32 at batches of 16-64) and keeps every id whose bf16
  score is within ``2 eps`` of the k-th best bf16 score, where ``eps`` bounds the bf16 error of one
  score (inputs and output rounded to 8 significant bits, fp32 accumulation:
  ``(3u + 4u^2) |q| max|x|`` with ``u = 2^-8``, plus the fp32 sum's own error). Every true top-k id is
  then among the kept ones, which are rescored from the fp32 vectors: exact, at the price of the
  bf16 copy (half the fp32 gallery's memory) and the rescoring of a few candidates per hit.

Order: best first, ties by lower id (as :func:`index.vector_index.rescored` orders hits). Blocks are
visited in id order, so in ``fp32`` a later score equal to the current k-th can never displace it:
only strictly greater scores are candidates.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np
import torch

BLOCK = 65_536  # gallery rows per multiply: 32 MiB at dim 128 in fp32
FLUSH = 1  # pending candidates are merged (tightening the thresholds) past FLUSH x k x Q
BF16_UNIT = 2.0**-8  # bfloat16 keeps 8 significant bits: relative rounding error <= 2^-8
Precision = Literal["fp32", "bf16"]


class ExactKernel:
    """Exact search over ``matrix`` (N, D) float32 (a view is kept, not a copy; ``bf16`` adds a
    bfloat16 copy of half its size)."""

    def __init__(self, matrix: np.ndarray, precision: Precision = "fp32", block: int = BLOCK):
        if matrix.ndim != 2 or matrix.dtype != np.float32:
            raise ValueError(f"need an (N, D) float32 matrix, got {matrix.dtype} {matrix.shape}")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
        self.matrix = matrix
        self.precision = precision
        self.block = block
        self._fp32 = torch.from_numpy(matrix)  # (N, D) shares the memory
        self._scan = self._fp32.to(torch.bfloat16) if precision == "bf16" else self._fp32
        norms = np.linalg.norm(matrix, axis=1) if len(matrix) else np.zeros(1, np.float32)
        self._max_norm = float(norms.max())

    @property
    def ntotal(self) -> int:
        return int(self.matrix.shape[0])

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores (Q, k'), ids (Q, k')) with k' = min(k, N), best first, ties by id."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)  # (Q, D)
        if queries.ndim != 2 or queries.shape[1] != self.matrix.shape[1]:
            raise ValueError(f"queries must be (Q, {self.matrix.shape[1]}), got {queries.shape}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        k = min(k, self.ntotal)
        if k == 0:
            empty = np.zeros((len(queries), 0))
            return empty.astype(np.float32), empty.astype(np.int64)
        window = None if self.precision == "fp32" else 2 * self.error_bound(queries)
        top = _TopK(len(queries), k, window)
        with torch.inference_mode():
            for start, scores in self.score_blocks(queries):
                top.offer(scores, start)  # (b, Q8)
        if window is None:
            return top.result()
        return self._rescored(queries, top.candidates(), k)

    def score_blocks(self, queries: np.ndarray) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, (b, Q8) scores) of each gallery block against (Q, D) float32 ``queries``, in
        the scan's precision: what :meth:`search` selects from (and what ``icr bench`` times alone).
        Zero queries pad Q to a multiple of 8 (one query stays one). Every block's scores share one
        buffer: use them before asking for the next block."""
        # zero queries up to a multiple of 8 (their cut is +inf): a (b, 8m) bool mask then reads as
        # int64 words, and "does this gallery row beat any query's cut" is one cheap pass
        padded = np.zeros(
            (-(-len(queries) // 8) * 8 if len(queries) > 1 else 1, queries.shape[1]), np.float32
        )
        padded[: len(queries)] = queries
        q = torch.from_numpy(padded).to(self._scan.dtype)  # (Q8, D)
        # one output buffer for every block: a fresh 8 MiB tensor per block costs its page faults
        out = torch.empty((min(self.block, self.ntotal), len(padded)), dtype=self._scan.dtype)  # (b, Q8)
        for start in range(0, self.ntotal, self.block):
            rows = self._scan[start : start + self.block]  # (b, D)
            # gallery-major (b, D) @ (D, Q) runs faster than (Q, D) @ (D, b) in MKL and oneDNN
            yield start, torch.mm(rows, q.T, out=out[: len(rows)])  # (b, Q8)

    def error_bound(self, queries: np.ndarray) -> np.ndarray:
        """(Q,) bound on |bf16 score - fp32 score| of each query against any gallery vector."""
        u, d = BF16_UNIT, queries.shape[1]
        scale = np.linalg.norm(queries, axis=1) * self._max_norm  # (Q,) >= sum |q_i x_i|
        bound: np.ndarray = ((3 * u + 4 * u * u + d * 2.0**-23) * scale).astype(np.float32)
        return bound

    def _rescored(self, queries: np.ndarray, candidates: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k best of ``candidates`` (Q, W) ids (-1: padding) by their fp32 scores, ties by id."""
        safe = torch.from_numpy(np.where(candidates >= 0, candidates, 0))  # (Q, W)
        with torch.inference_mode():
            # index_select, not self._fp32[ids]: advanced indexing gathers ~6x slower
            vectors = torch.index_select(self._fp32, 0, safe.flatten()).view(*safe.shape, -1)  # (Q, W, D)
            scores = torch.bmm(vectors, torch.from_numpy(queries)[:, :, None])[:, :, 0].numpy()  # (Q, W)
        scores[candidates < 0] = -np.inf
        keep = _best(scores, candidates, k)
        scores, ids = np.take_along_axis(scores, keep, 1), np.take_along_axis(candidates, keep, 1)
        order = np.lexsort((ids, -scores), axis=1)
        return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)


def kernel_for(index: Any, precision: Precision | Literal["auto"] = "auto") -> ExactKernel | None:
    """The kernel over a CPU inner-product flat index's own vectors (no fp32 copy), else None;
    ``auto``: the bf16 scan where the CPU multiplies bf16 natively (:func:`bf16_is_native`)."""
    flat: Any = faiss.downcast_index(index)  # the stubs know only the base class
    if (
        type(flat) not in (faiss.IndexFlat, faiss.IndexFlatIP)
        or flat.metric_type != faiss.METRIC_INNER_PRODUCT
    ):
        return None
    if flat.ntotal == 0:
        return None
    matrix = faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d)
    if precision == "auto":
        precision = "bf16" if bf16_is_native() else "fp32"
    return ExactKernel(matrix, precision)


def bf16_is_native() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX or AVX512-BF16; Linux flags): the
    ``bf16`` scan is then the faster one. Elsewhere torch emulates it, slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


class _TopK:
    """Per query, the k best (score, id) seen so far (``window`` None), or every one within
    ``window`` (Q,) of the k-th best; unordered, -inf / -1 padded. ``threshold`` (Q,): what a new
    score must beat (fp32) or reach (with a window)."""

    def __init__(self, q: int, k: int, window: np.ndarray | None):
        self.q, self.k, self.window = q, k, window
        self.scores = np.full((q, 0), -np.inf, np.float32)
        self.ids = np.full((q, 0), -1, np.int64)
        self.threshold = np.full(q, -np.inf, np.float32)
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (rows, scores, ids)
        self._count = 0

    def offer(self, block: torch.Tensor, start: int) -> None:
        """Consider ``block`` (b, Q8), the scores of ids start .. start + b - 1 for the queries
        padded to a multiple of 8 (columns past Q are ignored): one comparison pass over it, in
        its own dtype, against each query's threshold, then only the rows where something passed."""
        window = self.window is not None
        if not np.isfinite(self.threshold).all() and len(block) >= self.k:
            # a row still short of k hits: this block's own k-th best is a valid provisional cut
            kth = torch.topk(block[:, : self.q], self.k, dim=0).values[-1].float().numpy()  # (Q,)
            unset = ~np.isfinite(self.threshold)
            # fp32 compares strictly, so the k-th's ties must pass this first cut: one float below
            provisional = kth - self.window if window else np.nextafter(kth, -np.inf)
            self.threshold[unset] = provisional[unset]
        cut = torch.full((block.shape[1],), np.inf)
        cut[: self.q] = torch.from_numpy(self.threshold)  # (Q8,) the padding never passes
        if block.dtype == torch.bfloat16:
            # rounded to bf16 at most half a bf16 step (|t| 2^-8) up: lowered by a full step first
            cut = (cut - cut.abs() * 2.0**-7 - 1e-30).bfloat16()
        passed = block >= cut if window else block > cut  # (b, Q8) bool
        words = passed.view(torch.int64) if passed.shape[1] % 8 == 0 else passed  # 8 queries a word
        rows = torch.nonzero(words.ne(0).any(dim=1)).flatten()
        if len(rows) == 0:
            return
        r, c = torch.nonzero(passed[rows], as_tuple=True)
        scores = block[rows[r], c].float().numpy()
        self._pending.append((c.numpy(), scores, rows[r].numpy().astype(np.int64) + start))
        self._count += len(scores)
        if self._count > FLUSH * self.k * self.q or not np.isfinite(self.threshold).all():
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        rows = np.concatenate([p[0] for p in self._pending])
        scores = np.concatenate([p[1] for p in self._pending])
        ids = np.concatenate([p[2] for p in self._pending])
        self._pending, self._count = [], 0
        pad_s, pad_i = _padded(rows, scores, ids, self.q)
        self._keep(np.concatenate([self.scores, pad_s], 1), np.concatenate([self.ids, pad_i], 1))

    def _keep(self, scores: np.ndarray, ids: np.ndarray) -> None:
        """From (Q, n) ``scores`` / ``ids``, keep the k best per row, or all within the window."""
        n = scores.shape[1]
        if self.window is None:
            keep = _best(scores, ids, self.k)  # (Q, min(k, n))
            self.scores = np.take_along_axis(scores, keep, 1)
            self.ids = np.take_along_axis(ids, keep, 1)
            full = self.scores.shape[1] == self.k
            self.threshold = self.scores.min(axis=1) if full else np.full(self.q, -np.inf, np.float32)
            return
        if n < self.k:  # not k yet: keep everything
            self.scores, self.ids = scores, ids
            return
        kth = np.partition(scores, n - self.k, axis=1)[:, n - self.k]  # (Q,) the k-th best
        self.threshold = (kth - self.window).astype(np.float32)  # -inf while a row has padding in its k
        rows, cols = np.nonzero(scores >= self.threshold[:, None])
        self.scores, self.ids = _padded(rows, scores[rows, cols], ids[rows, cols], self.q)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """fp32: (scores, ids) best first, ties by id."""
        self._merge()
        order = np.lexsort((self.ids, -self.scores), axis=1)
        return np.take_along_axis(self.scores, order, 1), np.take_along_axis(self.ids, order, 1)

    def candidates(self) -> np.ndarray:
        """bf16: (Q, W) the ids kept (-1 padding)."""
        self._merge()
        return self.ids


def _padded(rows: np.ndarray, scores: np.ndarray, ids: np.ndarray, q: int) -> tuple[np.ndarray, np.ndarray]:
    """(Q, longest) scores / ids of (row, score, id) triples, grouped by row, -inf / -1 padded."""
    if len(rows) > 1 and np.any(rows[1:] < rows[:-1]):
        order = np.argsort(rows, kind="stable")  # a radix sort for integers
        rows, scores, ids = rows[order], scores[order], ids[order]
    counts = np.bincount(rows, minlength=q)  # (Q,)
    position = np.arange(len(rows)) - (np.cumsum(counts) - counts)[rows]
    pad_s = np.full((q, int(counts.max()) if len(rows) else 0), -np.inf, np.float32)
    pad_i = np.full(pad_s.shape, -1, np.int64)
    pad_s[rows, position], pad_i[rows, position] = scores, ids
    return pad_s, pad_i


def _best(scores: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    """(Q, min(k, n)) column indices of the k best per row, ties at the k-th settled by lower id."""
    if scores.shape[1] <= k:
        return np.broadcast_to(np.arange(scores.shape[1]), scores.shape).copy()
    keep = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # the k best, any of several tied k-th
    kth = np.take_along_axis(scores, keep[:, k - 1 : k], 1)  # (Q, 1) the k-th best score
    tied = (scores == kth).sum(1) > (np.take_along_axis(scores, keep, 1) == kth).sum(1)
    for row in np.flatnonzero(tied):  # a tie crosses the cut: rare with float scores, settled exactly
        keep[row] = np.lexsort((ids[row], -scores[row]))[:k]
    return keep
