"""Compiled passes (numba) that keep only the scores reaching each query's cut.

The running top-k (:class:`icr.core.top_k.RunningTopK`) compares every score with its query's k-th
best so far; after the first blocks almost nothing passes. Two kernels do that comparison:

* :class:`ThresholdScan`: over a block of scores already computed (any scorer, e.g. a bf16 matmul or
  ``icr evaluate``'s distractor blocks). In torch the comparison was three passes and two
  temporaries (a bool mask, its rows' ``any``, ``nonzero`` and a gather): 1.03 ms per 65,536 x 16
  block against 0.37 ms here (2-core AMD EPYC, 2026-11-28).
* :class:`FusedScan`: the scores of fp32 gallery rows against the queries and their comparison in
  one pass, so no (b, Q) block is ever written or read back. Rows are scored in register tiles of
  4, 6 or 12 rows x 16 queries (:func:`tile_rows`, :mod:`icr.core.score_tiles`), each tile's scores
  compared while they are in L1, in parallel over every numba thread. On the 2-core AMD EPYC (Zen 3)
  host, paired against the previous compiled pass on 1M x 128 demo vectors
  (docs/results/2026-11-28-exact-tiles.md): 16 queries 30.5 against 39.4 ms, 64 queries 112.5
  against 147.6 ms, at k = 10. On a Zen 4 one, 64 queries in 12-row tiles of 16-lane vectors: 109.7
  against 138.9 ms in 6-row tiles (docs/results/2026-11-28-zen4-exact.md). Or of the bfloat16 bits
  of gallery rows in AVX512-BF16 tiles, where the CPU has them: 16 queries 20.3 ms against 30.8 in
  fp32 on that Zen 4 (docs/results/2026-11-28-bf16-tiles.md).

In both, a row's comparisons are or-ed without branches (the compiler vectorises them) and only a
row where something passed is read again, to write its (row, column, score) triples.

Compiled on first use and cached on disk (numba's cache beside this module, or the user's cache
directory where that is read-only): a later process loads both in about 0.6 s.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import njit, prange

from icr.core.score_tiles import (
    GROUP,
    bf16_bits,
    bf16_tiles,
    prefetch_rows,
    score_row,
    score_tile4,
    score_tile6,
    score_tile12w,
    wide_vectors,
)

_AHEAD = 64  # rows a fused pass asks for ahead of the tile it scores (32 KiB at D = 128)
# numba's thread pool may be its own "workqueue", which two threads must not enter at once: searches
# from several threads take turns (each uses every core anyway)
_POOL = threading.Lock()


@njit(inline="always", boundscheck=False)
def _emit_row(values, cut, i, rows, cols, scores, at, end):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Writes (i, j, values[j]) for each ``values[j] >= cut[j]`` at ``at`` on, while below ``end``;
    returns ``at`` plus their number (which may run past ``end``: the caller grows and retries)."""
    hit = False
    for j in range(len(values)):  # no early exit: the or-reduction vectorises
        hit |= values[j] >= cut[j]
    if hit:
        for j in range(len(values)):
            if values[j] >= cut[j]:
                if at < end:
                    rows[at], cols[at], scores[at] = i, j, values[j]
                at += 1
    return at


@njit(cache=True, nogil=True, boundscheck=False)
def _scan(
    block: np.ndarray,
    cut: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    scores: np.ndarray,
    counts: np.ndarray,
) -> None:  # pragma: no cover - compiled; exercised through ThresholdScan
    n = 0
    for i in range(block.shape[0]):
        n = _emit_row(block[i], cut, i, rows, cols, scores, n, len(rows))
    counts[0] = n


class _Triples:
    """The (row, column, score) output of a compiled pass: one slice of ``room`` entries per part,
    each part's count in ``counts`` (which may exceed ``room``: :meth:`grown` then makes room)."""

    def __init__(self, parts: int, room: int):
        self.counts = np.zeros(parts, np.int64)
        self._make(room)

    def _make(self, room: int) -> None:
        self.room = room
        self.rows = np.empty(room * len(self.counts), np.int64)
        self.cols = np.empty(room * len(self.counts), np.int64)
        self.scores = np.empty(room * len(self.counts), np.float32)

    def grown(self) -> bool:
        """Whether a part overflowed; if so, every slice now holds twice the largest count (the
        pass must run again)."""
        largest = int(self.counts.max())
        if largest <= self.room:
            return False
        self._make(2 * largest)
        return True

    def taken(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, cols, scores), fresh arrays: the parts' entries in part order."""
        spans = [slice(p * self.room, p * self.room + int(c)) for p, c in enumerate(self.counts)]
        rows, cols, scores = (
            np.concatenate([a[s] for s in spans]) for a in (self.rows, self.cols, self.scores)
        )
        return rows, cols, scores


