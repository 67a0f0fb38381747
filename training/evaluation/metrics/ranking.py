"""Rank-based retrieval metrics for queries with any number of relevant candidates.

For one query the engine computes the 1-based **position** of each relevant candidate in the
ranking by score: the m-th best relevant item (m = 1 .. R) sits at ``p_m = m + #(non-relevant
candidates scoring >= it)``. Ties are pessimistic (a non-relevant candidate with an equal score
ranks first), so a collapsed model gets the worst ranks instead of the R@1 = 100 that
``argsort`` tie order can hand it. NaN counts against the query: a NaN non-relevant score ranks
above everything, and a query with any NaN relevant score ranks all its relevant items last.

From the positions, per query (averaged over the queries that have at least one relevant item;
queries with none are counted and reported, never averaged in):

* ``r{K}``   recall@K in percent: the first relevant item is within the top K (VSE++ protocol);
* ``medr``, ``meanr``: median (floored, as the seeds) and mean rank of the first relevant item;
* ``ar``     average recall (R@1 + R@5 + R@10) / 3 (ECIR);
* ``map{k}`` standard AP@k = sum_{p_m <= k} (m / p_m) / min(k, R), 0-1 scale;
* ``map{k}_ecir`` the ECIR repository's AP@k = mean over the hits in the top k of m / p_m (divides
  by the number of hits found, not by min(k, R); 0 when no hit), 0-1 scale;
* ``rprec``  R-precision: #relevant in the top R / R (LTD, R = 5 captions for i2t);
* ``map``    full average precision over all R relevant items.

Metric names are ``{direction}_{metric}`` with direction ``i2t`` (image queries, caption
candidates) or ``t2i`` (caption queries, image candidates).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from icr.training.evaluation.metrics.relevant_pairs import Relevance

RECALL_AT: tuple[int, ...] = (1, 5, 10)  # the K of R@K; rsum sums these over both directions
MAP_AT: tuple[int, ...] = (5, 10)
DIRECTIONS: tuple[str, ...] = ("i2t", "t2i")
# Scores compared per block: bounds the temporaries to tens of MB whatever the matrix size
# (COCO 5K is 5,000 x 25,000 = 125 M scores).
BLOCK_ELEMENTS = 1 << 22


def as_score_matrix(sim: np.ndarray | torch.Tensor) -> np.ndarray:
    """``sim`` as a 2-D floating numpy array (integers are promoted, tensors copied to the CPU)."""
    if isinstance(sim, torch.Tensor):
        sim = sim.detach().cpu().numpy()
    sim = np.asarray(sim)
    if sim.ndim != 2:
        raise ValueError(f"sim must be a 2-D (N_img, N_cap) score matrix, got shape {sim.shape}")
    if np.issubdtype(sim.dtype, np.integer):
        return sim.astype(np.float64)
    if not np.issubdtype(sim.dtype, np.floating):
        raise ValueError(f"sim must hold real scores, got dtype {sim.dtype}")
    return sim


def relevant_positions(scores: np.ndarray, relevant: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the relevant candidates of a block of queries.

    ``scores``: (b, N) one query per row; ``relevant``: (b, N) bool. Returns ``(positions (b, M),
    counts (b,))`` with M = max count in the block: ``positions[q, m]`` is the 1-based position of
    the (m+1)-th best relevant candidate of query q (pessimistic ties), 0 beyond ``counts[q]``.
    """
    scores = np.ascontiguousarray(scores)  # torch.searchsorted wants contiguous sorted rows
    b, n = scores.shape
    counts = relevant.sum(axis=1).astype(np.int64)  # (b,)
    m = int(counts.max()) if b else 0
    if m == 0:
        return np.zeros((b, 0), dtype=np.int64), counts
    nan = np.isnan(scores)
    if nan.any():
        scores = scores.copy()
        scores[nan & ~relevant] = np.inf  # a NaN competitor outranks everything
        poisoned = (nan & relevant).any(axis=1)  # (b,) queries with a NaN relevant score
        scores[poisoned[:, None] & relevant] = -np.inf  # ... rank all their relevant items last
    # Relevant scores of each query, best first; rows with fewer than m are padded with -inf.
    top = -np.sort(-np.where(relevant, scores, -np.inf), axis=1)[:, :m]  # (b, m) descending
    ascending = torch.from_numpy(top[:, ::-1].copy())  # (b, m)
    top_t = torch.from_numpy(top.copy())  # (b, m)
    ordered = torch.from_numpy(np.sort(scores, axis=1))  # (b, N) ascending
    at_least = n - torch.searchsorted(ordered, top_t, side="left").numpy()  # (b, m) candidates >= s_m
    # Relevant items >= s_m. The -inf padding only reaches a -inf s_m, where every real relevant
    # item qualifies, so capping at the count removes it.
    relevant_at_least = np.minimum(
        m - torch.searchsorted(ascending, top_t, side="left").numpy(), counts[:, None]
    )
    positions = np.arange(1, m + 1)[None, :] + at_least - relevant_at_least  # (b, m)
    positions[np.arange(m)[None, :] >= counts[:, None]] = 0
    return positions.astype(np.int64), counts


