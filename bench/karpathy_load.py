"""Benchmark: loading a COCO-sized Karpathy JSON (123,287 images, 5-7 captions each).

    python -m bench.karpathy_load

Writes a temporary dataset_coco.json of the real size (no image files; existence checks off)
and times `load_karpathy`. Not a test: prints the figure only.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from icr.training.data.karpathy import load_karpathy

SPLITS = {"train": 82_783, "restval": 30_504, "val": 5_000, "test": 5_000}


def coco_sized_json(path: Path) -> None:
    images, imgid, sentid = [], 0, 0
    for split, n in SPLITS.items():
        for i in range(n):
            k = 5 + (i % 3 == 0) + (i % 7 == 0)  # some images have 6-7 captions, as in COCO
            sentences = [
                {
                    "raw": f"A man riding a wave on top of a surfboard {j}.",
                    "tokens": ["a", "man", "riding", "a", "wave"],
                    "imgid": imgid,
                    "sentid": sentid + j,
                }
                for j in range(k)
            ]
            folder = "train2014" if split == "train" else "val2014"
            images.append(
                {
                    "filepath": folder,
                    "sentids": list(range(sentid, sentid + k)),
                    "filename": f"COCO_{folder}_{imgid:012d}.jpg",
                    "imgid": imgid,
                    "split": split,
                    "sentences": sentences,
                    "cocoid": imgid,
                }
            )
            imgid, sentid = imgid + 1, sentid + k
    path.write_text(json.dumps({"dataset": "coco", "images": images}))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dataset_coco.json"
        coco_sized_json(path)
        size_mb = path.stat().st_size / 1e6
        start = time.perf_counter()
        ds = load_karpathy(path, check_images=False)
        seconds = time.perf_counter() - start
    sizes = {k: len(v) for k, v in ds.splits.items()}
    print(f"load_karpathy on a COCO-sized JSON ({size_mb:.0f} MB): {seconds:.1f} s; splits {sizes}")


if __name__ == "__main__":
    main()
