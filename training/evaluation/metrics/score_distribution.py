"""Per-query score distributions (the Cross-Example Softmax paper's Fig. 4, right).

For each sampled query: how many candidates score at least x, on a grid of x. A globally
calibrated model has these curves bunched together (the same score means the same amount of
relevance for every query); a model trained only to rank per query has them spread out, so no
single ``min_score`` works for every query. The spread is summarised by the 5th / 50th / 95th
percentile curves across queries (the paper's orange lines) and by percentiles of each query's
best score and of the relevant pairs' scores.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from icr.training.evaluation.metrics.pair_blocks import resolve_nan
from icr.training.evaluation.metrics.ranking import DIRECTIONS, as_score_matrix
from icr.training.evaluation.metrics.relevant_pairs import Relevance

PERCENTILES: tuple[int, ...] = (5, 50, 95)


def _percentiles(values: np.ndarray) -> Mapping[str, float | None]:  # all None when nothing is finite
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return {f"p{q}": None for q in PERCENTILES} | {"mean": None}
    return {f"p{q}": float(np.percentile(finite, q)) for q in PERCENTILES} | {"mean": float(finite.mean())}


def score_distributions(
    sim: np.ndarray | torch.Tensor,
    relevance: Relevance,
    *,
    queries: int = 1000,
    grid_points: int = 101,
    seed: int = 0,
) -> dict[str, Any]:
    """Curves and summary statistics for up to ``queries`` random queries of each direction.

    Returns per direction: ``grid`` (G,) scores, ``curves`` (Q, G) number of candidates with
    score >= grid[g] (for plotting), ``percentile_curves`` {p5, p50, p95: (G,)}, and percentiles of
    the sampled queries' ``top1`` score and of their ``relevant`` scores.
    """
    sim = as_score_matrix(sim)
    relevance.check_shape(sim.shape)
    rng = np.random.default_rng(seed)
    sampled: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for direction in DIRECTIONS:
        n = sim.shape[0] if direction == "i2t" else sim.shape[1]
        pick = np.sort(rng.choice(n, size=min(queries, n), replace=False))
        if direction == "i2t":
            scores, rel = np.asarray(sim[pick]), relevance.image_rows_at(pick)
        else:
            scores, rel = np.ascontiguousarray(sim[:, pick].T), relevance.caption_rows_at(pick)
        sampled[direction] = resolve_nan(scores, rel), rel  # (Q, N) each
    # One grid for both directions, over the sampled scores (the full matrix may be 125 M scores).
    finite = np.concatenate([s[np.isfinite(s)] for s, _ in sampled.values()])
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (-1.0, 1.0)
    grid = np.linspace(lo, hi, grid_points)
    out: dict[str, Any] = {}
    for direction, (scores, rel) in sampled.items():
        ordered = torch.from_numpy(np.sort(scores, axis=1))  # (Q, N) ascending
        probes = torch.from_numpy(grid).to(ordered.dtype).expand(len(scores), -1).contiguous()  # (Q, G)
        curves = (ordered.shape[1] - torch.searchsorted(ordered, probes, side="left")).numpy()  # (Q, G)
        out[direction] = {
            "queries": int(len(scores)),
            "grid": grid.tolist(),
            "curves": curves,  # (Q, G) int: kept as an array for plots, dropped from JSON reports
            "percentile_curves": {f"p{q}": np.percentile(curves, q, axis=0).tolist() for q in PERCENTILES},
            "top1": _percentiles(scores.max(axis=1)),
            "relevant": _percentiles(scores[rel]),
        }
    return out
