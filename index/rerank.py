"""Exact re-ranking: the engine behind ``IVF<k>,PQ<m>x4fs,RFlat`` and ``IVF<k>,SQ8,RFlat`` (issue 43).

An inverted file of compact codes finds each query's best :meth:`Rerank.candidates` under the
index's global ids: 4-bit PQ codes scanned by FAISS with SIMD ("fast-scan", ``IndexIVFPQFastScan``),
or 8-bit scalar codes scanned by this project's compiled kernel (index/list_scan.py; FAISS's own scan
where a filter is given). Those are scored again exactly against the raw float32 vectors kept beside
it (``vectors.f32``, the row of id ``i`` at ``i - first``); the best ``k`` are kept. The codes scan
far faster than raw vectors and the re-ranking makes the scores and order exact among the
candidates. On 1M demo-model embeddings, at the service's depth of 1,000, the 4-bit codes searched
in 0.79x hnswlib's time (docs/results/2026-11-27-rerank-served-1m.md) and the 8-bit codes in 0.44x
(docs/results/2026-11-28-sq8-scan.md).

FAISS's own re-ranking index (``IndexRefineFlat``) cannot serve here: it numbers its vectors 0..N-1,
cannot remove ids, and under an id map a selector picks the wrong vectors. Here the inverted file
holds the global ids, so it adds, removes and selects by id (filters, deletions, shards) as every
other inverted file of this project does.

Scores come from FAISS's per-pair inner product (``fvec_inner_products_by_idx``): the same bits for a
(query, vector) pair in any batch, so a query's hits and scores do not depend on the batch it was
searched in, without the float64 rescoring other indices need (:func:`index.vector_index.rescored`).
"""

from __future__ import annotations

import mmap as mmap_module
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from icr.index.list_scan import LazyListScan

RAW_FILE = "vectors.f32"
SUFFIX = ",RFlat"
# Candidates re-ranked per neighbour asked for. At the service's depth (1,000): recall@1000 0.882 /
# 0.951 / 0.962 at 2 / 4 / 8 on the 1M demo embeddings (nprobe 128), p50 1.04 / 1.42 / 2.07 ms.
K_FACTOR = 4
# ... and at least this many: a list of 10 from 4-bit codes needs ~128 per neighbour (recall@10 0.82
# at 8 per neighbour, 0.987 at 128, nprobe 64).
MIN_CANDIDATES = 1280
# 8-bit codes (``SQ8``) order candidates almost as the raw vectors do: on the same embeddings the
# best 1,000 codes re-ranked gave recall@1000 0.962 at nprobe 128 (1,280: 0.963), and 128 codes
# recall@10 0.991 at nprobe 64, as 64 and 256 did (docs/results/2026-11-28-sq8-scan.md).
SQ8_RERANK = (1, 128)


def is_reranked(factory: str) -> bool:
    """Whether ``factory`` names codes re-ranked from the raw vectors (``...,RFlat``)."""
    return factory.endswith(SUFFIX)


def codes_factory(factory: str) -> str:
    """The FAISS factory of the codes alone (``IVF4000,PQ64x4fs`` for ``IVF4000,PQ64x4fs,RFlat``)."""
    return factory.removesuffix(SUFFIX)


@dataclass(frozen=True)
class Rerank:
    """How many candidates a search of ``k`` re-ranks: ``max(k * k_factor, min_candidates)``."""

    k_factor: int = K_FACTOR
    min_candidates: int = MIN_CANDIDATES

    @classmethod
    def for_factory(cls, factory: str) -> Rerank:
        """The defaults for the codes ``factory`` names: fewer candidates for 8-bit codes."""
        return cls(*SQ8_RERANK) if ",SQ8" in factory else cls()

    def candidates(self, k: int) -> int:
        return max(k * self.k_factor, self.min_candidates)

    def to_dict(self) -> dict[str, Any]:
        return {"file": RAW_FILE, "k_factor": self.k_factor, "min_candidates": self.min_candidates}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Rerank:
        d = d or {}
        return cls(int(d.get("k_factor", K_FACTOR)), int(d.get("min_candidates", MIN_CANDIDATES)))


