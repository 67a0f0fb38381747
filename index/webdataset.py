"""Webdataset tar shards as a gallery listing (``icr embed --webdataset``).

A source is a folder (every ``*.tar`` under it, recursive), a glob (``shards/*.tar``) or one
``.tar`` file; shards are read in sorted order and members in tar order. A sample is the members
sharing a key (the member name up to the first dot of its file name, webdataset's convention):
``{key}.jpg|png|webp`` (any extension of :func:`photo_suffixes`) is the image, an optional
``{key}.txt`` its caption and an optional ``{key}.json`` object its fields (a ``caption`` or
``captions`` entry there adds captions). The key is the image's ``image_path``; keys must be unique
across the shards. Samples with no image member are left out (counted in the description).

Tars must be uncompressed: an image is read as a byte range of its shard (no extraction), so any
worker decodes any image independently.
"""

from __future__ import annotations

import glob
import json
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icr.index.photo_folder import ImageRef, PhotoMetadata, _keyed, photo_suffixes

# webdataset's split of a member name: key (up to the first dot of the file name), extension
_MEMBER = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
_KEY = "__key__"  # the key column of the rows handed to the metadata reader (never a field)


@dataclass
class WebDatasetListing:
    tars: list[Path]
    keys: list[str] = field(default_factory=list)  # per image, listing order
    refs: list[ImageRef] = field(default_factory=list)  # per image: its bytes in its shard
    metadata: PhotoMetadata = field(default_factory=PhotoMetadata)
    without_image: int = 0  # samples with no image member, left out


def find_tars(source: str | os.PathLike[str]) -> list[Path]:
    """The shards of ``source`` (folder, glob or .tar), sorted; ValueError/FileNotFoundError if none."""
    text = str(source)
    if any(c in text for c in "*?["):
        tars = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
    elif Path(text).is_dir():
        tars = sorted((p for p in Path(text).rglob("*.tar") if p.is_file()), key=lambda p: p.as_posix())
    elif Path(text).is_file():
        tars = [Path(text)]
    else:
        raise FileNotFoundError(f"{text}: no such webdataset folder, .tar file or glob")
    if not tars:
        raise ValueError(f"{text}: no .tar shards (give a folder of .tar files, a glob or one .tar)")
    return [t.resolve() for t in tars]


def list_webdataset(source: str | os.PathLike[str]) -> WebDatasetListing:
    """Every sample with an image in the shards of ``source``, in shard then member order."""
    suffixes = {s.removeprefix(".") for s in photo_suffixes()}
    out = WebDatasetListing(find_tars(source))
    samples: dict[str, dict[str, Any]] = {}  # key -> {"txt": caption, "json": fields}, every sample
    owner: dict[str, Path] = {}
    images: dict[str, ImageRef] = {}
    for tar in out.tars:
        seen: set[str] = set()
        try:
            with tarfile.open(tar, "r:") as handle:
                for member in handle:
                    match = _MEMBER.match(member.name.removeprefix("./"))
                    if not member.isfile() or match is None:
                        continue
                    key, ext = match.group(1), match.group(2).lower()
                    if key not in seen and key in owner:
                        raise ValueError(
                            f"{tar}: sample {key!r} is also in {owner[key]}; keys must be unique "
                            "across the shards"
                        )
                    seen.add(key)
                    owner[key] = tar
                    sample = samples.setdefault(key, {})
                    if ext in suffixes and key not in images:
                        images[key] = ImageRef(
                            str(tar), member.offset_data, member.size, f"{tar}/{member.name}"
                        )
                    elif ext in ("txt", "json"):
                        sample[ext] = _read_text_member(handle, member, tar, ext)
        except tarfile.ReadError as err:
            raise ValueError(
                f"{tar}: not an uncompressed tar ({err}); webdataset shards are read in place, so "
                "decompress .tar.gz shards first"
            ) from None
    keys = [k for k in samples if k in images]
    out.without_image = len(samples) - len(keys)
    if not keys:
        raise ValueError(f"{source}: no sample has an image member ({', '.join(sorted(suffixes)[:8])}, ...)")
    out.metadata = _keyed([_row(k, samples[k]) for k in keys], str(source), key=_KEY)
    out.keys = list(out.metadata.fields)  # the keys as the metadata reader normalised them, same order
    out.refs = [images[k] for k in keys]
    return out


def _row(key: str, sample: dict[str, Any]) -> dict[str, Any]:
    """The metadata row of a sample: its JSON fields and its captions (.txt first, then the JSON's)."""
    fields = dict(sample.get("json", {}))
    captions = [sample["txt"]] if sample.get("txt") else []
    caption, more = fields.pop("caption", None), fields.pop("captions", None)
    if caption is not None:
        captions.append(str(caption))
    if isinstance(more, list):
        captions += [str(c) for c in more]
    elif more is not None:
        captions.append(str(more))
    return {**fields, **({"captions": captions} if captions else {}), _KEY: key}


def _read_text_member(handle: tarfile.TarFile, member: tarfile.TarInfo, tar: Path, ext: str) -> Any:
    """A ``.txt`` member's caption (stripped) or a ``.json`` member's object of fields."""
    extracted = handle.extractfile(member)
    assert extracted is not None  # a regular file
    try:
        text = extracted.read().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{tar}/{member.name}: not UTF-8 text ({err})") from None
    if ext == "txt":
        return text.strip()
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{tar}/{member.name}: not JSON ({err.msg})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{tar}/{member.name}: a JSON object of fields, got {type(fields).__name__}")
    return fields
