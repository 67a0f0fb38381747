"""fp32 scores of chosen gallery rows against their own query, compiled (numba).

A bf16 scan keeps, per query, every id within its error window of the k-th best: at depth 1,000
about 1,800 ids a query, each rescored from the fp32 vectors. torch's ``index_select`` of those
rows into a (Q, W, D) copy, then a batched matrix-vector product, wrote and read the copy again;
here each row is read once, where it lies, and dotted with its query in registers, in parallel over
the queries.

Each score's sum is split over vector lanes (its own order, the same for a row and query whatever
else is rescored beside them), so it may differ from a BLAS product in the last bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


# reassociation lets LLVM split each dot product over vector lanes (a sum in one chain waited on the
# adder's latency); nothing else is relaxed: -inf padding and NaN stay as they are
@njit(cache=True, nogil=True, parallel=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _gathered(
    matrix: np.ndarray, queries: np.ndarray, ids: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled; exercised through rescored_rows
    q_count, width = ids.shape
    dim = matrix.shape[1]
    for q in prange(q_count):
        query = queries[q]
        for j in range(width):
            row = ids[q, j]
            if row < 0:
                out[q, j] = -np.inf
                continue
            vector = matrix[row]
            total = np.float32(0.0)
            for c in range(dim):
                total += vector[c] * query[c]
            out[q, j] = total


def rescored_rows(matrix: np.ndarray, queries: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(Q, W) float32: ``matrix[ids[q, j]] @ queries[q]``, -inf where ``ids`` is -1 (padding).
    ``matrix`` (N, D) and ``queries`` (Q, D) float32; ``ids`` (Q, W) int64, each < N."""
    matrix = np.ascontiguousarray(matrix, dtype=np.float32)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.ndim != 2 or queries.shape != (len(ids), matrix.shape[1]):
        raise ValueError(
            f"need (Q, W) ids and (Q, {matrix.shape[1]}) queries, got {ids.shape} and {queries.shape}"
        )
    if ids.size and int(ids.max()) >= len(matrix):
        raise ValueError(f"an id {int(ids.max())} is past the matrix's {len(matrix)} rows")
    out = np.empty(ids.shape, np.float32)
    _gathered(matrix, queries, ids, out)
    return out
