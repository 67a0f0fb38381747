"""Evaluation speed at COCO 5K size: every metric (rank metrics, PR-AUC over all pairs, threshold
metrics, score distributions) on a 5,000 x 25,000 similarity matrix of structured embeddings
(see :func:`bench.eval_metrics.structured_similarity`), median over repeats."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.eval_metrics import structured_similarity
from bench.stats import repeat, summary


def run(images: int, repeats: int, log) -> dict[str, Any]:
    from icr.training.evaluation.metrics.relevant_pairs import Relevance
    from icr.training.evaluation.metrics.report import full_metrics

    sim = structured_similarity(images, 5, 256, 6.0)  # (images, 5 * images)
    layout = np.arange(sim.shape[1]) // 5
    relevance = Relevance.annotations(layout, images)
    result: dict[str, Any] = {}
    times = repeat(lambda: result.update(full_metrics(sim, relevance, layout, protocol="full")), repeats, 0)
    log(f"evaluation: {images:,} x {sim.shape[1]:,} in {np.median(times):.1f} s (median of {repeats})")
    return {
        "images": images,
        "captions": int(sim.shape[1]),
        "pairs": int(sim.size),
        "full_metrics": summary(times),
        "pr_auc": result["global"]["pr_auc"],
        "rsum": result["retrieval"]["rsum"],
    }
