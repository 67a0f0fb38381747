"""Test protocols: COCO 5K, COCO 1K (5 sequential folds, averaged), Flickr30k 1K.

* ``full``: every image of the split at once (Flickr30k test = "F30k 1K", COCO test = "COCO 5K").
* ``5k``: the same as ``full`` but checks that the split really has 5,000 images.
* ``1k``: the split's images cut **sequentially** (no shuffling) into folds of 1,000 images, each
  with its own captions; metrics are computed per fold and averaged over folds (the VSE++ author's
  protocol, fartashf/vsepp issues #25/#26). rsum is the sum of the fold-averaged recalls (equal to
  the mean of the per-fold rsums), never the seeds' misprinted ``6 x mean`` column. On a split of
  exactly 1,000 images (Flickr30k) it equals ``full``. The precomp ``test`` file is a single 1K
  subset and is NOT "COCO 1K": evaluate ``testall`` (5K) with ``1k``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from icr.training.evaluation.metrics.ranking import as_score_matrix, ranking_metrics
from icr.training.evaluation.metrics.relevant_pairs import Relevance

PROTOCOLS: tuple[str, ...] = ("full", "1k", "5k")
FOLD_IMAGES = 1000


def protocol_folds(n_img: int, protocol: str) -> list[np.ndarray]:
    """Image rows of each fold (one fold for ``full`` / ``5k``)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    if protocol == "5k" and n_img != 5000:
        raise ValueError(
            f"the 5k protocol needs the 5,000-image COCO test split, this split has {n_img:,} images; "
            "use the full protocol"
        )
    if protocol == "1k":
        if n_img < FOLD_IMAGES or n_img % FOLD_IMAGES:
            raise ValueError(
                f"the 1k protocol cuts the split into folds of {FOLD_IMAGES:,} images, but it has "
                f"{n_img:,}; use the full protocol (or the COCO 5K split, precomp 'testall')"
            )
        return [np.arange(f, f + FOLD_IMAGES) for f in range(0, n_img, FOLD_IMAGES)]
    return [np.arange(n_img)]


def fold_metrics(
    sim: np.ndarray | torch.Tensor,
    relevance: Relevance,
    img_of_cap: np.ndarray,
    protocol: str = "full",
) -> dict[str, Any]:
    """:func:`ranking_metrics` under ``protocol``: ``{"metrics": mean, "std": ..., "per_fold": [...]}``.

    ``img_of_cap`` (N_cap,) assigns captions to folds (a caption belongs to its annotated image's
    fold); ``relevance`` (annotations or ground truth) decides what counts as relevant inside it.
    """
    sim = as_score_matrix(sim)
    relevance.check_shape(sim.shape)
    img_of_cap = np.asarray(img_of_cap, dtype=np.int64)
    folds = protocol_folds(sim.shape[0], protocol)
    if len(folds) == 1:
        per_fold = [ranking_metrics(sim, relevance)]
    else:
        per_fold = []
        for images in folds:
            captions = np.flatnonzero(np.isin(img_of_cap, images))  # (n_cap_fold,)
            sub = sim[np.ix_(images, captions)]  # (1000, n_cap_fold)
            per_fold.append(ranking_metrics(sub, relevance.subset(images, captions)))
    keys = per_fold[0].keys()
    return {
        "protocol": protocol,
        "folds": len(folds),
        "metrics": {k: float(np.mean([m[k] for m in per_fold])) for k in keys},
        "std": {k: float(np.std([m[k] for m in per_fold])) for k in keys},
        "per_fold": per_fold if len(folds) > 1 else [],
    }
