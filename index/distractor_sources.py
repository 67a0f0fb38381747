"""Distractor sources of an image index: the embedded benchmark's generator, a folder of images, an
(N, D) ``.npy`` of embeddings or an embeddings folder, each streamed chunk by chunk.

``Distractors`` says which source a build was given; ``distractor_stream`` turns it into a
``Stream`` (:mod:`index.gallery_streams`) whose rows follow the gallery's ids.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from icr.index.embeddings_layout import open_embeddings_folder
from icr.index.galleries import PhotoGallery
from icr.index.gallery_streams import Stream, progress_bar, timed
from icr.training.data.synthetic.generate import DistractorStream, render_workers
from icr.training.data.training_data import SplitData, synthetic_dir
from icr.training.embedding import embed_image_batch, open_embeddings, threads_beside_workers

# Distractor embeddings whose norms stray further from 1 were not L2-normalised.
NORM_TOL = 1e-3


@dataclass
class Distractors:
    """Where distractors come from: at most one of the generator (``count``), an embeddings
    file or folder, or an image folder."""

    count: int = 0
    embeddings: str | os.PathLike[str] | None = None
    images: str | os.PathLike[str] | None = None

    def check(self) -> None:
        if sum([bool(self.count), self.embeddings is not None, self.images is not None]) > 1:
            raise ValueError(
                "give one distractor source: --distractors N, --distractor-embeddings FILE|DIR or "
                "--distractor-images DIR"
            )
        if self.count < 0:
            raise ValueError(f"--distractors must be >= 0, got {self.count}")
        if self.embeddings is not None and not Path(self.embeddings).exists():
            raise FileNotFoundError(f"{self.embeddings}: distractor embeddings not found")
        if self.images is not None and not Path(self.images).is_dir():
            raise FileNotFoundError(f"{self.images}: distractor image folder not found")

    @property
    def source(self) -> str | None:
        for given in (self.embeddings, self.images):
            if given is not None:
                return str(given)
        return "generator" if self.count else None


def distractor_stream(
    model: Any,
    data: SplitData | None,
    given: Distractors,
    dim: int,
    batch_size: int,
    device: str,
    progress: bool,
) -> Stream | None:
    """The distractors ``given`` names as a stream, None when there are none. The generator's
    (``--distractors N``) match ``data``'s embedded benchmark and need it; the others need no split."""
    if given.images is not None:
        return _folder_distractors(model, Path(given.images), batch_size, device, progress)
    if given.embeddings is not None and Path(given.embeddings).is_dir():
        return _layout_distractors(Path(given.embeddings), dim, progress)
    if given.embeddings is not None:
        return _file_distractors(Path(given.embeddings), dim, batch_size * 16, progress)
    if given.count == 0:
        return None
    n = given.count

    directory = synthetic_dir(data) if data is not None else None
    if directory is None:
        raise ValueError(
            "--distractors N draws images from the embedded benchmark's generator; for your own data embed "
            "your distractor images first (icr embed) and pass --distractor-embeddings DIR"
        )

    stream = DistractorStream.for_dataset(directory, n)
    timings: dict[str, float] = {}
    workers = render_workers()

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with (
            progress_bar(n, "embedding distractors", progress) as bar,
            threads_beside_workers(workers, device),
        ):
            batches = stream.batches(batch_size, workers=workers)
            rendered = timed(batches, timings, "distractor_render_seconds")
            for ks, images, scenes in rendered:
                t0 = time.perf_counter()
                vectors = embed_image_batch(model, images, device=device)  # (b, D) from (b, S, S, 3) uint8
                timings["distractor_embed_seconds"] = timings.get("distractor_embed_seconds", 0.0) + (
                    time.perf_counter() - t0
                )
                rows = [
                    _distractor_row(f"distractor:{int(k)}", s.to_dict())
                    for k, s in zip(ks, scenes, strict=True)
                ]
                bar.update(len(rows))
                yield vectors, rows

    return Stream(chunks(), n, timings)


def _distractor_row(source: str, scene: dict[str, Any] | None = None) -> dict[str, Any]:
    """A distractor's metadata row (its id is assigned by :func:`index.gallery_streams.feed`)."""
    return {"source": source, "captions": [], "is_distractor": True, "scene": scene, "image_id": None}


def _folder_distractors(model: Any, folder: Path, batch_size: int, device: str, progress: bool) -> Stream:
    """Distractor images from a folder (see :mod:`index.photo_folder`); a file that does not decode
    stops the build with its name (nothing is replaced: the index is built in a temporary folder)."""
    photos = PhotoGallery(folder)
    timings: dict[str, float] = {}

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with progress_bar(photos.count, "embedding distractors", progress) as bar:
            batches = timed(
                photos.batches(model, 0, photos.count, batch_size, device),
                timings,
                "distractor_embed_seconds",
            )
            for batch in batches:
                rows = [_distractor_row(r["source"]) for r in batch.rows]
                bar.update(len(rows))
                yield batch.vectors, rows

    return Stream(chunks(), photos.count, timings)


def _file_distractors(path: Path, dim: int, chunk: int, progress: bool) -> Stream:
    """Distractors from an (N, D) .npy, memory-mapped and read chunk by chunk."""
    emb = open_embeddings(path, dim)  # (N, D) memory-mapped

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with progress_bar(len(emb), "reading distractor embeddings", progress) as bar:
            for lo in range(0, len(emb), chunk):
                vectors = np.ascontiguousarray(emb[lo : lo + chunk], dtype=np.float32)  # (b, D)
                norms = np.linalg.norm(vectors, axis=1)  # (b,)
                bad = np.flatnonzero(np.abs(norms - 1) > NORM_TOL)
                if len(bad):
                    raise ValueError(
                        f"{path}: row {lo + int(bad[0])} has norm {norms[bad[0]]:.4f}; distractor embeddings "
                        "must be L2-normalised (divide each row by its norm)"
                    )
                rows = [_distractor_row(f"distractor:{k}") for k in range(lo, lo + len(vectors))]
                bar.update(len(rows))
                yield vectors, rows

    return Stream(chunks(), len(emb))


def _layout_distractors(root: Path, dim: int, progress: bool) -> Stream:
    """Distractors from an embeddings folder (``icr embed`` or clip-retrieval layout), shard by
    shard; sources are the image paths its metadata records (``distractor:{k}`` without one), and
    its other metadata columns become the rows' captions and fields."""
    folder = open_embeddings_folder(root, dim)

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        k = 0
        with progress_bar(folder.count, "reading distractor embeddings", progress) as bar:
            for vectors, meta in folder.chunks():
                rows = []
                for m in meta:
                    row = _distractor_row(str(m.get("image_path") or f"distractor:{k}"))
                    # its caption, url and any other column are kept, as a gallery's are
                    row["captions"] = list(m.get("captions") or ([m["caption"]] if m.get("caption") else []))
                    row["fields"] = {
                        c: v for c, v in m.items() if c not in ("image_path", "caption", "captions")
                    }
                    rows.append(row)
                    k += 1
                bar.update(len(rows))
                yield vectors, rows

    return Stream(chunks(), folder.count)
