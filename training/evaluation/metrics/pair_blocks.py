"""Blocks of (image, caption) pairs with their relevance, for metrics over every pair of a test set.

COCO 5K has 125 M pairs; every global metric (PR-AUC, threshold metrics, calibration) reads them
in blocks of image rows, so memory stays at a few tens of MB beyond the similarity matrix itself.

NaN is resolved against the model, as for ranks: a NaN score of a non-relevant pair becomes
+inf (it beats every threshold: a false positive), one of a relevant pair -inf (never retrieved).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from icr.training.evaluation.metrics.ranking import BLOCK_ELEMENTS, as_score_matrix
from icr.training.evaluation.metrics.relevant_pairs import Relevance


def resolve_nan(scores: np.ndarray, relevant: np.ndarray) -> np.ndarray:
    """``scores`` with NaN replaced pessimistically (see the module docstring); no copy without NaN."""
    nan = np.isnan(scores)
    if not nan.any():
        return scores
    scores = scores.copy()
    scores[nan & relevant] = -np.inf
    scores[nan & ~relevant] = np.inf
    return scores


def pair_blocks(
    sim: np.ndarray | torch.Tensor, relevance: Relevance, *, block_rows: int | None = None
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yields ``(first_image_row, scores (b, N_cap), relevant (b, N_cap) bool)`` over all images."""
    sim = as_score_matrix(sim)
    relevance.check_shape(sim.shape)
    n_img, n_cap = sim.shape
    rows = block_rows or max(1, BLOCK_ELEMENTS // max(n_cap, 1))
    for start in range(0, n_img, rows):
        stop = min(start + rows, n_img)
        relevant = relevance.image_rows(start, stop)
        yield start, resolve_nan(np.asarray(sim[start:stop]), relevant), relevant


def relevant_scores(sim: np.ndarray | torch.Tensor, relevance: Relevance) -> np.ndarray:
    """(num_pairs,) scores of the relevant pairs (NaN resolved: -inf), sorted ascending."""
    sim = as_score_matrix(sim)
    relevance.check_shape(sim.shape)
    scores = relevance.positive_scores(sim)  # (P,) a gather, not a pass over all pairs
    return np.sort(np.where(np.isnan(scores), -np.inf, scores))
