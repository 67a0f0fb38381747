"""Intramodal retrieval (CxC t2t / i2i): each item queries all *other* items of the same modality.

Positives of query q: the pairs listed for it (e.g. CxC STS / SIS pairs above the threshold) plus,
when ``groups`` is given, every other item of the same group (t2t: the other captions of the same
image). The query itself is never a candidate. Same position engine and metrics as the cross-modal
directions (:mod:`icr.training.evaluation.metrics.ranking`): R@K of the best-ranked positive,
medr, R-precision with
R = the query's number of positives, ...; queries without any positive are counted, not averaged.
Scores are computed one block of queries at a time, so a 25,000-caption t2t never holds the full
(N, N) matrix.
"""

from __future__ import annotations

import numpy as np

from icr.training.evaluation.metrics.ranking import (
    BLOCK_ELEMENTS,
    per_query_metrics,
    relevant_positions,
    summarize_direction,
)


def intramodal_metrics(
    emb: np.ndarray,
    pairs: np.ndarray,
    prefix: str,
    *,
    groups: np.ndarray | None = None,
    block_rows: int | None = None,
) -> dict[str, float]:
    """Metrics ``{prefix}_r1 .. {prefix}_rprec`` of ``emb`` (N, D) queries against the other N - 1 items.

    ``pairs``: (P, 2) int64 (query, positive) rows, sorted by query, both orders of an undirected pair.
    """
    emb = np.asarray(emb)
    n = emb.shape[0]
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    if pairs.size and (pairs.min() < 0 or pairs.max() >= n):
        raise ValueError(f"pair indices must lie in [0, {n})")
    order = np.argsort(pairs[:, 0], kind="stable")
    pairs = pairs[order]
    groups = None if groups is None else np.asarray(groups)
    rows = block_rows or max(1, BLOCK_ELEMENTS // max(n, 1))
    parts: list[dict[str, np.ndarray]] = []
    counts: list[np.ndarray] = []
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        b = stop - start
        scores = (emb[start:stop] @ emb.T).astype(np.float64)  # (b, N)
        if groups is not None:
            relevant = groups[start:stop, None] == groups[None, :]  # (b, N)
        else:
            relevant = np.zeros((b, n), dtype=bool)
        lo, hi = np.searchsorted(pairs[:, 0], [start, stop])
        relevant[pairs[lo:hi, 0] - start, pairs[lo:hi, 1]] = True
        diagonal = (np.arange(b), np.arange(start, stop))
        relevant[diagonal] = False  # the query itself is not a candidate ...
        scores[diagonal] = -np.inf  # ... and ranks below every other item
        positions, c = relevant_positions(scores, relevant)
        parts.append(per_query_metrics(positions, c))
        counts.append(c)
    if not parts:
        return {f"{prefix}_queries": 0.0, f"{prefix}_queries_without_relevant": 0.0}
    values = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    all_counts = np.concatenate(counts)
    if not (all_counts > 0).any():
        return {f"{prefix}_queries": float(n), f"{prefix}_queries_without_relevant": float(n)}
    return summarize_direction(values, all_counts, prefix)
