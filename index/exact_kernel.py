"""Exact top-k inner-product search of a batch of queries in one pass over the gallery.

faiss-cpu's flat search scans the gallery once per query below 20 queries and multiplies 1,024-row
blocks above, so a batch of 16 or 64 cost 9.5x / 8.1x the matmul floor (icr bench, 2026-11-21) and
micro-batching brought no throughput. Here a batch reads the gallery once, in large blocks; the
running top-k of each query is kept beside a threshold, and a block's scores are only looked at
where they reach it. After the first blocks that is rare, so the pass costs about one matrix
multiply over the gallery.

In fp32 the scoring and the comparison are one compiled pass
(:class:`icr.core.threshold_scan.FusedScan`, register tiles of :mod:`icr.core.score_tiles`): no
block of scores is written, and on a 2-core AMD EPYC it scored at 1.2-1.4x a large square sgemm's
time per flop, where torch's MKL matmul of the same skinny shape took about 3x. Only the first
blocks, while some query has fewer than k candidates, are scored in full and offered to the running
top-k. Each fp32 score is summed in dimension order, unlike a BLAS's, so it may differ from FAISS's
flat search in the last bits (at most 6.1e-7 from a float64 product over the top 1,000 of 64
captions on 1M demo-model vectors, with the same 1,000 ids), and two hits that close may swap.

A deep search (k >= 256) does not wait for the first block to set the thresholds: it starts from a
cut read off every 16th gallery row (:meth:`ExactKernel._sample_floor`), near the gallery's 1.5 k-th
best score instead of the first block's k-th best (near the gallery's 16 k-th at 1M), so fewer
candidates pass and are merged. A query whose sample cut came out above part of its answer (too few
candidates reached it) is searched again without one: the answer is always exact, only its time
depends on the sample.

Two precisions of that scan, the same answer:

* ``fp32``: the scores are the answer. A candidate must beat the query's k-th best so far.
* ``bf16``: the scan reads a bfloat16 copy of the gallery (half the bytes) and keeps every id whose
  bf16 score is within ``2 eps`` of the k-th best bf16 score, where ``eps`` bounds the bf16 error of
  one score (:meth:`ExactKernel.error_bound`, ``u = 2^-8``: inputs rounded to 8 significant bits,
  ``(2u + u^2) |q| max|x|``, plus the fp32 sum's own error; ``3u + 4u^2`` where the scores are
  rounded too). Every true top-k id is then among the kept ones, which are rescored from the fp32
  vectors (:func:`icr.core.rescore.rescored_rows`): exact, at the price of the bf16 copy (half the
  fp32 gallery's memory) and the rescoring. Where numba compiles for AVX512-BF16 (Zen 4, Sapphire
  Rapids and later) and D is even, the scan is the fused pass in bfloat16 tiles (``vdpbf16ps``,
  :mod:`icr.core.score_tiles`; scores not rounded): on a 2-core Zen 4 EPYC, 16 queries took 20.3 ms
  at k = 10 against 30.8 in fp32 and 36.2 through torch (docs/results/2026-11-28-bf16-tiles.md).
  Elsewhere torch multiplies (oneDNN; on CPUs with AMX reported 3-5x faster than fp32, not measured
  here) and :class:`~icr.core.threshold_scan.ThresholdScan` compares its block of bf16 scores.
  Through torch, searches deeper than :data:`BF16_MAX_K` take the ``fp32`` pass
  (:meth:`ExactKernel.precision_for`): there the candidates cost more than that scan saves.

One query is scored by a matrix-vector product over the fp32 vectors, whatever the precision:
numpy's BLAS, whose product of the gallery with one vector is what ``icr bench`` measures the
bandwidth floor with (a bf16 scan of one column was never measured to beat it); it is selected in
numpy (:meth:`ExactKernel._search_one`).

Order: best first, ties by lower id (as :func:`index.vector_index.rescored` orders hits). Blocks are
visited in id order, so in ``fp32`` a later score equal to the current k-th can never displace it:
only strictly greater scores are candidates.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import faiss
import numba
import numpy as np
import torch

from icr.core.rescore import rescored_rows
from icr.core.score_tiles import bf16_tiles
from icr.core.threshold_scan import FusedScan, ThresholdScan
from icr.core.top_k import RunningTopK, best_columns, padded_queries, top_rows

BLOCK = 65_536  # gallery rows per multiply: 32 MiB at dim 128 in fp32
# rows of a fused search's first block (at least 64 k, so its thresholds are tight enough for the next
# blocks to pass little): scored in full, then ranked
FIRST_BLOCK = 8_192
# a deep search starts from a cut read off every SAMPLE_STRIDE-th row (:meth:`ExactKernel._sample_floor`;
# 1/16 of the gallery scored twice, a copy of 1/16 of it kept), where the sample is expected to hold at
# least SAMPLE_MIN_EXPECTED of a query's top k: k >= 256
SAMPLE_STRIDE = 16
SAMPLE_MIN_EXPECTED = 16
BF16_UNIT = 2.0**-8  # bfloat16 keeps 8 significant bits: relative rounding error <= 2^-8
# Deepest search torch's bf16 scan takes: deeper, its candidate window (about 1.8 k ids a query at
# k = 1,000) costs more to keep and rescore than the scan saves (the selection does not use bf16).
# 2-core AMD EPYC with AVX512-BF16 (Zen 4), 1M x 128 demo vectors, 2026-11-28, bf16 (torch) / fp32
# ms: 16 queries 38 / 46 at k = 10, 45 / 51 at k = 300, 75 / 61 at k = 1,000; 64 queries 74 / 125,
# 138 / 158, 212 / 165 (docs/results/2026-11-28-zen4-exact.md)
BF16_MAX_K = 300
# With the compiled bf16 tiles (and the sampled cut and compiled rescoring) the bf16 scan wins at every
# depth measured: same host, tiles / fp32 ms, 64 queries 97.7 / 126.4 at k = 1,000, 128 queries 189.0 /
# 226.9, 16 queries 52.1 / 69.6 at k = 4,000 (docs/results/2026-11-28-bf16-tiles.md)
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
        fp32 = torch.from_numpy(matrix)  # (N, D) shares the memory
        self._scan = fp32.to(torch.bfloat16) if precision == "bf16" else fp32
        # the bf16 copy's bits, for the compiled bf16 tiles where the CPU has them (else torch multiplies)
        self._bits = (
            self._scan.view(torch.int16).numpy().view(np.uint16)  # (N, D) the same memory
            if precision == "bf16" and bf16_tiles() and matrix.shape[1] % 2 == 0
            else None
        )
        self._sample: np.ndarray | None = None  # every 16th row the fused pass scans, made when first used
        norms = np.linalg.norm(matrix, axis=1) if len(matrix) else np.zeros(1, np.float32)
        self._max_norm = float(norms.max())

    @property
    def ntotal(self) -> int:
        return int(self.matrix.shape[0])

    @property
    def _fused_rows(self) -> np.ndarray:
        """(N, D) what the fused pass scans: the bf16 bits with the tiles, else the fp32 vectors."""
        return self.matrix if self._bits is None else self._bits

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
        if len(queries) == 1:  # either precision: the fp32 scan of one query is bound by the read
            return self._search_one(queries[0], k)
        if self.precision_for(k) == "fp32" or self._bits is not None:
            return self._search_fused(queries, k)
        top = RunningTopK(len(queries), k, 2 * self.error_bound(queries))
        with torch.inference_mode():
            for start, scores in self.score_blocks(queries):
                top.offer(scores, start)  # (b, Q8)
        return self._rescored(queries, top.candidates(), k)

    def precision_for(self, k: int) -> Precision:
        """The scan a batch search at depth ``k`` takes: a bf16 kernel's at any depth with the
        compiled bf16 tiles, through torch only up to BF16_MAX_K."""
        if self.precision == "bf16" and (k <= BF16_MAX_K or self._bits is not None):
            return "bf16"
        return "fp32"

    def warm(self) -> None:
        """Compiles the batch pass now (or loads it from numba's cache), on a few rows, so that the
        first batch a server answers does not wait for it: the bench's first 4-client exact round
        once had a p99 of 4.6 s, when an edited module had to be compiled again. Also the bf16
        rescoring, the fp32 pass that deep searches through torch's bf16 scan take, and the deep
        searches' sample of the gallery."""
        if self.ntotal >= 2:
            rows = self.matrix[:64]  # (<= 64, D)
            small = ExactKernel(rows, self.precision)
            small.search(rows[:2], 1)
            if small.precision_for(BF16_MAX_K + 1) != small.precision:  # torch's bf16 scan
                small._search_fused(rows[:2], 1)
        if self.ntotal >= 2 * self.block:
            self._sample_rows()  # the rows the deep searches' cut is read off

    def _search_fused(
        self, queries: np.ndarray, k: int, sampled: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` of several queries: each block scored and compared with the running k-th
        bests in one compiled pass (:class:`icr.core.threshold_scan.FusedScan`); only the first
        blocks, while some query has fewer than k candidates, are scored in full and offered.
        With the bf16 tiles it scans the bf16 copy's bits instead of the fp32 vectors: every id within
        ``2 eps`` of a query's k-th best is kept and rescored in fp32.
        A deep search (``sampled``) starts from a cut read off a sample of the gallery
        (:meth:`_sample_floor`); the rare query it cut too high is searched again without one."""
        padded = padded_queries(queries)  # (Q8, D)
        # the block after the first passes about k per query: room for twice that, so the pass
        # seldom runs a block again for want of room
        parts = numba.get_num_threads()
        capacity = min(1 << 18, max(4096, 2 * len(queries) * k // parts))
        bf16 = self._bits is not None
        scan = FusedScan(padded, capacity, bf16=bf16)
        window = 2 * self.error_bound(queries, rounded_scores=False) if bf16 else None
        floor = self._sample_floor(scan, queries, k, window) if sampled else None
        top = RunningTopK(len(queries), k, window, floor)
        # a short first block: scored in full and ranked by torch, it sets every threshold
        first = min(self.block, max(FIRST_BLOCK, 64 * k))
        out = np.empty((0, len(padded)), np.float32)  # (b, Q8) allocated at the first full scoring
        with torch.inference_mode():
            for start in [0, *range(first, self.ntotal, self.block)]:
                rows = self._fused_rows[start : start + (first if start == 0 else self.block)]  # (b, D)
                if top.settled:
                    r, c, s = scan.reaching(rows, top.cut(len(padded)))
                    top.add(c, s, r + start)
                else:  # the first block, or a later one while a threshold is unset (NaN scores)
                    if len(out) < len(rows):
                        out = np.empty((len(rows), len(padded)), np.float32)
                    top.offer(torch.from_numpy(scan.scores(rows, out)), start)
        scores, ids = self._rescored(queries, top.candidates(), k) if bf16 else top.result()
        again = np.flatnonzero(top.unsure())
        if len(again):  # the sample's cut was above part of these queries' answers
            if scores.shape[1] < k:  # every query found fewer than k: room for the answers
                scores = np.pad(scores, ((0, 0), (0, k - scores.shape[1])), constant_values=-np.inf)
                ids = np.pad(ids, ((0, 0), (0, k - ids.shape[1])), constant_values=-1)
            scores[again], ids[again] = self._search_fused(queries[again], k, sampled=False)
        return scores, ids

    def _sample_floor(
        self, scan: FusedScan, queries: np.ndarray, k: int, window: np.ndarray | None
    ) -> np.ndarray | None:
        """(Q,) a cut below each query's k-th best score (less its window) but for rare chance, or
        None (a shallow search, a small gallery): the r-th best score over every SAMPLE_STRIDE-th
        gallery row, where r is the expected number of sampled rows in the true top k plus four
        standard deviations (Poisson) plus one. The first block's k-th best, the cut otherwise,
        sits near the gallery's (k N / first block)-th best and lets through ten times as many."""
        expected = k / SAMPLE_STRIDE  # of the sampled rows in a query's top k
        if expected < SAMPLE_MIN_EXPECTED or self.ntotal < 2 * self.block:
            return None
        sample = self._sample_rows()
        rank = min(len(sample), int(np.ceil(expected + 4 * np.sqrt(expected) + 1)))
        out = np.empty((len(sample), scan.queries.shape[0]), np.float32)  # (m, Q8)
        scored = torch.from_numpy(scan.scores(sample, out))  # (m, Q8)
        floor = top_rows(scored, len(queries), rank, ThresholdScan())[0][-1].numpy()  # (Q,)
        return floor if window is None else (floor - window).astype(np.float32)

    def _sample_rows(self) -> np.ndarray:
        """Every SAMPLE_STRIDE-th row the fused pass scans (fp32, or the bf16 bits), a contiguous copy
        kept."""
        if self._sample is None:
            self._sample = np.ascontiguousarray(self._fused_rows[::SAMPLE_STRIDE])  # (N / SAMPLE_STRIDE, D)
        return self._sample

    def score_blocks(self, queries: np.ndarray) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, (b, Q8) scores) of each gallery block against (Q, D) float32 ``queries``, in
        the scan's precision (one query: fp32, :meth:`_gemv_blocks`): what :meth:`search` selects
        from (and what ``icr bench`` times alone).
        Zero queries pad Q to a multiple of 8 (one query stays one). Every block's scores share one
        buffer: use them before asking for the next block."""
        padded = padded_queries(queries)
        if len(padded) == 1:
            for start, scores in self._gemv_blocks(padded[0]):
                yield start, torch.from_numpy(scores)[:, None]  # (b, 1) the same memory
            return
        if self.precision == "fp32" or self._bits is not None:  # the fused pass's scoring alone
            scan = FusedScan(padded, bf16=self._bits is not None)
            buffer = np.empty((min(self.block, self.ntotal), len(padded)), np.float32)  # (b, Q8)
            for start in range(0, self.ntotal, self.block):
                block = self._fused_rows[start : start + self.block]  # (b, D)
                yield start, torch.from_numpy(scan.scores(block, buffer))
            return
        q = torch.from_numpy(padded).to(self._scan.dtype)  # (Q8, D)
        # one output buffer for every block: a fresh 8 MiB tensor per block costs its page faults
        out = torch.empty((min(self.block, self.ntotal), len(padded)), dtype=self._scan.dtype)  # (b, Q8)
        for start in range(0, self.ntotal, self.block):
            rows = self._scan[start : start + self.block]  # (b, D)
            # gallery-major (b, D) @ (D, Q) runs faster than (Q, D) @ (D, b) in MKL and oneDNN
            yield start, torch.mm(rows, q.T, out=out[: len(rows)])  # (b, Q8)

    def _gemv_blocks(self, query: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, (b,) scores) of each block against one fp32 ``query`` (D,): a matrix-vector
        product in numpy's BLAS, the product the all-core bandwidth floor is measured with; torch's
        mm / mv of one column took 2.5x as long (1M x 128, 2-core AMD EPYC, 2026-11-27: 58-62 ms
        against 23.7). One buffer for every block, as in :meth:`score_blocks`."""
        out = np.empty(min(self.block, self.ntotal), np.float32)  # (b,)
        for start in range(0, self.ntotal, self.block):
            rows = self.matrix[start : start + self.block]  # (b, D)
            yield start, np.matmul(rows, query, out=out[: len(rows)])  # (b,)

    def _search_one(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` of one query (scored in fp32), selected in numpy: a torch operation
        between two BLAS calls wakes torch's thread pool while BLAS's threads still spin, and on two
        cores the pair took 5-7x the scan alone. The running top k is merged whenever a block passes
        anything; after the first blocks almost nothing does. A later score equal to the k-th best
        never displaces it (blocks come in id order), so ties stay with the lower id."""
        best_s, best_i = np.empty(0, np.float32), np.empty(0, np.int64)
        cut = -np.inf  # the k-th best so far, once there are k
        for start, scores in self._gemv_blocks(query):
            hits = np.flatnonzero(scores > cut)  # (h,) rows of this block
            if len(hits) == 0:
                continue
            s = np.concatenate([best_s, scores[hits]])
            i = np.concatenate([best_i, hits + start])
            keep = best_columns(s[None], i[None], k)[0]
            best_s, best_i = s[keep], i[keep]
            if len(best_s) == k:
                cut = float(best_s.min())
        order = np.lexsort((best_i, -best_s))
        return best_s[order][None], best_i[order][None]

    def error_bound(self, queries: np.ndarray, rounded_scores: bool = True) -> np.ndarray:
        """(Q,) bound on |bf16 score - fp32 score| of each query against any gallery vector.
        ``rounded_scores``: the scores themselves are rounded to bf16 (torch's bf16 matmul); not
        so from the compiled tiles, which sum exact products of the rounded inputs in fp32 but
        read and write denormals as zero (at most 2^-126 (1 + |q_i|) a dimension)."""
        u, d = BF16_UNIT, queries.shape[1]
        norms = np.linalg.norm(queries, axis=1)  # (Q,)
        scale = norms * self._max_norm  # (Q,) >= sum |q_i x_i|
        if rounded_scores:
            relative = 3 * u + 4 * u * u  # both inputs and the output rounded
        else:
            relative = 2 * u + u * u  # (1 + u)^2 - 1: both inputs rounded
        bound = (relative + d * 2.0**-23) * scale + (0.0 if rounded_scores else d * 2.0**-126 * (1 + norms))
        return np.asarray(bound, dtype=np.float32)

    def _rescored(self, queries: np.ndarray, candidates: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k best of ``candidates`` (Q, W) ids (-1: padding) by their fp32 scores, ties by id."""
        scores = rescored_rows(self.matrix, queries, candidates)  # (Q, W) -inf at the padding
        keep = best_columns(scores, candidates, k)
        scores, ids = np.take_along_axis(scores, keep, 1), np.take_along_axis(candidates, keep, 1)
        order = np.lexsort((ids, -scores), axis=1)
        return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)


def kernel_for(index: Any, precision: Precision | Literal["auto"] = "auto") -> ExactKernel | None:
    """The kernel over a CPU inner-product flat index's own vectors (no fp32 copy), else None;
    ``auto``: the bf16 scan where the CPU multiplies bf16 natively (:func:`bf16_is_native`)."""
    if not isinstance(index, faiss.Index):  # e.g. codes re-ranked from raw vectors (index/rerank.py)
        return None
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
