"""Loader for precomputed image features (VSE++/SCAN/VSRN "precomp" folders).

A folder such as ``coco_precomp/`` holds ``{split}_ims.npy`` (``(N_img, D)`` vectors or
``(N_img, R, D)`` region features) and ``{split}_caps.txt`` (one caption per line, grouped by
image). Feature arrays can be tens of GB, so they are memory-mapped, never read into RAM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from icr.training.data.errors import DatasetError, read_text
from icr.training.data.vocab import tokenize

# Captions per image when the caption file has more lines than the feature array has rows.
_CAPTIONS_PER_IMAGE = 5


@dataclass
class PrecompSplit:
    """One precomp split; caption ``c`` describes feature row ``c // im_div``."""

    name: str
    images: np.ndarray  # memory-mapped (N_img, D) or (N_img, R, D)
    captions: list[str]
    im_div: int  # 5: five caption lines per feature row; 1: one row per caption (e.g. 10-crop)
    ims_path: Path | None = None
    caps_path: Path | None = None

    @property
    def num_images(self) -> int:
        return int(self.images.shape[0])

    @property
    def caption_tokens(self) -> list[list[str]]:
        """Captions tokenized with :func:`training.data.vocab.tokenize` (for vocabularies)."""
        return [tokenize(caption) for caption in self.captions]

    def image_of_caption(self, c: int) -> int:
        """Feature row of caption ``c``."""
        if not 0 <= c < len(self.captions):
            raise IndexError(
                f"caption index {c} out of range [0, {len(self.captions)}) in split {self.name!r}"
            )
        return c // self.im_div

    def __len__(self) -> int:
        return len(self.captions)


def available_precomp_splits(directory: str | os.PathLike[str]) -> list[str]:
    """Splits in ``directory`` that have both ``{split}_ims.npy`` and ``{split}_caps.txt``."""
    folder = Path(directory)
    ims = {p.name[: -len("_ims.npy")] for p in folder.glob("*_ims.npy")}
    caps = {p.name[: -len("_caps.txt")] for p in folder.glob("*_caps.txt")}
    return sorted(ims & caps)


def load_precomp(directory: str | os.PathLike[str], split: str) -> PrecompSplit:
    """Load ``{split}_ims.npy`` (memory-mapped) and ``{split}_caps.txt`` from ``directory``.

    ``im_div`` is 1 when there is one caption line per feature row and 5 when there are five;
    any other ratio means the two files do not belong together and raises DatasetError.
    """
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        raise DatasetError(
            "precomputed-feature folder not found.",
            path=folder,
            hint=f"Pass the folder holding {split}_ims.npy and {split}_caps.txt (e.g. data/coco_precomp).",
        )
    ims_path = folder / f"{split}_ims.npy"
    caps_path = folder / f"{split}_caps.txt"
    missing = [p for p in (ims_path, caps_path) if not p.is_file()]
    if missing:
        available = available_precomp_splits(folder)
        listing = ", ".join(repr(s) for s in available) if available else "none"
        raise DatasetError(
            f"split {split!r} not found: missing {' and '.join(p.name for p in missing)}.",
            path=missing[0] if len(missing) == 1 else folder,
            hint=f"Splits available in {folder}: {listing}.",
        )

    images = _load_features(ims_path)
    captions = _read_captions(caps_path)
    rows, lines = int(images.shape[0]), len(captions)
    if lines == rows:
        im_div = 1
    elif lines == _CAPTIONS_PER_IMAGE * rows:
        im_div = _CAPTIONS_PER_IMAGE
    else:
        raise DatasetError(
            f"has {lines} caption lines but {ims_path} has {rows} feature rows; expected {rows} "
            f"(one caption per row) or {_CAPTIONS_PER_IMAGE * rows} ({_CAPTIONS_PER_IMAGE} per image).",
            path=caps_path,
            hint="The two files must come from the same split and the same extraction run; "
            "re-create or re-download them together.",
        )
    return PrecompSplit(split, images, captions, im_div, ims_path=ims_path, caps_path=caps_path)


def _load_features(path: Path) -> np.ndarray:
    hint = "Expected a .npy array of shape (N_img, D) or (N_img, R, D); re-create or re-download it."
    try:
        # allow_pickle=False: a pickled file could run code and is not a feature array anyway.
        images = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise DatasetError(f"cannot read feature array ({err}).", path=path, hint=hint) from None
    if not isinstance(images, np.ndarray):  # np.load returns an NpzFile for zip archives
        raise DatasetError("is not a single .npy array (an .npz archive?).", path=path, hint=hint)
    if images.ndim not in (2, 3) or images.shape[0] == 0:
        raise DatasetError(f"feature array has shape {images.shape}.", path=path, hint=hint)
    if not np.issubdtype(images.dtype, np.number):
        raise DatasetError(f"feature array has non-numeric dtype {images.dtype}.", path=path, hint=hint)
    return images


def _read_captions(path: Path) -> list[str]:
    text = read_text(path, "caption file", "Re-save the file as UTF-8 text, one caption per line.")
    # split("\n"), not splitlines(): splitlines also breaks on characters such as \x1c or \u2028
    # that can occur inside a caption and would shift every later caption onto the wrong image.
    lines = [line.strip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()  # trailing newline(s) at end of file are not captions
    if not lines:
        raise DatasetError("caption file is empty.", path=path, hint="Re-create or re-download it.")
    for number, line in enumerate(lines, start=1):
        if not line:
            raise DatasetError(
                "empty caption line.",
                path=path,
                line=number,
                hint="Every line must hold one caption (5 consecutive lines per image); an empty line "
                "shifts all later captions onto the wrong image. Restore or remove the caption.",
            )
    return lines


def is_precomp(path: Path) -> bool:
    """A folder of {split}_ims.npy + {split}_caps.txt (and no Karpathy JSON to prefer)."""

    return path.is_dir() and bool(available_precomp_splits(path)) and not list(path.glob("dataset_*.json"))