def per_query_metrics(positions: np.ndarray, counts: np.ndarray) -> dict[str, np.ndarray]:
    """Per-query values from :func:`relevant_positions` (queries with count 0 get NaN)."""
    b, m = positions.shape
    has = counts > 0  # (b,)
    valid = positions > 0  # (b, m)
    safe = np.where(valid, positions, 1).astype(np.float64)  # (b, m)
    precision_at_hit = np.where(valid, np.arange(1, m + 1)[None, :] / safe, 0.0)  # (b, m): m / p_m
    denom = np.maximum(counts, 1).astype(np.float64)  # (b,)
    out: dict[str, np.ndarray] = {"rank": np.where(has, positions[:, 0] if m else 0, 0)}
    for k in MAP_AT:
        hit = valid & (positions <= k)  # (b, m)
        found = (precision_at_hit * hit).sum(axis=1)  # (b,)
        out[f"map{k}"] = found / np.minimum(k, denom)
        out[f"map{k}_ecir"] = found / np.maximum(hit.sum(axis=1), 1)
    out["rprec"] = (valid & (positions <= counts[:, None])).sum(axis=1) / denom
    out["map"] = precision_at_hit.sum(axis=1) / denom
    for key in out:
        if key != "rank":
            out[key] = np.where(has, out[key], np.nan)
    return out


def position_blocks(
    sim: np.ndarray | torch.Tensor, relevance: Relevance, direction: str, *, block_rows: int | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """:func:`relevant_positions` of consecutive blocks of queries of one direction.

    ``sim`` is (N_img, N_cap); ``i2t`` queries are its rows, ``t2i`` queries its columns (copied
    block by block into query-major order). ``block_rows`` queries per block (default: about
    :data:`BLOCK_ELEMENTS` scores).
    """
    sim = as_score_matrix(sim)
    relevance.check_shape(sim.shape)
    n_img, n_cap = sim.shape
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    n_queries, n_candidates = (n_img, n_cap) if direction == "i2t" else (n_cap, n_img)
    rows = block_rows or max(1, BLOCK_ELEMENTS // max(n_candidates, 1))
    for start in range(0, n_queries, rows):
        stop = min(start + rows, n_queries)
        if direction == "i2t":
            scores, rel = np.asarray(sim[start:stop]), relevance.image_rows(start, stop)
        else:
            scores, rel = np.ascontiguousarray(sim[:, start:stop].T), relevance.caption_rows(start, stop)
        yield relevant_positions(scores, rel)


def first_relevant_ranks(
    sim: np.ndarray | torch.Tensor, relevance: Relevance, direction: str, *, block_rows: int | None = None
) -> np.ndarray:
    """(N_queries,) rank of each query's best relevant candidate (0 for queries with none)."""
    parts = [
        np.where(counts > 0, positions[:, 0] if positions.shape[1] else 0, 0)
        for positions, counts in position_blocks(sim, relevance, direction, block_rows=block_rows)
    ]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def direction_per_query(
    sim: np.ndarray | torch.Tensor, relevance: Relevance, direction: str, *, block_rows: int | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-query metric arrays (see :func:`per_query_metrics`) and relevant counts, one direction."""
    parts: list[dict[str, np.ndarray]] = []
    counts: list[np.ndarray] = []
    for positions, c in position_blocks(sim, relevance, direction, block_rows=block_rows):
        parts.append(per_query_metrics(positions, c))
        counts.append(c)
    if not parts:
        return {}, np.zeros(0, dtype=np.int64)
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}, np.concatenate(counts)


def summarize_direction(values: dict[str, np.ndarray], counts: np.ndarray, prefix: str) -> dict[str, float]:
    """Averages over the queries with at least one relevant candidate, plus the query counts."""
    has = counts > 0
    out: dict[str, float] = {
        f"{prefix}_queries": float(counts.size),
        f"{prefix}_queries_without_relevant": float((~has).sum()),
    }
    if not has.any():
        raise ValueError(
            f"no {prefix} query has a relevant candidate: check that the relevance matches the "
            f"similarity matrix (rows images, columns captions)"
        )
    ranks = values["rank"][has]
    for k in RECALL_AT:
        out[f"{prefix}_r{k}"] = float(100.0 * np.mean(ranks <= k))
    out[f"{prefix}_ar"] = float(np.mean([out[f"{prefix}_r{k}"] for k in RECALL_AT]))
    out[f"{prefix}_medr"] = float(np.floor(np.median(ranks)))
    out[f"{prefix}_meanr"] = float(np.mean(ranks))
    for key, v in values.items():
        if key != "rank":
            out[f"{prefix}_{key}"] = float(np.mean(v[has]))
    return out


def ranking_metrics(
    sim: np.ndarray | torch.Tensor, relevance: Relevance, *, block_rows: int | None = None
) -> dict[str, float]:
    """All rank metrics for both directions plus ``rsum`` (sum of the six recalls, max 600)."""
    out: dict[str, float] = {}
    for direction in DIRECTIONS:
        values, counts = direction_per_query(sim, relevance, direction, block_rows=block_rows)
        out.update(summarize_direction(values, counts, direction))
    out["rsum"] = float(sum(out[f"{d}_r{k}"] for d in DIRECTIONS for k in RECALL_AT))
    return out