class RerankedIndex:
    """``codes`` (a FAISS inverted file under global ids) searched for candidates that ``raw`` (the
    (n, D) float32 vectors of ids ``first .. first + n - 1``; rows of ids the codes do not hold are
    never read) re-ranks exactly. Searches like a FAISS index: ``search(x, k, params)`` gives (Q, k)
    scores and ids best first (ties by id), padded with id -1; ``params`` (nprobe, a selector) go to
    the codes' search."""

    def __init__(self, codes: faiss.Index, raw: np.ndarray, first: int = 0, rerank: Rerank | None = None):
        if raw.ndim != 2 or raw.shape[1] != codes.d or raw.dtype != np.float32 or not raw.flags.c_contiguous:
            raise ValueError(f"raw vectors must be a C-contiguous (n, {codes.d}) float32 array")
        self.codes, self.raw, self.first = codes, raw, int(first)
        self.rerank = rerank or Rerank()
        self.list_scan = LazyListScan(codes)  # the candidate stage of 8-bit codes

    @property
    def d(self) -> int:
        return int(self.codes.d)

    @property
    def ntotal(self) -> int:
        return int(self.codes.ntotal)

    def search(self, x: np.ndarray, k: int, *, params: Any = None) -> tuple[np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32)  # (Q, D)
        c = max(1, min(self.rerank.candidates(k), self.ntotal))
        scan = self.list_scan.get() if getattr(params, "sel", None) is None else None
        if scan is not None:  # 8-bit codes and no filter: the compiled scan (index/list_scan.py)
            nprobe = faiss.extract_index_ivf(self.codes).nprobe if params is None else params.nprobe
            candidates = scan.candidates(x, c, nprobe)  # (Q, c), -1 where fewer were found
        else:
            _, candidates = self.codes.search(x, c, params=params)  # (Q, c), -1 where fewer were found
        scores = self._scores(x, candidates)  # (Q, c), -inf at the -1 padding
        out_s = np.full((len(x), k), -np.inf, np.float32)
        out_i = np.full((len(x), k), -1, np.int64)
        for q in range(len(x)):
            s, i = best_first(scores[q], candidates[q], k)
            out_s[q, : len(s)], out_i[q, : len(i)] = s, i
        return out_s, out_i

    def rescore(self, query: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """(n,) the exact scores of ``query`` (D,) with the vectors of ``ids`` (n,), as searches give them."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)[None]  # (1, n)
        return np.asarray(self._scores(np.ascontiguousarray(query, dtype=np.float32)[None], ids)[0])

    def read(self, ids: np.ndarray) -> np.ndarray:
        """(n, D) the raw vectors of ``ids`` (exactly what was added)."""
        rows = np.asarray(ids, dtype=np.int64) - self.first
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self.raw)):
            raise KeyError(
                f"ids outside [{self.first}, {self.first + len(self.raw)}) have no raw vector here"
            )
        return np.asarray(self.raw[rows], dtype=np.float32)

    def _scores(self, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """(Q, n) inner products of each query with the raw vectors of its row of ``ids`` (Q, n); -inf
        where an id is -1."""
        rows = np.ascontiguousarray(ids if self.first == 0 else np.where(ids >= 0, ids - self.first, -1))
        if rows.size and rows.max() >= len(self.raw):
            raise ValueError(f"ids beyond the {len(self.raw)} raw vectors from id {self.first}")
        out = np.empty(rows.shape, np.float32)  # (Q, n)
        faiss.fvec_inner_products_by_idx(  # type: ignore[attr-defined]  # (not in the stubs)
            faiss.swig_ptr(out),
            faiss.swig_ptr(x),
            faiss.swig_ptr(self.raw),
            faiss.swig_ptr(rows),
            self.d,
            len(x),
            rows.shape[1],
        )
        return out


def best_first(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` of (``scores`` (n,) float32, ``ids`` (n,), below 2^32), best first, ties by lower
    id; ids < 0 (FAISS's padding, scored -inf) dropped.

    One partition, then one sort of the kept as 64-bit keys (score's order-preserving bits above,
    id below): a single sort orders by score and breaks ties by id. Equal float32 scores are common
    among thousands of candidates (a query in four at 1M); where they straddle the cut, every
    candidate tied with the k-th competes. 0.06 ms for 1,000 of 4,000 candidates at 1M, against 0.39
    for a lexsort of all of them."""
    n = len(ids)
    if n and ids.max() >= 1 << 32:
        raise ValueError(f"ids from 2^32 up do not fit the sort keys (got {int(ids.max())})")
    top = np.arange(n)
    if n > k:
        part = np.argpartition(scores, n - k)  # (n,) the best k last
        kth = scores[part[n - k]]
        top = part[n - k :]
        if (scores[part[: n - k]] == kth).any():
            top = np.flatnonzero(scores >= kth)
    top = top[ids[top] >= 0]
    keys = np.sort(_descending(scores[top]) << np.uint64(32) | ids[top].astype(np.uint64))[:k]  # (k,)
    kept_ids = (keys & np.uint64(0xFFFFFFFF)).astype(np.int64)
    bits = (keys >> np.uint64(32)).astype(np.uint32)  # back from the descending key to float32 bits
    return _ascending_bits(~bits).view(np.float32), kept_ids


def _descending(scores: np.ndarray) -> np.ndarray:
    """uint64 keys of float32 ``scores`` whose ascending order is the scores' descending order."""
    bits = (np.asarray(scores, dtype=np.float32) + np.float32(0)).view(np.uint32)  # -0.0 -> 0.0: equal
    ordered = np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000))  # ascending
    return (~ordered).astype(np.uint64)


