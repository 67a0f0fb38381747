"""A folder of the user's own photos as a gallery: listing, metadata files, parallel decoding.

``icr index build --images DIR [--metadata FILE]`` and ``icr embed --images DIR`` read:

- every file under DIR (recursive, sorted by relative path) with the extension of a common photo
  format (:func:`photo_formats`: JPEG, PNG, WebP, GIF, BMP, TIFF, PPM); a file whose content is in
  another format (EPS, which runs Ghostscript, PSD, ICO...) is refused naming it and these formats;
- an optional metadata file keyed by the file's path relative to DIR: JSON lines, CSV or Parquet
  with a key column named ``file``, ``path``, ``image_path`` or ``filename`` and any other columns,
  stored with each image and returned with each hit. A ``caption`` (text) or ``captions`` (list)
  column becomes the image's captions.

Decoding runs in a thread pool (PIL releases the GIL while it decodes). A file that does not
decode stops the build naming it, unless ``skip_bad``: then it is left out and listed.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from icr.core.image_input import GALLERY_FORMATS, ImageLimits, ImageRefused, open_image
from icr.index.filters import check_field_name
from icr.training.data.errors import DatasetError

KEY_COLUMNS = ("file", "path", "image_path", "filename")
CAPTION_COLUMNS = ("caption", "captions")
METADATA_SUFFIXES = (".jsonl", ".ndjson", ".csv", ".parquet")


def photo_formats() -> tuple[str, ...]:
    """The formats a gallery may hold: an allow-list (``GALLERY_FORMATS``), not every format PIL
    opens, since some of those run external programs (EPS) and most are no photos."""
    return GALLERY_FORMATS


def photo_suffixes() -> frozenset[str]:
    """File extensions (lower case, with the dot) of :func:`photo_formats`."""
    formats = set(photo_formats())
    return frozenset(ext for ext, fmt in Image.registered_extensions().items() if fmt in formats)


def list_photos(root: str | os.PathLike[str]) -> list[Path]:
    """Image files under ``root``, recursive, sorted by relative path; ValueError if none."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: image folder not found")
    suffixes = photo_suffixes()
    paths = sorted(
        (p for p in root.rglob("*") if p.suffix.lower() in suffixes and p.is_file()),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not paths:
        raise ValueError(f"{root}: no image files (looked for {', '.join(sorted(suffixes)[:12])}, ...)")
    return paths


@dataclass
class PhotoMetadata:
    """The user's metadata per relative path: ``fields`` (filterable) and ``captions``."""

    fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    captions: dict[str, list[str]] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # field names, in file order
    source: str | None = None

    def of(self, relative: str) -> tuple[dict[str, Any], list[str]]:
        return self.fields.get(relative, {}), self.captions.get(relative, [])

    def unmatched(self, relatives: Sequence[str]) -> list[str]:
        """Keys of the metadata file that name no listed image (a typo or a missing file)."""
        present = set(relatives)
        return sorted(k for k in self.fields if k not in present)


def read_metadata(path: str | os.PathLike[str] | None) -> PhotoMetadata:
    """Read a metadata file (see the module doc); errors name the file, the row and the fix."""
    if path is None:
        return PhotoMetadata()
    path = Path(path)
    return _keyed(read_rows(path, "metadata"), str(path))


def read_rows(path: Path, what: str) -> list[dict[str, Any]]:
    """The rows of a jsonl, csv or parquet file (``what`` names it in errors: "metadata", "labels")."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {what} file not found")
    suffix = path.suffix.lower()
    if suffix not in METADATA_SUFFIXES:
        raise ValueError(
            f"{path}: {what} must be {', '.join(METADATA_SUFFIXES)}, not {suffix or 'no suffix'}"
        )
    return _read_jsonl(path) if suffix in (".jsonl", ".ndjson") else _read_table(path)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not JSON ({err.msg}); one object per line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: a JSON object per line, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_table(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa  # noqa: PLC0415 (pyarrow: only the embeddings and metadata-file paths need it)

    try:
        if path.suffix.lower() == ".csv":
            from pyarrow import csv  # noqa: PLC0415 (pyarrow: only the embeddings and metadata-file paths need it)

            table = csv.read_csv(path)  # infers integer, float and boolean columns
        else:
            from pyarrow import parquet  # noqa: PLC0415 (pyarrow: only the embeddings and metadata-file paths need it)

            table = parquet.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(f"{path}: cannot read this table ({err})") from None
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def _json_value(value: Any) -> Any:
    """A value JSON can store: dates and other objects as their text; NaN as null."""
    if isinstance(value, float) and value != value:
        return None
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    return str(value)


def _keyed(rows: list[dict[str, Any]], source: str, key: str | None = None) -> PhotoMetadata:
    """Rows keyed by their ``key`` column (default: the first of :data:`KEY_COLUMNS` present); the
    keys keep the rows' order (``fields``' insertion order)."""
    out = PhotoMetadata(source=source)
    if not rows:
        return out
    key = key or next((k for k in KEY_COLUMNS if k in rows[0]), None)
    if key is None:
        raise ValueError(
            f"{source}: no key column; name the column holding each image's path relative to the "
            f"folder one of: {', '.join(KEY_COLUMNS)} (found: {', '.join(map(str, rows[0]))})"
        )
    names: dict[str, None] = {}
    for n, row in enumerate(rows, 1):
        relative = row.get(key)
        if not isinstance(relative, str) or not relative.strip():
            raise ValueError(
                f"{source}: row {n}: {key!r} must be the image's relative path, got {relative!r}"
            )
        relative = Path(relative.strip()).as_posix().removeprefix("./")
        if relative in out.fields:
            raise ValueError(f"{source}: row {n}: {relative!r} appears twice; one row per image")
        fields: dict[str, Any] = {}
        for name, value in row.items():
            if name == key:
                continue
            if name == "caption" and isinstance(value, str):
                out.captions.setdefault(relative, []).append(value)
            elif name == "captions" and isinstance(value, list):
                out.captions.setdefault(relative, []).extend(str(v) for v in value)
            else:
                names[check_field_name(name, f"{source}: row {n}")] = None
                fields[name] = _json_value(value)
        out.fields[relative] = fields
    out.names = list(names)
    return out


def read_image_list(path: str | os.PathLike[str]) -> tuple[list[str], PhotoMetadata]:
    """A parquet list of images: (their paths as written, in row order; the other columns as
    metadata keyed by those paths). The path column is named as in a metadata file (KEY_COLUMNS)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: image list not found")
    if path.suffix.lower() != ".parquet":
        raise ValueError(f"{path}: an image list is a .parquet file with a column of image paths")
    metadata = _keyed(_read_table(path), str(path))
    if not metadata.fields:
        raise ValueError(f"{path}: no rows; list one image path per row")
    return list(metadata.fields), metadata


