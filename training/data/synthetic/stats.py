"""Ground-truth statistics of the synthetic benchmark: how many images truly match a caption.

These numbers show why the benchmark is non-trivial: a partial caption ("a red circle") is true
of many images besides the one it was written for, exactly the false negatives that the
5-captions-per-image protocol of Flickr30k/COCO counts as errors.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from icr.training.data.karpathy import CaptionSplit
from icr.training.data.synthetic.ground_truth import relevance_matrix
from icr.training.data.synthetic.scene import Scene, SceneTable


def relevance_stats(split: CaptionSplit, scenes: list[Scene]) -> dict[str, Any]:
    """Per split: object counts, relevant images per caption, and a self-consistency check."""
    table = SceneTable.from_scenes(scenes)
    rel = relevance_matrix(split.captions, table)  # (5N, N) bool
    per_caption = rel.sum(axis=1)  # (5N,)
    own = rel[np.arange(rel.shape[0]), np.arange(rel.shape[0]) // split.captions_per_image]
    objects = Counter(len(s.objects) for s in scenes)
    return {
        "images": len(split),
        "objects_per_image": {str(k): objects[k] for k in sorted(objects)},
        "relevant_images_per_caption_mean": round(float(per_caption.mean()), 2),
        "relevant_images_per_caption_median": float(np.median(per_caption)),
        "relevant_images_per_caption_max": int(per_caption.max()),
        "captions_with_other_relevant_images": round(float((per_caption > 1).mean()), 4),
        # Must be 1.0: every caption is true of the image it was written for.
        "captions_true_of_own_image": round(float(own.mean()), 4),
    }
