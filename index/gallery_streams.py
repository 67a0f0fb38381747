"""The embedding streams an index build consumes: the ``Stream`` type, ``feed``, and the gallery
streams (a split's images or captions, a photo folder, an ``icr embed`` folder).

Each stream yields ``((b, D) float32 vectors, b metadata rows)`` chunk by chunk, so a gallery never
sits in memory at once. ``index.build`` writes them into an index directory, and
``index.distractor_sources`` streams the distractors that follow the gallery; they share ``Stream``,
``timed`` and ``progress_bar`` from here, which imports neither of them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from icr.index.embeddings_layout import open_embeddings_folder, row_parts
from icr.index.galleries import PhotoGallery, image_sources
from icr.index.manifest import Modality
from icr.index.metadata import MetadataStore
from icr.index.photo_folder import decode_batches
from icr.index.vector_index import ExactTopK
from icr.training.checkpoint import CheckpointMeta
from icr.training.data.training_data import SplitData
from icr.training.embedding import embed_captions, embed_image_batch


@dataclass
class Stream:
    """Embeddings streamed into the index, with their metadata rows, in id order."""

    chunks: Iterator[tuple[np.ndarray, list[dict[str, Any]]]]  # ((b, D) float32, b rows)
    count: int
    timings: dict[str, float] = field(default_factory=dict)


def feed(streams: list[Stream], store: MetadataStore, exact: ExactTopK) -> Iterator[np.ndarray]:
    """The streams' vectors for FAISS; their rows go to ``store`` and the exact top-k on the way.

    Ids are assigned here, in order, as FAISS assigns them; each stream's ``count`` becomes what it
    really delivered (a photo gallery built with --skip-bad delivers fewer than it listed).
    """
    next_id = 0
    for stream in streams:
        delivered = 0
        for vectors, rows in stream.chunks:
            for row in rows:
                row["id"] = next_id
                next_id += 1
            delivered += len(rows)
            store.add(rows)
            exact.add(vectors)
            yield vectors
        stream.count = delivered


def timed(it: Iterator[Any], timings: dict[str, float], key: str) -> Iterator[Any]:
    """``it`` with the seconds spent producing its items added up in ``timings[key]``."""
    timings.setdefault(key, 0.0)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            timings[key] += time.perf_counter() - t0
            return
        timings[key] += time.perf_counter() - t0
        yield item


def progress_bar(total: int, desc: str, progress: bool) -> Any:
    """A tqdm bar over ``total`` images (captions when ``desc`` says so); silent without ``progress``."""
    return tqdm(total=total, desc=desc, unit="img" if "caption" not in desc else "cap", disable=not progress)


def image_gallery(model: Any, data: SplitData, batch_size: int, device: str, progress: bool) -> Stream:
    """The split's images: embeddings with rows {source path, captions, scene (embedded benchmark)}."""
    sources, scenes = image_sources(data)
    caps = data.captions_of_images()
    timings: dict[str, float] = {}

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with progress_bar(data.num_images, "embedding gallery images", progress) as bar:
            for lo in range(0, data.num_images, batch_size):
                ids = range(lo, min(lo + batch_size, data.num_images))
                t0 = time.perf_counter()
                vectors = embed_image_batch(model, [data.get_image(i) for i in ids], device=device)  # (b, D)
                timings["gallery_embed_seconds"] = timings.get("gallery_embed_seconds", 0.0) + (
                    time.perf_counter() - t0
                )
                rows = [
                    {
                        "id": i,
                        "source": sources[i],
                        "captions": [data.captions[c] for c in caps[i]],
                        "is_distractor": False,
                        "scene": scenes[i] if scenes is not None else None,
                        "image_id": i,
                    }
                    for i in ids
                ]
                bar.update(len(rows))
                yield vectors, rows

    return Stream(chunks(), data.num_images, timings)


def caption_gallery(model: Any, data: SplitData, batch_size: int, device: str, progress: bool) -> Stream:
    """The split's captions: embeddings with rows {caption, source of its image, image_id}."""
    sources, _ = image_sources(data)
    timings: dict[str, float] = {}
    n = len(data.captions)
    step = max(batch_size, 512)  # captions are cheap to embed: larger batches

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with progress_bar(n, "embedding gallery captions", progress) as bar:
            for lo in range(0, n, step):
                ids = range(lo, min(lo + step, n))
                t0 = time.perf_counter()
                texts = [data.captions[c] for c in ids]
                vectors = embed_captions(model, texts, batch_size=step, device=device)  # (b, D)
                timings["gallery_embed_seconds"] = timings.get("gallery_embed_seconds", 0.0) + (
                    time.perf_counter() - t0
                )
                rows = []
                for c in ids:
                    image = int(data.img_of_cap[c])
                    rows.append(
                        {
                            "id": c,
                            "source": sources[image],
                            "captions": [data.captions[c]],
                            "is_distractor": False,
                            "scene": None,
                            "image_id": image,
                        }
                    )
                bar.update(len(rows))
                yield vectors, rows

    return Stream(chunks(), n, timings)


