"""Loader for Karpathy-split caption datasets and their image folders.

Reads ``dataset_flickr30k.json``, ``dataset_coco.json`` and our ``dataset_synthetic.json``
(same format). Retrieval evaluation (VSE++ protocol) assumes captions ``5i..5i+4`` belong to
image ``i``, so the grouping is enforced here, at the boundary: one image with too few captions
would otherwise shift every later caption onto the wrong image without any visible error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from icr.core.image_input import GALLERY_FORMATS, ImageLimits, ImageRefused, open_image
from icr.training.data.errors import DatasetError, line_of, parse_json, read_text
from icr.training.data.vocab import tokenize

# Canonical order in which splits are listed; other split names follow in order of appearance.
_SPLIT_ORDER = ("train", "restval", "val", "test")
_REQUIRED_KEYS = ("filename", "split", "sentences")
_SHOW_MISSING = 5


@dataclass(frozen=True)
class ImageRecord:
    """One image and its captions (exactly ``captions_per_image``, the first ones in file order)."""

    imgid: int
    filename: str
    path: Path
    split: str  # split it is loaded into ("train" for folded COCO restval)
    source_split: str  # split named in the JSON ("restval" stays "restval")
    captions: tuple[str, ...]
    tokens: tuple[tuple[str, ...], ...]
    sentids: tuple[int, ...]
    cocoid: int | None = None


@dataclass
class CaptionSplit:
    """One split; caption ``k*i .. k*i+k-1`` belongs to image ``i`` (k = captions_per_image = 5)."""

    name: str
    images: list[ImageRecord]
    captions_per_image: int = 5

    @property
    def captions(self) -> list[str]:
        """All captions, grouped by image in image order (length ``5 * len(self)``)."""
        return [caption for record in self.images for caption in record.captions]

    @property
    def caption_tokens(self) -> list[list[str]]:
        """Token lists aligned with :attr:`captions`."""
        return [list(tokens) for record in self.images for tokens in record.tokens]

    @property
    def num_captions(self) -> int:
        return len(self.images) * self.captions_per_image

    def image_of_caption(self, c: int) -> int:
        """Index (in this split) of the image caption ``c`` describes."""
        if not 0 <= c < self.num_captions:
            raise IndexError(
                f"caption index {c} out of range [0, {self.num_captions}) in split {self.name!r}"
            )
        return c // self.captions_per_image

    def __len__(self) -> int:
        return len(self.images)


@dataclass
class KarpathyDataset:
    name: str
    json_path: Path
    image_root: Path
    splits: dict[str, CaptionSplit] = field(default_factory=dict)

    def split(self, name: str) -> CaptionSplit:
        try:
            return self.splits[name]
        except KeyError:
            available = ", ".join(repr(s) for s in self.splits) or "none"
            hint = ""
            if name == "restval" and "train" in self.splits:
                hint = "COCO restval is folded into 'train' by default; load with fold_restval=False."
            raise DatasetError(
                f"no split {name!r} in this dataset (available: {available}).", path=self.json_path, hint=hint
            ) from None


def find_karpathy_json(directory: str | os.PathLike[str]) -> Path:
    """The single ``dataset_*.json`` in ``directory`` (a file path is returned unchanged)."""
    folder = Path(directory).expanduser()
    if folder.is_file():
        return folder
    if not folder.is_dir():
        raise DatasetError(
            "dataset folder not found.",
            path=folder,
            hint="Pass the folder holding dataset_*.json, or the file.",
        )
    found = sorted(folder.glob("dataset_*.json"))
    if len(found) == 1:
        return found[0]
    if not found:
        others = sorted(p.name for p in folder.glob("*.json"))
        listing = f" (JSON files here: {', '.join(others)})" if others else ""
        raise DatasetError(
            f"no Karpathy split file dataset_*.json in this folder{listing}.",
            path=folder,
            hint="Put dataset_flickr30k.json / dataset_coco.json here (from Karpathy's caption_datasets.zip) "
            "or pass the JSON file itself.",
        )
    raise DatasetError(
        f"several Karpathy split files in this folder: {', '.join(p.name for p in found)}.",
        path=folder,
        hint="Pass the one you mean as the JSON path.",
    )


def load_karpathy(
    json_path: str | os.PathLike[str],
    image_root: str | os.PathLike[str] | None = None,
    *,
    fold_restval: bool = True,
    captions_per_image: int = 5,
    check_images: bool = True,
) -> KarpathyDataset:
    """Load a Karpathy JSON (or the folder holding it) into per-split image records.

    ``image_root`` defaults to the JSON's folder; an image's path is
    ``image_root / filepath / filename`` (COCO: filepath is train2014/val2014) or
    ``image_root / filename``. COCO ``restval`` joins ``train`` when ``fold_restval`` (the
    standard 113,287-image training set). Images with more captions keep the first
    ``captions_per_image``; fewer is an error. With ``check_images`` every image file must exist
    (existence only; :func:`verify_images` decodes them).
    """
    if captions_per_image < 1:
        raise ValueError(f"captions_per_image must be >= 1, got {captions_per_image}")
    json_path = Path(json_path).expanduser()
    if json_path.is_dir():
        json_path = find_karpathy_json(json_path)
    hint = (
        "Check the path (Karpathy split files are named dataset_flickr30k.json / dataset_coco.json); "
        "a truncated or hand-edited file must be re-downloaded or regenerated."
    )
    text = read_text(json_path, "dataset JSON", hint)
    data = parse_json(text, json_path, "dataset JSON", hint)
    entries = _image_entries(data, json_path)
    root = Path(image_root).expanduser() if image_root is not None else json_path.parent

    by_split: dict[str, list[ImageRecord]] = {}
    for index, entry in enumerate(entries):
        record = _parse_entry(entry, index, text, json_path, root, captions_per_image, fold_restval)
        by_split.setdefault(record.split, []).append(record)

    ordered = [s for s in _SPLIT_ORDER if s in by_split] + [s for s in by_split if s not in _SPLIT_ORDER]
    splits = {name: CaptionSplit(name, by_split[name], captions_per_image) for name in ordered}
    if check_images:
        _check_image_files([r for s in splits.values() for r in s.images], json_path, root)

    name = data.get("dataset")
    if not isinstance(name, str) or not name:
        name = _dataset_name(json_path)
    return KarpathyDataset(name=name, json_path=json_path, image_root=root, splits=splits)


def load_image(path: str | os.PathLike[str]) -> Image.Image:
    """Decode an image file as RGB; DatasetError naming the file if it is missing or undecodable."""
    path = Path(path)
    try:
        # the same bounds as uploads: a gallery folder is input nobody checked either
        return open_image(path, ImageLimits(formats=GALLERY_FORMATS))
    except FileNotFoundError:
        raise DatasetError(
            "image file not found.", path=path, hint="Check the image folder (image_root) for this dataset."
        ) from None
    except (ImageRefused, OSError) as err:
        hint = (
            "The file is corrupt or not an image; re-download it or remove it from the dataset."
            if getattr(err, "reason", "corrupt") in ("corrupt", "format")
            else "Crop or downscale it, or remove it from the dataset."
        )
        raise DatasetError(f"cannot decode image ({err}).", path=path, hint=hint) from None


def verify_images(split_or_records: CaptionSplit | Iterable[ImageRecord], progress: bool = False) -> int:
    """Decode every image; raise one DatasetError listing every file that fails.

    Returns the number of images checked. Meant as an explicit pre-flight step: a single
    corrupt JPEG otherwise crashes a data-loader worker hours into training.
    """
    records = (
        split_or_records.images if isinstance(split_or_records, CaptionSplit) else list(split_or_records)
    )
    failures: list[str] = []
    for record in _maybe_progress(records, progress):
        try:
            load_image(record.path)
        except DatasetError as err:
            failures.append(f"{err.path}: {err.detail}")  # one shared hint below, not one per file
    if failures:
        listing = "\n".join(f"  {line}" for line in failures)
        raise DatasetError(
            f"{len(failures)} of {len(records)} images failed to load:\n{listing}\n"
            "Re-download these files or remove their entries from the dataset JSON."
        )
    return len(records)


# --------------------------------------------------------------------------- internals


def _maybe_progress(records: list[ImageRecord], progress: bool) -> Iterator[ImageRecord]:
    if progress:
        yield from tqdm(records, desc="verify images", unit="img")
        return
    yield from records


def _image_entries(data: Any, json_path: Path) -> list[Any]:
    hint = 'Expected the Karpathy format {"dataset": name, "images": [...]}.'
    if not isinstance(data, dict) or "images" not in data:
        raise DatasetError('missing top-level "images" list.', path=json_path, hint=hint)
    entries = data["images"]
    if not isinstance(entries, list):
        raise DatasetError(
            f'top-level "images" is a {type(entries).__name__}, not a list.', path=json_path, hint=hint
        )
    if not entries:
        raise DatasetError('"images" is empty: the dataset has no images.', path=json_path, hint=hint)
    return entries


def _entry_line(text: str, filename: Any) -> int | None:
    # Karpathy filenames are unique per entry, so the quoted filename locates the entry.
    if isinstance(filename, str) and filename:
        return line_of(text, json.dumps(filename, ensure_ascii=False))
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(
    entry: Any,
    index: int,
    text: str,
    json_path: Path,
    root: Path,
    captions_per_image: int,
    fold_restval: bool,
) -> ImageRecord:
    fix = "Fix or remove this entry (Karpathy format: filename, split, sentences[{raw, tokens}])."
    if not isinstance(entry, dict):
        raise DatasetError(
            f"image entry {index} is a {type(entry).__name__}, not a JSON object.", path=json_path, hint=fix
        )
    filename = entry.get("filename")
    label = f"image entry {index}" + (f" ({filename!r})" if isinstance(filename, str) else "")

    def fail(problem: str, hint: str = fix) -> DatasetError:
        # The line is looked up only on failure: a search per entry would make loading COCO
        # (123k entries in one 100 MB text) quadratic.
        return DatasetError(f"{label} {problem}", path=json_path, line=_entry_line(text, filename), hint=hint)

    missing = [key for key in _REQUIRED_KEYS if key not in entry]
    if missing:
        raise fail(f"is missing required key(s) {', '.join(repr(k) for k in missing)}.")
    if not isinstance(filename, str) or not filename:
        raise fail(f'has an invalid "filename" {filename!r} (expected a non-empty string).')
    source_split = entry["split"]
    if not isinstance(source_split, str) or not source_split:
        raise fail(f'has an invalid "split" {source_split!r} (expected e.g. "train", "val", "test").')
    sentences = entry["sentences"]
    if not isinstance(sentences, list):
        raise fail(f'has "sentences" of type {type(sentences).__name__}, expected a list.')
    if len(sentences) < captions_per_image:
        raise fail(
            f"in split {source_split!r} has {len(sentences)} caption(s); every image needs at least "
            f"{captions_per_image}.",
            hint=f"Captions are grouped {captions_per_image} per image (captions {captions_per_image}i.."
            f"{captions_per_image}i+{captions_per_image - 1} belong to image i), so a short image would "
            "shift every later caption onto the wrong image. Add the missing captions or remove the entry.",
        )

    imgid = entry.get("imgid", index)  # Karpathy's imgid is the running index anyway
    if not _is_int(imgid):
        raise fail(f'has a non-integer "imgid" {imgid!r}.')
    cocoid = entry.get("cocoid")
    if cocoid is not None and not _is_int(cocoid):
        raise fail(f'has a non-integer "cocoid" {cocoid!r}.')
    entry_sentids = entry.get("sentids")
    entry_sentids = entry_sentids if isinstance(entry_sentids, list) else []

    captions: list[str] = []
    tokens: list[tuple[str, ...]] = []
    sentids: list[int] = []
    for j, sentence in enumerate(sentences[:captions_per_image]):
        raw = sentence.get("raw") if isinstance(sentence, dict) else None
        if not isinstance(raw, str):
            raise fail(f'has sentence {j} without a "raw" caption string.')
        captions.append(raw.strip())
        given = sentence.get("tokens")
        if isinstance(given, list) and all(isinstance(t, str) for t in given):
            tokens.append(tuple(given))
        else:
            tokens.append(tuple(tokenize(raw)))
        sentid = sentence.get("sentid", entry_sentids[j] if j < len(entry_sentids) else None)
        sentids.append(sentid if _is_int(sentid) else imgid * captions_per_image + j)

    filepath = entry.get("filepath") or ""
    if not isinstance(filepath, str):
        raise fail(f'has a non-string "filepath" {filepath!r}.')
    split = "train" if fold_restval and source_split == "restval" else source_split
    return ImageRecord(
        imgid=imgid,
        filename=filename,
        path=root / filepath / filename if filepath else root / filename,
        split=split,
        source_split=source_split,
        captions=tuple(captions),
        tokens=tuple(tokens),
        sentids=tuple(sentids),
        cocoid=cocoid,
    )


def _check_image_files(records: list[ImageRecord], json_path: Path, root: Path) -> None:
    missing = [r.path for r in records if not r.path.is_file()]
    if not missing:
        return
    shown = "\n".join(f"  {p}" for p in missing[:_SHOW_MISSING])
    more = f"\n  ... and {len(missing) - _SHOW_MISSING} more" if len(missing) > _SHOW_MISSING else ""
    where = f"the image folder {root} does not exist" if not root.is_dir() else f"looked under {root}"
    raise DatasetError(
        f"{len(missing)} of {len(records)} image files referenced by this JSON are missing ({where}):\n"
        f"{shown}{more}\n",
        path=json_path,
        hint="Pass the folder that holds the images as image_root (for COCO, the folder containing "
        "train2014/ and val2014/), or check_images=False to load the captions only.",
    )


def _dataset_name(json_path: Path) -> str:
    stem = json_path.stem
    return stem[len("dataset_") :] if stem.startswith("dataset_") else stem
