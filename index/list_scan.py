"""A compiled scan of 8-bit scalar codes in inverted lists: the candidate stage of
``IVF<k>,SQ8,RFlat`` (index/rerank.py) for searches without a filter.

FAISS scans an ``IndexIVFScalarQuantizer``'s lists one code at a time through a heap; with one thread
at the service's depth (1,000 candidates from ~35,000 codes at 1M) that took 1.95 ms per query on
the 2-core AMD EPYC host, where this scan's whole search, re-ranking included, took about 1.3 ms
(docs/results/2026-11-28-sq8-scan.md). Here the probed lists' scores are written into one buffer
(eight codes per vector instruction) and the best ``c`` are taken by one partition (numpy's).

For 8-bit codes (FAISS ``QT_8bit``, per-dimension range ``vmin``, ``vdiff``) a vector decodes to
``vmin + (code + 0.5) / 255 * vdiff``, plus its list's centroid when the lists hold residuals. Its
inner product with a query ``q`` is therefore

    q . centroid(list)  +  sum_d (q_d vdiff_d / 255) code_d  +  a constant of the query,

so a query's codes are ranked by the list's bias plus a dot product of the codes with one weight
vector, and the constant is dropped (ranking alone matters: re-ranking scores exactly).

The lists are copied once into one contiguous array (``ntotal x D`` bytes beside FAISS's own: the
index stays FAISS's, for filters, writes and saving) and copied again if the index's size changes.
"""

from __future__ import annotations

import threading
from typing import Any

import faiss
import numpy as np
from faiss.contrib.inspect_tools import get_invlist
from numba import njit

# reassociation lets the compiler vectorise the sums; NaN and inf keep their IEEE meaning
_SAFE_FAST_MATH = {"reassoc", "contract", "nsz"}