def _ascending_bits(ordered: np.ndarray) -> np.ndarray:
    """The float32 bits of the order-preserving uint32 ``ordered`` (the inverse of the map above)."""
    return np.where(ordered & np.uint32(0x80000000), ordered & np.uint32(0x7FFFFFFF), ~ordered).astype(
        np.uint32
    )


def save_raw(path: Path, blocks: Iterable[np.ndarray]) -> None:
    """Write ``blocks`` (float32 rows, in id order) to ``path`` (created)."""
    with open(path, "wb") as out:
        for block in blocks:
            out.write(np.ascontiguousarray(block, dtype=np.float32).tobytes())


def raw_blocks(path: Path, dim: int, chunk: int = 65_536, offset: int = 0) -> Iterator[np.ndarray]:
    """The rows of ``path`` from byte ``offset`` (e.g. past a ``.npy`` header) as (<= ``chunk``, dim)
    float32 blocks, in order: read a block at a time, so the file is never held (or mapped) whole."""
    with open(path, "rb") as f:
        f.seek(offset)
        while (block := np.fromfile(f, np.float32, count=chunk * dim)).size:
            yield block.reshape(-1, dim)


def load_raw(path: Path, rows: int, dim: int, *, mmap: bool = False) -> np.ndarray:
    """(rows, dim) float32 of ``path``; ``mmap``: mapped from the page cache instead of read whole
    (read whole, the re-ranking's random rows came faster in a scratch run at 1M: 1.67 against
    1.85 ms per search of 1,000). ValueError naming the file when its size is not ``rows x dim``
    floats."""
    try:
        size = os.path.getsize(path)
    except OSError as err:
        raise FileNotFoundError(f"{path}: raw vectors for re-ranking not found ({err.strerror})") from None
    if size != rows * dim * 4:
        raise ValueError(
            f"{path}: {size:,} bytes, {rows:,} x {dim} float32 = {rows * dim * 4:,} expected (truncated, "
            "or from another build)"
        )
    if rows == 0:
        return np.zeros((0, dim), np.float32)
    if mmap:
        with open(path, "rb") as f:
            mapped = mmap_module.mmap(f.fileno(), 0, prot=mmap_module.PROT_READ)
        # Rows are read at random: without this each one faults in the kernel's read-ahead window
        # (128 KiB) around it. Under a 4 GiB memory cgroup on 10M vectors that thrashed the page
        # cache (p50 400 ms per query at k = 10); with it, 6.88 ms in 920 MiB
        # (docs/results/2026-11-28-on-disk-10m.md).
        mapped.madvise(mmap_module.MADV_RANDOM)
        return np.frombuffer(mapped, dtype=np.float32).reshape(rows, dim)
    return np.fromfile(path, dtype=np.float32).reshape(rows, dim)