def _gallery_row(row: dict[str, Any], source: str) -> dict[str, Any]:
    """A metadata-store row of a user's gallery image (its id is assigned by :func:`feed`)."""
    return {
        "source": source,
        "captions": list(row.get("captions") or []),
        "is_distractor": False,
        "scene": row.get("scene"),
        "image_id": None,
        "fields": row.get("fields") or {},
    }


def photo_gallery(
    model: Any,
    images: str | os.PathLike[str],
    metadata: str | os.PathLike[str] | None,
    skip_bad: bool,
    workers: int | None,
    batch_size: int,
    device: str,
    recall_queries: int,
    seed: int,
    progress: bool,
) -> tuple[Stream, np.ndarray, Modality, list[str], dict[str, Any]]:
    """A folder of the user's photos embedded now: (its stream, recall-check queries, their modality,
    metadata field names, the manifest's ``data`` section)."""
    photos = PhotoGallery(images, metadata, skip_bad=skip_bad, workers=workers)
    source: dict[str, Any] = {**photos.description, "split": "", "skipped": []}
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(photos.count, min(recall_queries, photos.count), replace=False))
    captions = [photos.metadata.captions.get(photos.relative[i], []) for i in pick]
    query_modality: Modality
    if all(captions):
        queries, query_modality = embed_captions(model, [c[0] for c in captions], device=device), "text"
    else:  # no captions to query with: the ANN check uses the gallery's own images
        decoded = list(
            decode_batches([photos.paths[i] for i in pick], batch_size, workers=photos.workers, skip_bad=True)
        )
        queries = np.concatenate(
            [embed_image_batch(model, b.images, device=device) for b in decoded if b.images]
        )
        query_modality = "image"
    timings: dict[str, float] = {}

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with progress_bar(photos.count, "embedding gallery images", progress) as bar:
            for batch in timed(
                photos.batches(model, 0, photos.count, batch_size, device), timings, "gallery_embed_seconds"
            ):
                source["skipped"] += [{"file": f, "error": e} for f, e in batch.failed]
                bar.update(len(batch.rows) + len(batch.failed))
                yield batch.vectors, [_gallery_row(r, r["source"]) for r in batch.rows]

    return Stream(chunks(), photos.count, timings), queries, query_modality, photos.field_names(), source


def embedded_gallery(
    root: Path,
    checkpoint: str | os.PathLike[str],
    config: CheckpointMeta,
    recall_queries: int,
    seed: int,
    progress: bool,
) -> tuple[Stream, np.ndarray, Modality, list[str], dict[str, Any]]:
    """An ``icr embed`` folder written by ``checkpoint``, read shard by shard; returns what
    :func:`photo_gallery` returns."""
    folder = open_embeddings_folder(root, config.embed_dim)
    folder.check_checkpoint(config.weights_sha256, checkpoint)
    assert folder.manifest is not None  # check_checkpoint refuses a folder without one
    origin = folder.manifest["source"]
    # relative image paths of a photo folder resolve against it; a dataset's are absolute already
    base = Path(origin["path"]) if origin.get("kind") == "images" else None
    with_text = folder.has_text
    queries = folder.sample(recall_queries, seed, with_text)  # (Q, D)
    source = {
        "kind": "embeddings",
        "path": str(root.resolve()),
        "split": str(origin.get("split", "")),
        "origin": origin,
    }

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with progress_bar(folder.count, "reading gallery embeddings", progress) as bar:
            for vectors, meta in folder.chunks():
                rows = []
                for m in meta:
                    path, captions, fields = row_parts(m)
                    row = {"captions": captions, "fields": fields}
                    rows.append(_gallery_row(row, str(base / path) if base is not None else path))
                bar.update(len(rows))
                yield vectors, rows

    fields = [str(f) for f in folder.manifest.get("fields", [])]
    return Stream(chunks(), folder.count), queries, "text" if with_text else "image", fields, source