# --- decoding -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageRef:
    """An image's bytes: the whole file at ``path``, or ``size`` bytes at ``offset`` of it (a tar
    member, named ``name`` in errors)."""

    path: str
    offset: int = 0
    size: int = -1
    name: str = ""


@functools.cache
def _limits() -> Any:
    return ImageLimits(formats=photo_formats())


_HINT = "Fix or remove the file, or pass --skip-bad to leave such files out."


def left_out(error: str) -> str:
    """A file's decode error as recorded when ``--skip-bad`` left it out: the file and what is wrong,
    without the hint to pass ``--skip-bad`` (it was passed)."""
    return error.removesuffix(" " + _HINT)


def decode_image(item: Path | ImageRef) -> Any:
    """The RGB PIL image of ``item``, or the DatasetError (naming it) that says why not; never raises
    for a bad file. Accepted formats: :func:`photo_formats`."""
    limits = _limits()
    path = item if isinstance(item, Path) else Path(item.path)
    name: str | Path = path
    source: Path | bytes = path
    try:
        if isinstance(item, ImageRef) and item.size >= 0:
            name = item.name or f"{item.path}@{item.offset}"
            with open(item.path, "rb") as handle:
                handle.seek(item.offset)
                source = handle.read(item.size)
            if len(source) != item.size:
                raise OSError(f"{item.path} ends before byte {item.offset + item.size}")
        return open_image(source, limits)
    except ImageRefused as err:  # says which limit, or for a format the accepted ones
        return DatasetError(f"cannot decode image ({err}).", path=name, hint=_HINT)
    except OSError as err:
        return DatasetError(f"cannot read image ({err}).", path=name, hint=_HINT)


@dataclass
class Decoded:
    """One batch: the images that decoded (with their positions in the listing) and those that failed."""

    positions: list[int]
    images: list[Any]  # PIL images, RGB
    failed: list[tuple[int, str]]  # (position, error message naming the file)


def decode_batches(
    paths: Sequence[Path | ImageRef], batch_size: int, *, workers: int, skip_bad: bool
) -> Iterator[Decoded]:
    """Decode ``paths`` in listing order, ``batch_size`` at a time, on ``workers`` threads. A file
    that fails raises its DatasetError (naming it) unless ``skip_bad``."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for lo in range(0, len(paths), batch_size):
            batch = Decoded([], [], [])
            for j, result in enumerate(pool.map(decode_image, paths[lo : lo + batch_size])):
                if isinstance(result, DatasetError):
                    if not skip_bad:
                        raise result
                    batch.failed.append((lo + j, left_out(str(result))))
                else:
                    batch.positions.append(lo + j)
                    batch.images.append(result)
            yield batch


def default_workers() -> int:
    return min(8, os.cpu_count() or 1)