class ThresholdScan:
    """Reusable output buffers for :meth:`reaching`, grown when a block passes more than they hold."""

    def __init__(self, capacity: int = 4096):
        self._out = _Triples(1, capacity)

    def reaching(self, block: np.ndarray, cut: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, cols, scores) of the entries of ``block`` (b, W) float32 with ``block[r, c] >=
        cut[c]``, row-major order; fresh arrays. ``cut`` (W,) float32: +inf passes nothing, and NaN
        scores never pass."""
        block = np.ascontiguousarray(block, dtype=np.float32)
        cut = np.ascontiguousarray(cut, dtype=np.float32)
        if block.ndim != 2 or cut.shape != (block.shape[1],):
            raise ValueError(f"need a (b, W) block and a (W,) cut, got {block.shape} and {cut.shape}")
        out = self._out
        _scan(block, cut, out.rows, out.cols, out.scores, out.counts)
        if out.grown():  # rare: the first blocks, or a cut still at -inf
            _scan(block, cut, out.rows, out.cols, out.scores, out.counts)
        return out.taken()


@njit(cache=True, nogil=True, parallel=True, boundscheck=False)
def _fused(
    x: np.ndarray,
    qt: np.ndarray,
    cut: np.ndarray,
    out: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    scores: np.ndarray,
    counts: np.ndarray,
    write: bool,
    step: int,
) -> None:  # pragma: no cover - compiled; exercised through FusedScan
    """Scores of x (n, D) against the queries qt (D, W), W = len(cut) a multiple of 16, in tiles of
    ``step`` rows (4, 6 or 12: :func:`tile_rows`); or of bfloat16 bits x (n, D) uint16 against query
    pairs qt (D / 2, 2 W) uint16 (:mod:`icr.core.score_tiles`). ``write``: every score of the first
    ``out.shape[1]`` queries into ``out`` (n, <= W); else the (row, column, score) triples reaching
    ``cut`` (W,) into part p's slice of ``rows`` / ``cols`` / ``scores``, and their number (which may
    exceed the slice) into counts[p]."""
    n = x.shape[0]
    width = len(cut)
    kept = out.shape[1]
    parts = len(counts)
    room = len(rows) // parts
    per = (n + parts - 1) // parts
    for p in prange(parts):
        lo, hi = p * per, min(n, (p + 1) * per)
        at, end = p * room, (p + 1) * room
        tile = np.empty((step, width), np.float32)  # (step, W) one tile's scores, in L1
        for i in range(lo, hi, step):
            m = min(step, hi - i)
            if m == step:
                # a batch of 16 reads each row once, for few flops: without the hint it waited on memory
                prefetch_rows(x, min(i + _AHEAD, n - step), step)
                for g in range(0, width, GROUP):
                    if step == 6:
                        score_tile6(x, i, qt, g, tile, 0)
                    elif step == 12:
                        score_tile12w(x, i, qt, g, tile, 0)
                    else:
                        score_tile4(x, i, qt, g, tile, 0)
            else:  # the part's last rows
                for r in range(m):
                    for g in range(0, width, GROUP):
                        score_row(x, i + r, qt, g, tile, r)
            for r in range(m):
                if write:
                    for j in range(kept):  # a loop: a slice assignment makes two array views per row
                        out[i + r, j] = tile[r, j]
                else:
                    at = _emit_row(tile[r], cut, i + r, rows, cols, scores, at, end)
        counts[p] = at - p * room


def tile_rows(width: int, bf16: bool = False) -> int:
    """Gallery rows per tile for ``width`` queries (a multiple of 16): 4 when one group of 16 must
    keep up with memory, else as many as the registers hold (the most flops per load): 12 rows of
    one 16-lane vector with AVX-512, 6 rows of two 8-lane vectors without. Each was the fastest
    measured for 16 / 64 queries on the 2-core AMD EPYC hosts (Zen 3: 4 rows 27.0 ms against 30.8
    for 6 at 16 queries, 6 rows 105.1 against 111.2 at 64; Zen 4 at 64 queries: 12 rows 106.6-110.5
    ms, 6 rows 136.2-141.6, 4 rows 151.6-156.1). bf16 tiles: 6 rows for any width (Zen 4, whole
    searches at k = 10: 16 queries 19.2 ms against 20.3 for 4 rows and 21.5 for 12; 64 queries
    61.1 against 66.2 and 65.2)."""
    if bf16:
        return 6
    if width <= GROUP:
        return 4
    return 12 if wide_vectors() else 6


class FusedScan:
    """Exact fp32 scores of gallery blocks against fixed queries (Q, D), and the entries reaching a
    cut, found while scoring: nothing of size (b, Q) is written but the triples. Uses every numba
    thread; output buffers are reused and grown as needed.

    ``bf16``: the blocks are the bfloat16 bits of gallery rows ((b, D) uint16, D even) and the
    queries are rounded to bfloat16 too; each score is then the fp32 sum of exact products of the
    rounded values (:mod:`icr.core.score_tiles`; only where :func:`bf16_tiles`)."""

    def __init__(self, queries: np.ndarray, capacity: int = 4096, bf16: bool = False):
        if queries.ndim != 2 or len(queries) == 0:
            raise ValueError(f"need (Q, D) queries with Q >= 1, got {queries.shape}")
        if bf16 and not (bf16_tiles() and queries.shape[1] % 2 == 0):
            raise ValueError("bfloat16 tiles need AVX512-BF16 and an even dimension")
        self.queries = np.ascontiguousarray(queries, dtype=np.float32)  # (Q, D)
        # the tiles read the queries transposed, zero columns up to a multiple of 16
        width = -(-len(queries) // GROUP) * GROUP
        qt = np.zeros((queries.shape[1], width), np.float32)  # (D, W)
        qt[:, : len(queries)] = self.queries.T
        self._dtype = np.uint16 if bf16 else np.float32
        self._qt = qt
        if bf16:  # each query's two values of a pair of dimensions side by side, (D / 2, 2 W)
            self._qt = bf16_bits(qt.reshape(-1, 2, width).transpose(0, 2, 1)).reshape(-1, 2 * width)
        self._cut = np.full(width, np.inf, np.float32)  # (W,) the padding columns pass nothing
        self._out = _Triples(numba.get_num_threads(), capacity)  # one part per thread
        self._none = np.empty((0, 0), np.float32)
        self._step = tile_rows(width, bf16)

    def scores(self, block: np.ndarray, out: np.ndarray) -> np.ndarray:
        """(b, Q) every score of ``block`` (b, D) float32 (bf16: uint16 bits), written into ``out``
        (>= b rows)."""
        if out.shape[0] < len(block) or out.shape[1:] != (len(self.queries),) or out.dtype != np.float32:
            raise ValueError(
                f"need a ({len(block)}, {len(self.queries)}) float32 output, got {out.dtype} {out.shape}"
            )
        out = out[: len(block)]
        self._run(block, out, True)
        return out

    def _run(self, block: np.ndarray, out: np.ndarray, write: bool) -> None:
        block = np.ascontiguousarray(block, dtype=self._dtype)  # (b, D) no copy for a gallery's rows
        t = self._out
        with _POOL:
            _fused(block, self._qt, self._cut, out, t.rows, t.cols, t.scores, t.counts, write, self._step)

    def reaching(self, block: np.ndarray, cut: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, cols, scores) of the entries of ``block`` @ queries.T with ``score >= cut[col]``
        (``cut`` (Q,) float32; +inf passes nothing), rows ascending within each column's hits."""
        width, dim = self.queries.shape
        if np.shape(cut) != (width,) or block.ndim != 2 or block.shape[1] != dim:
            raise ValueError(f"need a (b, {dim}) block and a ({width},) cut")
        self._cut[:width] = cut
        self._run(block, self._none, False)
        if self._out.grown():  # rare: a cut still far below the k-th best
            self._run(block, self._none, False)
        return self._out.taken()
