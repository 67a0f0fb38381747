"""Galleries a model embeds: a folder of the user's photos, a parquet list of image paths,
webdataset tar shards (:mod:`index.webdataset`), or a dataset split's images.

All yield, batch by batch over a range of their listing, the (b, D) embeddings and one row per
image: ``image_path`` (relative to the folder; absolute for a dataset), ``source`` (what the
service opens), ``captions``, ``fields`` (the user's metadata) and ``scene`` (embedded benchmark).
``icr embed`` writes them as shards; ``icr index build --images`` streams them into an index.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from icr.index.photo_folder import (
    ImageRef,
    PhotoMetadata,
    decode_batches,
    default_workers,
    list_photos,
    read_image_list,
    read_metadata,
)
from icr.index.webdataset import list_webdataset
from icr.training.data.karpathy import load_karpathy
from icr.training.data.synthetic.generate import load_scenes
from icr.training.data.training_data import open_split, synthetic_dir
from icr.training.embedding import embed_image_batch

UNMATCHED_SHOWN = 20  # metadata rows naming no image: how many the manifest and the CLI name


@dataclass
class Batch:
    vectors: np.ndarray  # (b, D) float32, unit rows
    rows: list[dict[str, Any]]  # b rows
    failed: list[tuple[str, str]] = field(default_factory=list)  # (image_path, error) left out


class Gallery(Protocol):
    count: int
    description: dict[str, Any]  # where the images come from (for manifests)

    def field_names(self) -> list[str]: ...

    def captions_complete(self) -> bool: ...

    def batches(self, model: Any, lo: int, hi: int, batch_size: int, device: str) -> Iterator[Batch]: ...


class FileGallery:
    """Images that are files (or byte ranges of files: tar members), each with its ``image_path``
    (``relative``) and the metadata keyed by it. Both ``icr embed`` engines read these: the local one
    through :meth:`batches`, the Ray one through ``refs`` and :meth:`row`."""

    refs: Sequence[Path | ImageRef]  # per image, listing order: what decodes it
    relative: list[str]  # per image: its image_path
    sources: list[str]  # per image: what the service opens (a path; tar#member for a tar)
    metadata: PhotoMetadata
    skip_bad: bool
    workers: int
    count: int
    description: dict[str, Any]

    def field_names(self) -> list[str]:
        return list(self.metadata.names)

    def captions_complete(self) -> bool:
        return all(self.metadata.captions.get(r) for r in self.relative)

    def row(self, j: int) -> dict[str, Any]:
        """The row of image ``j`` of the listing."""
        fields, captions = self.metadata.of(self.relative[j])
        return {
            "image_path": self.relative[j],
            "source": self.sources[j],
            "captions": captions,
            "fields": fields,
            "scene": None,
        }

    def batches(self, model: Any, lo: int, hi: int, batch_size: int, device: str) -> Iterator[Batch]:
        decoded = decode_batches(self.refs[lo:hi], batch_size, workers=self.workers, skip_bad=self.skip_bad)
        for part in decoded:
            vectors = (
                embed_image_batch(model, part.images, device=device)  # (b, D)
                if part.images
                else np.zeros((0, model.embed_dim), np.float32)
            )
            rows = [self.row(lo + p) for p in part.positions]
            failed = [(self.relative[lo + p], error) for p, error in part.failed]
            yield Batch(vectors, rows, failed)


class PhotoGallery(FileGallery):
    """Every image file under ``root`` with the optional metadata file's fields and captions."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        metadata: str | os.PathLike[str] | None = None,
        *,
        skip_bad: bool = False,
        workers: int | None = None,
    ) -> None:
        self.root = Path(root).resolve()
        self.paths = list_photos(self.root)
        self.refs = self.paths
        self.relative = [p.relative_to(self.root).as_posix() for p in self.paths]
        self.sources = [str(p) for p in self.paths]
        self.metadata = read_metadata(metadata)
        self.skip_bad = skip_bad
        self.workers = workers or default_workers()
        self.count = len(self.paths)
        unmatched = self.metadata.unmatched(self.relative)
        self.description = {
            "kind": "images",
            "path": str(self.root),
            "metadata": None if metadata is None else str(Path(metadata).resolve()),
            "metadata_unmatched": len(unmatched),
            # named, not only counted: a typo in a metadata row's path is found by its name
            "metadata_unmatched_files": unmatched[:UNMATCHED_SHOWN],
        }


