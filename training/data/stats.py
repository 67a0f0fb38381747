"""Summary statistics of a caption dataset (what `icr data stats` prints)."""

from __future__ import annotations

from typing import Any

import numpy as np

from icr.training.data.karpathy import KarpathyDataset
from icr.training.data.precomp import PrecompSplit
from icr.training.data.vocab import build_training_vocab


def _length_stats(token_lists: list[list[str]]) -> dict[str, int | float]:
    lengths = np.asarray([len(t) for t in token_lists]) if token_lists else np.zeros(1)
    return {
        "mean_caption_tokens": round(float(lengths.mean()), 2),
        "min_caption_tokens": int(lengths.min()),
        "max_caption_tokens": int(lengths.max()),
        "distinct_words": len({w for t in token_lists for w in t}),
    }


def describe_karpathy(dataset: KarpathyDataset) -> dict[str, Any]:
    """Images, captions and caption lengths per split; vocabulary size of the train split."""
    splits = {}
    for name, split in dataset.splits.items():
        restval = sum(r.source_split == "restval" for r in split.images)
        splits[name] = {
            "images": len(split),
            "captions": split.num_captions,
            **({"from_restval": restval} if restval else {}),
            **_length_stats(split.caption_tokens),
        }
    out: dict[str, object] = {
        "dataset": dataset.name,
        "json": str(dataset.json_path),
        "image_root": str(dataset.image_root),
        "splits": splits,
    }
    if "train" in dataset.splits:
        out["train_vocabulary_size"] = len(build_training_vocab(dataset))
    return out


def describe_precomp(splits: dict[str, PrecompSplit]) -> dict[str, Any]:
    """Feature shapes and caption counts per precomp split."""
    return {
        "splits": {
            name: {
                "images": s.num_images,
                "captions": len(s),
                "feature_shape": list(s.images.shape[1:]),
                "feature_dtype": str(s.images.dtype),
                "captions_per_image_row": s.im_div,
                **_length_stats(s.caption_tokens),
            }
            for name, s in splits.items()
        }
    }
