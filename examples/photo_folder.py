"""Make a folder of "your photos" with a metadata file, for the README's "your own data" walk-through:
the test images of an `icr data synth` folder, spread over sub-folders by year, and ``meta.csv``
keyed by each file's path relative to the folder (columns ``file``, ``album``, ``year``, ``camera``).
Every fourth photo is a phone JPEG stored sideways with EXIF orientation 6, as phones write them: it
must be read upright.

Usage: ``python examples/photo_folder.py SYNTH_FOLDER OUT_FOLDER [COUNT]`` (COUNT: 40).
"""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path

from PIL import Image

EXIF_ORIENTATION = 0x0112
ROTATE_90_CW = 6  # "turn the stored pixels 90 degrees clockwise to show them"


def make_photo_folder(synth: Path, out: Path, count: int = 40) -> int:
    sources = sorted((synth / "images").glob("synth_test_*.png"))[:count]
    if not sources:
        raise SystemExit(f"{synth}: no images/synth_test_*.png; make it with `icr data synth --out {synth}`")
    rows = []
    for i, source in enumerate(sources):
        year = 2022 + i % 3
        sideways = i % 4 == 3
        relative = Path(str(year)) / f"IMG_{i:04d}.{'jpg' if sideways else 'png'}"
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        if sideways:  # the pixels turned a quarter anticlockwise; the tag turns them back
            exif = Image.Exif()
            exif[EXIF_ORIENTATION] = ROTATE_90_CW
            with Image.open(source) as upright:
                upright.convert("RGB").rotate(90, expand=True).save(
                    out / relative, quality=95, subsampling=0, exif=exif
                )
        else:
            shutil.copyfile(source, out / relative)
        rows.append({"file": relative.as_posix(), "album": ("trip", "home")[i % 2], "year": year,
                     "camera": ("x100", "gr3", "phone")[i % 3]})  # fmt: skip
    with open(out / "meta.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python examples/photo_folder.py SYNTH_FOLDER OUT_FOLDER [COUNT]")
    n = make_photo_folder(
        Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) == 4 else 40
    )
    print(f"wrote {n} photos and meta.csv to {sys.argv[2]}")