class ImageListGallery(FileGallery):
    """The images a parquet file lists, in its row order: a path column (``file``, ``path``,
    ``image_path`` or ``filename``; relative to the parquet's folder, or absolute) is each image's
    ``image_path``; ``caption`` / ``captions`` columns its captions; any other column a field."""

    def __init__(
        self, path: str | os.PathLike[str], *, skip_bad: bool = False, workers: int | None = None
    ) -> None:
        self.path = Path(path).resolve()
        self.relative, self.metadata = read_image_list(self.path)
        self.paths = [self.path.parent / r for r in self.relative]  # an absolute r stays as is
        self.refs = self.paths
        self.sources = [str(p) for p in self.paths]
        self.skip_bad = skip_bad
        self.workers = workers or default_workers()
        self.count = len(self.paths)
        self.description = {"kind": "image_list", "path": str(self.path)}


class WebDatasetGallery(FileGallery):
    """The image samples of webdataset tar shards (see :mod:`index.webdataset`): the key is the
    ``image_path``, ``{key}.txt`` the caption, ``{key}.json`` the fields."""

    def __init__(
        self, source: str | os.PathLike[str], *, skip_bad: bool = False, workers: int | None = None
    ) -> None:
        listing = list_webdataset(source)
        self.tars = listing.tars
        self.refs = listing.refs
        self.relative = listing.keys
        self.sources = [f"{ref.path}#{ref.name.removeprefix(ref.path + '/')}" for ref in listing.refs]
        self.metadata = listing.metadata
        self.skip_bad = skip_bad
        self.workers = workers or default_workers()
        self.count = len(self.refs)
        self.description = {
            "kind": "webdataset",
            "path": str(Path(source).resolve()),  # a glob stays a glob, made absolute
            "tars": [t.name for t in self.tars],
            "without_image": listing.without_image,
        }


class SplitGallery:
    """The images of a dataset split (Karpathy JSON, precomp, or the embedded benchmark)."""

    def __init__(
        self, data: str | os.PathLike[str], split: str, captions_per_image: int, progress: bool
    ) -> None:
        self.data = open_split(Path(data), split, captions_per_image=captions_per_image, progress=progress)
        if self.data.num_images == 0:
            raise ValueError(f"{data}: split {split!r} has no images")
        self.sources, self.scenes = image_sources(self.data)
        self.caption_ids = self.data.captions_of_images()
        self.count = self.data.num_images
        self.description = {"kind": self.data.kind, "path": str(data), "split": split}

    def field_names(self) -> list[str]:
        return []

    def captions_complete(self) -> bool:
        return all(len(c) for c in self.caption_ids)

    def batches(self, model: Any, lo: int, hi: int, batch_size: int, device: str) -> Iterator[Batch]:
        for start in range(lo, hi, batch_size):
            ids = range(start, min(start + batch_size, hi))
            vectors = embed_image_batch(model, [self.data.get_image(i) for i in ids], device=device)  # (b, D)
            rows = [
                {
                    "image_path": self.sources[i],
                    "source": self.sources[i],
                    "captions": [self.data.captions[c] for c in self.caption_ids[i]],
                    "fields": {},
                    "scene": self.scenes[i] if self.scenes is not None else None,
                }
                for i in ids
            ]
            yield Batch(vectors, rows)


def image_sources(data: Any) -> tuple[list[str], list[dict[str, Any]] | None]:
    """Per split image: its source (absolute path, or precomp file and row) and scene dict if synthetic."""
    if data.kind == "precomp":
        features = Path(data.source) / f"{data.name}_ims.npy"
        return [f"{features}#{i}" for i in range(data.num_images)], None

    records = load_karpathy(data.source).split(data.name).images
    scenes = None
    directory = synthetic_dir(data)
    if directory is not None:
        by_imgid = load_scenes(directory).by_imgid
        scenes = [by_imgid[r.imgid].to_dict() for r in records]
    # absolute: the service opens these files from wherever it runs
    return [str(Path(r.path).resolve()) for r in records], scenes
