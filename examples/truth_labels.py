"""Label "your photos" for the README's walk-through, standing in for a person's judgement: every photo
of ``examples/photo_folder.py``'s folder judged against a few queries by the embedded benchmark's
ground truth (the photos are its test images), written as ``icr index calibrate --labels`` reads it.

Usage: ``python examples/truth_labels.py SYNTH_FOLDER PHOTO_FOLDER OUT.jsonl``
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np

from icr.training.data.karpathy import load_karpathy
from icr.training.data.synthetic.generate import split_scene_table
from icr.training.data.synthetic.ground_truth import PairTruth
from icr.training.data.synthetic.parse import parse_caption

QUERIES = ("a red circle", "a blue square", "a green shape", "a large triangle", "two shapes")


def write_labels(synth: Path, photos: Path, out: Path) -> int:
    images = load_karpathy(synth).split("test").images
    row_of = {image.filename: i for i, image in enumerate(images)}
    sources = sorted((synth / "images").glob("synth_test_*.png"))  # photo_folder.py's order
    with open(photos / "meta.csv") as handle:
        files = [r["file"] for r in csv.DictReader(handle)]
    rows = np.array([row_of[sources[i].name] for i in range(len(files))])
    truth = PairTruth([parse_caption(q) for q in QUERIES], split_scene_table(synth, "test"))
    relevant = truth(rows, np.arange(len(QUERIES)))  # (photos, queries)
    with open(out, "w") as handle:
        for j, query in enumerate(QUERIES):
            for i, file in enumerate(files):
                handle.write(
                    json.dumps({"query": query, "image": file, "relevant": bool(relevant[i, j])}) + "\n"
                )
    return len(files) * len(QUERIES)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python examples/truth_labels.py SYNTH_FOLDER PHOTO_FOLDER OUT.jsonl")
    print(f"wrote {write_labels(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))} labels")
