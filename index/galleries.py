"""Galleries a model embeds: a folder of the user's photos, or a dataset split's images.

Both yield, batch by batch over a range of their listing, the (b, D) embeddings and one row per
image: ``image_path`` (relative to the folder; absolute for a dataset), ``source`` (what the
service opens), ``captions``, ``fields`` (the user's metadata) and ``scene`` (embedded benchmark).
``icr embed`` writes them as shards; ``icr index build --images`` streams them into an index.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from icr.index.photo_folder import PhotoMetadata, decode_batches, default_workers, list_photos, read_metadata


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


class PhotoGallery:
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
        self.relative = [p.relative_to(self.root).as_posix() for p in self.paths]
        self.metadata: PhotoMetadata = read_metadata(metadata)
        self.skip_bad = skip_bad
        self.workers = workers or default_workers()
        self.count = len(self.paths)
        self.description = {
            "kind": "images",
            "path": str(self.root),
            "metadata": None if metadata is None else str(Path(metadata).resolve()),
            "metadata_unmatched": len(self.metadata.unmatched(self.relative)),
        }

    def field_names(self) -> list[str]:
        return list(self.metadata.names)

    def captions_complete(self) -> bool:
        return all(self.metadata.captions.get(r) for r in self.relative)

    def batches(self, model: Any, lo: int, hi: int, batch_size: int, device: str) -> Iterator[Batch]:
        from icr.training.embedding import embed_image_batch

        decoded = decode_batches(self.paths[lo:hi], batch_size, workers=self.workers, skip_bad=self.skip_bad)
        for part in decoded:
            positions = [lo + p for p in part.positions]
            vectors = (
                embed_image_batch(model, part.images, device=device)  # (b, D)
                if part.images
                else np.zeros((0, model.embed_dim), np.float32)
            )
            rows = []
            for j in positions:
                fields, captions = self.metadata.of(self.relative[j])
                rows.append(
                    {
                        "image_path": self.relative[j],
                        "source": str(self.paths[j]),
                        "captions": captions,
                        "fields": fields,
                        "scene": None,
                    }
                )
            failed = [(self.relative[lo + p], error) for p, error in part.failed]
            yield Batch(vectors, rows, failed)


class SplitGallery:
    """The images of a dataset split (Karpathy JSON, precomp, or the embedded benchmark)."""

    def __init__(
        self, data: str | os.PathLike[str], split: str, captions_per_image: int, progress: bool
    ) -> None:
        from icr.training.data.training_data import open_split

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
        from icr.training.embedding import embed_image_batch

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
    from icr.training.data.karpathy import load_karpathy
    from icr.training.data.training_data import synthetic_dir

    records = load_karpathy(data.source).split(data.name).images
    scenes = None
    directory = synthetic_dir(data)
    if directory is not None:
        from icr.training.data.synthetic.generate import load_scenes

        by_imgid = load_scenes(directory).by_imgid
        scenes = [by_imgid[r.imgid].to_dict() for r in records]
    # absolute: the service opens these files from wherever it runs
    return [str(Path(r.path).resolve()) for r in records], scenes