@njit(cache=True, nogil=True, fastmath=_SAFE_FAST_MATH, boundscheck=False)
def _centroid_scores(query, centroids, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``out`` (nlist,) = ``centroids`` (nlist, D) . ``query`` (D,), on this thread (numpy's BLAS
    would take every core for one query)."""
    for i in range(centroids.shape[0]):
        s = np.float32(0)
        for j in range(centroids.shape[1]):
            s += query[j] * centroids[i, j]
        out[i] = s


@njit(cache=True, nogil=True, fastmath=_SAFE_FAST_MATH, boundscheck=False)
def _scan(codes, ids, starts, lists, bias, weights, scores, found):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Scores every code of the lists ``lists`` (list l: rows ``starts[l]`` to ``starts[l + 1]`` of
    ``codes``) as ``bias[l] + weights . code`` into ``scores`` and its id into ``found``, in scan
    order; returns how many."""
    n = 0
    for i in range(len(lists)):
        b = bias[lists[i]]
        for r in range(starts[lists[i]], starts[lists[i] + 1]):
            s = np.float32(0)
            for j in range(codes.shape[1]):
                s += weights[j] * np.float32(codes[r, j])
            scores[n] = b + s
            found[n] = ids[r]
            n += 1
    return n


class ListScan:
    """The lists of an ``IndexIVFScalarQuantizer`` with 8-bit codes (``SQ8``) and inner-product
    metric, in one contiguous copy: :meth:`candidates` gives each query's best codes by a compiled
    scan. Make it with :meth:`of`, which says None for any other index."""

    def __init__(self, ivf: Any):
        lists = faiss.downcast_InvertedLists(ivf.invlists)
        d, nlist = int(ivf.d), int(ivf.nlist)
        sizes = np.array([lists.list_size(i) for i in range(nlist)], np.int64)
        self.starts = np.zeros(nlist + 1, np.int64)  # (nlist + 1,) list i: rows starts[i]..starts[i + 1]
        np.cumsum(sizes, out=self.starts[1:])
        self.codes = np.empty((int(self.starts[-1]), d), np.uint8)  # (n, D) in list order
        self.ids = np.empty(int(self.starts[-1]), np.int64)  # (n,)
        for i in np.flatnonzero(sizes):
            list_ids, list_codes = get_invlist(lists, int(i))
            self.codes[self.starts[i] : self.starts[i + 1]] = list_codes.reshape(-1, d)
            self.ids[self.starts[i] : self.starts[i + 1]] = list_ids
        trained = faiss.vector_to_array(ivf.sq.trained)  # (2D,) vmin then vdiff
        self.step = np.ascontiguousarray(trained[d:] / 255, dtype=np.float32)  # (D,) vdiff / 255
        self.centroids = np.ascontiguousarray(ivf.quantizer.reconstruct_n(0, nlist), np.float32)  # (nlist, D)
        self.by_residual = bool(ivf.by_residual)
        self.ntotal = int(ivf.ntotal)
        self.longest = np.concatenate([[0], np.cumsum(np.sort(sizes)[::-1])])  # (nlist + 1,)

    @classmethod
    def of(cls, index: faiss.Index) -> ListScan | None:
        """The scan of ``index``'s lists, or None where it does not apply: not an inverted file of
        8-bit scalar codes (``QT_8bit``, per-dimension ranges) under the inner product, or lists not
        held in memory as FAISS's arrays (on-disk lists)."""
        try:
            ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        except RuntimeError:
            return None
        if not isinstance(ivf, faiss.IndexIVFScalarQuantizer):
            return None
        if ivf.metric_type != faiss.METRIC_INNER_PRODUCT:
            return None
        if ivf.sq.qtype != faiss.ScalarQuantizer.QT_8bit or ivf.sq.trained.size() != 2 * ivf.d:
            return None
        if ivf.invlists is None or not isinstance(
            faiss.downcast_InvertedLists(ivf.invlists), faiss.ArrayInvertedLists
        ):
            return None
        try:
            return cls(ivf)
        except RuntimeError:  # a coarse quantizer that cannot give its centroids back
            return None

    def candidates(self, x: np.ndarray, c: int, nprobe: int) -> np.ndarray:
        """(Q, c) int64: for each query of ``x`` (Q, D) float32, the ids of its best ``c`` codes in its
        ``nprobe`` lists of highest centroid score, unordered, -1 after the last where the lists hold
        fewer."""
        x = np.ascontiguousarray(x, dtype=np.float32)  # (Q, D)
        nprobe = max(1, min(int(nprobe), len(self.centroids)))
        longest = max(int(self.longest[nprobe]), 1)  # rows of the nprobe largest lists
        near = np.empty(len(self.centroids), np.float32)  # (nlist,)
        scores, found = np.empty(longest, np.float32), np.empty(longest, np.int64)
        out = np.full((len(x), c), -1, np.int64)  # (Q, c)
        bias = near if self.by_residual else np.zeros_like(near)  # near: refilled for each query
        for q, query in enumerate(x):
            _centroid_scores(query, self.centroids, near)
            lists = np.argpartition(near, len(near) - nprobe)[len(near) - nprobe :]  # (nprobe,)
            n = _scan(self.codes, self.ids, self.starts, lists, bias, query * self.step, scores, found)
            best = found[np.argpartition(scores[:n], n - c)[n - c :]] if n > c else found[:n]
            out[q, : len(best)] = best
        return out


class LazyListScan:
    """:class:`ListScan` of an index, made on first use and again when the index's size changes
    (FAISS's lists were written to); None where it does not apply. Safe from several threads."""

    def __init__(self, index: faiss.Index):
        self.index = index
        self._scan: ListScan | None = None
        self._applies: bool | None = None
        self._lock = threading.Lock()

    def get(self) -> ListScan | None:
        scan = self._scan
        if self._applies is False or (scan is not None and scan.ntotal == self.index.ntotal):
            return scan
        with self._lock:
            if self._scan is None or self._scan.ntotal != self.index.ntotal:
                self._scan = ListScan.of(self.index)
                self._applies = self._scan is not None
            return self._scan
