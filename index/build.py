"""Build self-describing index directories: FAISS index + ``manifest.json`` + SQLite metadata.

An index directory holds::

    index.faiss       the FAISS index, CPU form (ids: gallery 0..G-1, distractors G..G+N-1)
    manifest.json     what it holds and what built it (see index.manifest.Manifest)
    metadata.sqlite   one row per id (see index.metadata.MetadataStore)

Everything is written into a hidden temporary folder beside ``out`` and renamed into place only
when complete: an interrupted build leaves the previous index as it was, and never a half index
that loads. Vectors are streamed: gallery and distractor embeddings pass through FAISS, the
metadata store and an exact top-k of the recall queries chunk by chunk, so a million distractors
never sit in memory at once (an IVF index buffers only its training sample).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from tqdm import tqdm

from icr.core.atomic import fsync_file, sha256_file, staged_dir
from icr.core.devices import resolve_device
from icr.core.memory import peak_rss_mb
from icr.index.embeddings_layout import open_embeddings_folder
from icr.index.factory_choice import Targets, choose_by_measurement
from icr.index.galleries import PhotoGallery, image_sources
from icr.index.index_folder import INDEX_FILE
from icr.index.manifest import MANIFEST_FILE, Manifest, Modality
from icr.index.metadata import METADATA_FILE, MetadataStore
from icr.index.on_disk import ONDISK_DATA, OnDiskBuild, build_on_disk, choose_on_disk_factory, load_on_disk
from icr.index.photo_folder import decode_batches
from icr.index.vector_index import (
    ExactTopK,
    build_index,
    choose_factory,
    exact_depth,
    nprobe_of,
    parse_factory,
    recall_at_k,
    save_index,
    tune_nprobe,
    use_gpu,
)
from icr.training.checkpoint import load_checkpoint, trained_captions_per_image
from icr.training.data.synthetic.generate import DistractorStream, render_workers
from icr.training.data.training_data import SplitData, open_split, synthetic_dir
from icr.training.embedding import (
    embed_captions,
    embed_image_batch,
    embed_images,
    open_embeddings,
    threads_beside_workers,
)

# Default memory budget for the index's codes: raw float32 vectors up to 2 GiB (1M x 512), PQ above.
DEFAULT_MEMORY_BUDGET = 2 << 30
RECALL_QUERIES = 200
RECALL_K = 10
# What an IVF index's nprobe is tuned to reach on the held-out queries: recall@10, and recall of the
# top SEARCH_DEPTH (the service's ICR_SEARCH_DEPTH, where thresholds count what passes them).
NPROBE_TARGET = 0.98
SEARCH_DEPTH = 1000
DEPTH_TARGET = 0.95
# Distractor embeddings whose norms stray further from 1 were not L2-normalised.
NORM_TOL = 1e-3
_BUILDING = ".building-"


@dataclass
class _Stream:
    """Embeddings streamed into the index, with their metadata rows, in id order."""

    chunks: Iterator[tuple[np.ndarray, list[dict[str, Any]]]]  # ((b, D) float32, b rows)
    count: int
    timings: dict[str, float] = field(default_factory=dict)


def build_image_index(
    checkpoint: str | os.PathLike[str],
    data: str | os.PathLike[str],
    *,
    split: str = "test",
    distractors: int = 0,
    distractor_embeddings: str | os.PathLike[str] | None = None,
    distractor_images: str | os.PathLike[str] | None = None,
    factory: str = "auto",
    gpu: str = "auto",
    out: str | os.PathLike[str],
    batch_size: int = 256,
    progress: bool = True,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET,
    on_disk: bool = False,
    recall_queries: int = RECALL_QUERIES,
    device: str = "auto",
    seed: int = 0,
) -> Manifest:
    """Index the images of ``split`` (+ distractors) for text->image search; returns the manifest.

    ``distractors``: N images from the embedded benchmark's generator (its seed and image size);
    ``distractor_embeddings``: an (N, D) float32 .npy of L2-normalised embeddings (memory-mapped),
    or an embeddings folder (:mod:`index.embeddings_layout`); ``distractor_images``: a folder of
    image files (searched recursively, sorted by path).
    ``factory``: ``auto`` (see :func:`index.vector_index.choose_factory`) or a factory string.
    ``gpu``: FAISS on the GPU (``auto``: when one is visible); ``device``: where the model embeds
    (``auto``: CUDA when available). The recall check uses ``recall_queries`` captions of the split.
    """
    given = Distractors(distractors, distractor_embeddings, distractor_images)
    _check_args(given, factory, gpu, batch_size, out)
    return _build(
        "image", checkpoint, data, split=split, distractors=given, factory=factory, gpu=gpu, out=out,
        batch_size=batch_size, progress=progress, memory_budget_bytes=memory_budget_bytes,
        on_disk=on_disk, recall_queries=recall_queries, device=device, seed=seed,
    )  # fmt: skip


def build_caption_index(
    checkpoint: str | os.PathLike[str],
    data: str | os.PathLike[str],
    *,
    split: str = "test",
    factory: str = "auto",
    gpu: str = "auto",
    out: str | os.PathLike[str],
    batch_size: int = 256,
    progress: bool = True,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET,
    on_disk: bool = False,
    recall_queries: int = RECALL_QUERIES,
    device: str = "auto",
    seed: int = 0,
) -> Manifest:
    """Index the captions of ``split`` for image->text search (modality ``text``); see
    :func:`build_image_index`. Metadata rows: the caption, and ``image_id`` of the image it
    describes; the recall check uses ``recall_queries`` images of the split as queries."""
    _check_args(Distractors(), factory, gpu, batch_size, out)
    return _build(
        "text", checkpoint, data, split=split, distractors=Distractors(), factory=factory, gpu=gpu,
        out=out, batch_size=batch_size, progress=progress, memory_budget_bytes=memory_budget_bytes,
        on_disk=on_disk, recall_queries=recall_queries, device=device, seed=seed,
    )  # fmt: skip


def build_photo_index(
    checkpoint: str | os.PathLike[str],
    *,
    images: str | os.PathLike[str] | None = None,
    metadata: str | os.PathLike[str] | None = None,
    embeddings: str | os.PathLike[str] | None = None,
    skip_bad: bool = False,
    workers: int | None = None,
    distractor_embeddings: str | os.PathLike[str] | None = None,
    distractor_images: str | os.PathLike[str] | None = None,
    factory: str = "auto",
    gpu: str = "auto",
    out: str | os.PathLike[str],
    batch_size: int = 256,
    progress: bool = True,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET,
    on_disk: bool = False,
    recall_queries: int = RECALL_QUERIES,
    device: str = "auto",
    seed: int = 0,
) -> Manifest:
    """An image index over the user's own gallery: a folder of photos (``images``, with the optional
    ``metadata`` file; see :mod:`index.photo_folder`) embedded now, or an ``icr embed`` folder
    (``embeddings``) written by this checkpoint. Metadata fields are stored with each image and
    are what query filters select on. The recall check's queries are captions where the gallery
    has them (the metadata's, or the embeddings' text_emb), else a sample of its own images."""
    if (images is None) == (embeddings is None):
        raise ValueError(
            "give one gallery: --images DIR (photos to embed) or --embeddings DIR (icr embed output)"
        )
    if metadata is not None and images is None:
        raise ValueError(
            "--metadata goes with --images DIR; an embeddings folder carries its metadata already"
        )
    given = Distractors(0, distractor_embeddings, distractor_images)
    _check_args(given, factory, gpu, batch_size, out)

    started = time.perf_counter()
    device = resolve_device(device)
    model, config = load_checkpoint(checkpoint, device)
    dim = int(config["embed_dim"])
    if embeddings is not None:
        gallery, queries, query_modality, fields, source = _embedded_gallery(
            Path(embeddings), checkpoint, config, recall_queries, seed, progress
        )
    else:
        assert images is not None
        gallery, queries, query_modality, fields, source = _photo_gallery(
            model, images, metadata, skip_bad, workers, batch_size, device, recall_queries, seed, progress
        )
    extra = _distractor_stream(model, None, given, dim, batch_size, device, progress)
    source["distractor_source"] = given.source
    return _write_index(
        Path(out),
        _Built("image", checkpoint, config, device, started),
        gallery,
        extra,
        queries,
        query_modality,
        factory=factory,
        gpu=gpu,
        memory_budget_bytes=memory_budget_bytes,
        on_disk=on_disk,
        data=source,
        metadata_fields=fields,
    )


def _gallery_row(row: dict[str, Any], source: str) -> dict[str, Any]:
    """A metadata-store row of a user's gallery image (its id is assigned by :func:`_feed`)."""
    return {
        "source": source,
        "captions": list(row.get("captions") or []),
        "is_distractor": False,
        "scene": row.get("scene"),
        "image_id": None,
        "fields": row.get("fields") or {},
    }


def _photo_gallery(
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
) -> tuple[_Stream, np.ndarray, Modality, list[str], dict[str, Any]]:
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
        with _bar(photos.count, "embedding gallery images", progress) as bar:
            for batch in _timed(
                photos.batches(model, 0, photos.count, batch_size, device), timings, "gallery_embed_seconds"
            ):
                source["skipped"] += [{"file": f, "error": e} for f, e in batch.failed]
                bar.update(len(batch.rows) + len(batch.failed))
                yield batch.vectors, [_gallery_row(r, r["source"]) for r in batch.rows]

    return _Stream(chunks(), photos.count, timings), queries, query_modality, photos.field_names(), source


def _embedded_gallery(
    root: Path,
    checkpoint: str | os.PathLike[str],
    config: dict[str, Any],
    recall_queries: int,
    seed: int,
    progress: bool,
) -> tuple[_Stream, np.ndarray, Modality, list[str], dict[str, Any]]:
    folder = open_embeddings_folder(root, int(config["embed_dim"]))
    folder.check_checkpoint(str(config["weights_sha256"]), checkpoint)
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
        with _bar(folder.count, "reading gallery embeddings", progress) as bar:
            for vectors, meta in folder.chunks():
                rows = []
                for m in meta:
                    path = str(m["image_path"])
                    fields = {k: v for k, v in m.items() if k not in ("image_path", "caption", "captions")}
                    row = {
                        "captions": m.get("captions") or ([m["caption"]] if m.get("caption") else []),
                        "fields": fields,
                    }
                    rows.append(_gallery_row(row, str(base / path) if base is not None else path))
                bar.update(len(rows))
                yield vectors, rows

    fields = [str(f) for f in folder.manifest.get("fields", [])]
    return _Stream(chunks(), folder.count), queries, "text" if with_text else "image", fields, source


def _check_args(
    given: Distractors, factory: str, gpu: str, batch_size: int, out: str | os.PathLike[str]
) -> None:
    """Everything checkable before minutes of embedding."""
    given.check()
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if factory != "auto":
        parse_factory(factory)
    use_gpu(gpu)  # gpu=on without a GPU fails here
    _check_replaceable(Path(out))


def _check_replaceable(out: Path) -> None:
    """Refuse to replace a non-empty folder that is not an index (it may hold the user's data)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory; choose another --out")
    if any(out.iterdir()) and not (out / MANIFEST_FILE).is_file():
        raise ValueError(
            f"{out}: exists, is not empty and is not an index directory (no {MANIFEST_FILE}); refusing to "
            "replace it. Choose a new --out or remove this folder."
        )


def _build(
    modality: Modality,
    checkpoint: str | os.PathLike[str],
    data_path: str | os.PathLike[str],
    *,
    split: str,
    distractors: Distractors,
    factory: str,
    gpu: str,
    out: str | os.PathLike[str],
    batch_size: int,
    progress: bool,
    memory_budget_bytes: int,
    on_disk: bool,
    recall_queries: int,
    device: str,
    seed: int,
) -> Manifest:
    started = time.perf_counter()
    device = resolve_device(device)
    model, config = load_checkpoint(checkpoint, device)
    dim = int(config["embed_dim"])
    per_image = trained_captions_per_image(config)
    data = open_split(Path(data_path), split, captions_per_image=per_image, progress=progress)
    if data.num_images == 0:
        raise ValueError(f"{data_path}: split {split!r} has no images to index")

    rng = np.random.default_rng(seed)
    if modality == "image":
        gallery = _image_gallery(model, data, batch_size, device, progress)
        pick = np.sort(rng.choice(len(data.captions), min(recall_queries, len(data.captions)), replace=False))
        queries = embed_captions(model, [data.captions[i] for i in pick], device=device)  # (Q, D)
        extra = _distractor_stream(model, data, distractors, dim, batch_size, device, progress)
    else:
        gallery = _caption_gallery(model, data, batch_size, device, progress)
        pick = np.sort(rng.choice(data.num_images, min(recall_queries, data.num_images), replace=False))
        queries = embed_images(model, data, pick, batch_size=batch_size, device=device)  # (Q, D)
        extra = None
    source = {
        "path": str(data_path),
        "split": split,
        "kind": data.kind,
        "distractor_source": distractors.source,
    }
    return _write_index(
        Path(out),
        _Built(modality, checkpoint, config, device, started),
        gallery,
        extra,
        queries,
        "text" if modality == "image" else "image",
        factory=factory,
        gpu=gpu,
        memory_budget_bytes=memory_budget_bytes,
        on_disk=on_disk,
        data=source,
    )


@dataclass
class _Built:
    """What every build records about its model."""

    modality: Modality
    checkpoint: str | os.PathLike[str]
    config: dict[str, Any]
    device: str
    started: float  # perf_counter at the start of the build


def _write_index(
    out: Path,
    built_by: _Built,
    gallery: _Stream,
    extra: _Stream | None,
    queries: np.ndarray,  # (Q, D) recall-check queries
    query_modality: Modality,
    *,
    factory: str,
    gpu: str,
    memory_budget_bytes: int,
    on_disk: bool = False,
    data: dict[str, Any],
    metadata_fields: list[str] | None = None,
) -> Manifest:
    """Stream ``gallery`` (+ ``extra``) into FAISS and the metadata store in a temporary folder,
    check recall, write the manifest and rename the folder to ``out``."""
    config = built_by.config
    dim = int(config["embed_dim"])
    planned = gallery.count + (extra.count if extra is not None else 0)
    measure = False  # auto and in memory: the ANN candidates are measured after the build
    if factory == "auto":
        choose = choose_on_disk_factory if on_disk else choose_factory
        factory, reason = choose(planned, dim, memory_budget_bytes)
        measure = not on_disk and parse_factory(factory)["kind"] == "IVF"
    else:
        reason = "chosen by the caller (--factory)"
    if on_disk and not any(part.startswith("IVF") for part in factory.split(",")):
        raise ValueError(
            f"--on-disk needs an inverted-file factory (IVF<k>,Flat or IVF<k>,PQ<m>), not {factory}"
        )

    _remove_stale_builds(out)
    with staged_dir(out, _BUILDING) as tmp:
        exact = ExactTopK(queries, max(exact_depth(RECALL_K), exact_depth(SEARCH_DEPTH)))
        built: dict[str, str] = {}
        on_disk_build = None
        with MetadataStore.create(tmp / METADATA_FILE) as store:
            streams = [gallery] if extra is None else [gallery, extra]
            if on_disk:
                on_disk_build = build_on_disk(
                    _feed(streams, store, exact),
                    dim,
                    factory,
                    tmp,
                    INDEX_FILE,
                    memory_budget_bytes=memory_budget_bytes,
                )
                index = load_on_disk(tmp / INDEX_FILE)
                built["built_on"] = "cpu"
            else:
                index = build_index(_feed(streams, store, exact), dim, factory, gpu=gpu, report=built)
        n_distractors = extra.count if extra is not None else 0
        ntotal = gallery.count + n_distractors  # as delivered (see _feed)
        if index.ntotal != ntotal:
            raise RuntimeError(f"index holds {index.ntotal} vectors, {ntotal} were streamed")
        t0 = time.perf_counter()
        trials: dict[str, Any] = {}
        ef_search = None
        if measure:
            choice = choose_by_measurement(
                index,
                factory,
                reason,
                exact,
                queries,
                Targets(RECALL_K, NPROBE_TARGET, SEARCH_DEPTH, DEPTH_TARGET),
                memory_budget_bytes=memory_budget_bytes,
            )
            index, factory, reason = choice.index, choice.factory, choice.reason
            nprobe, ef_search, recall, deep = (
                choice.nprobe,
                choice.ef_search,
                choice.recall,
                choice.recall_at_depth,
            )
            trials = {"factory_trials": choice.trials_json()}
        elif nprobe_of(index) is not None:
            nprobe, recall, deep = tune_nprobe(
                index, exact, queries, RECALL_K, NPROBE_TARGET, depth=SEARCH_DEPTH, depth_target=DEPTH_TARGET
            )
        else:
            nprobe, recall, deep = None, recall_at_k(index, exact, queries, RECALL_K), None
        recall_seconds = time.perf_counter() - t0
        written = [INDEX_FILE, METADATA_FILE, *([ONDISK_DATA] if on_disk else [])]
        if not on_disk:  # an on-disk index was written by its build (index.faiss names index.ivfdata)
            save_index(index, tmp / INDEX_FILE)
        for name in written:
            fsync_file(tmp / name)
        timings = {**gallery.timings, **(extra.timings if extra is not None else {})}
        throughput = _throughput(gallery.count, n_distractors, timings)
        manifest = Manifest(
            modality=built_by.modality,
            checkpoint_sha256=str(config["weights_sha256"]),
            checkpoint_path=str(built_by.checkpoint),
            dim=dim,
            factory=factory,
            factory_reason=reason,
            ntotal=ntotal,
            gallery_count=gallery.count,
            distractor_count=n_distractors,
            recall_check={
                "k": RECALL_K,
                "recall": round(float(recall), 6),
                "queries": len(queries),
                "query_modality": query_modality,
                "nprobe": nprobe,
                "nprobe_target": NPROBE_TARGET if nprobe is not None else None,
                "depth": min(SEARCH_DEPTH, ntotal),
                "recall_at_depth": None if deep is None else round(float(deep), 6),
                "depth_target": DEPTH_TARGET if nprobe is not None or ef_search is not None else None,
                **({"ef_search": ef_search} if ef_search is not None else {}),
            },
            build_seconds=round(time.perf_counter() - built_by.started, 3),
            peak_rss_mb=round(peak_rss_mb(), 1),
            created=datetime.now(UTC).isoformat(timespec="seconds"),
            data=data,
            built_on="gpu" if built["built_on"] == "gpu" else "cpu",
            files={name: sha256_file(tmp / name) for name in written},
            metadata_fields=metadata_fields or [],
            extra={
                "embed_device": built_by.device,
                **throughput,
                **{k: round(v, 3) for k, v in timings.items()},
                "recall_seconds": round(recall_seconds, 3),
                **trials,
                "faiss_threads": faiss.omp_get_max_threads(),
                **(_on_disk_details(on_disk_build, memory_budget_bytes) if on_disk_build is not None else {}),
                **({"gpu_fallback": built["gpu_fallback"]} if "gpu_fallback" in built else {}),
            },
        )
        (tmp / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
        fsync_file(tmp / MANIFEST_FILE)
    return manifest


def _on_disk_details(build: OnDiskBuild, memory_budget_bytes: int) -> dict[str, Any]:
    return {
        "on_disk": True,
        "memory_budget_mb": memory_budget_bytes >> 20,
        "shards": build.shards,
        "train_points": build.train_points,
        **{f"{k}_seconds": round(v, 3) for k, v in build.seconds.items()},
    }


def _throughput(gallery: int, distractors: int, t: dict[str, float]) -> dict[str, float]:
    """Embedding throughput figures (per second) from the streams' timings."""
    out = {}
    if t.get("gallery_embed_seconds"):
        out["gallery_per_s"] = round(gallery / t["gallery_embed_seconds"], 1)
    if distractors and t.get("distractor_embed_seconds"):
        out["distractor_embed_per_s"] = round(distractors / t["distractor_embed_seconds"], 1)
        rendered = t["distractor_embed_seconds"] + t.get("distractor_render_seconds", 0.0)
        out["distractor_render_and_embed_per_s"] = round(distractors / rendered, 1)
    return out


def _feed(streams: list[_Stream], store: MetadataStore, exact: ExactTopK) -> Iterator[np.ndarray]:
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


def _timed(it: Iterator[Any], timings: dict[str, float], key: str) -> Iterator[Any]:
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


def _bar(total: int, desc: str, progress: bool) -> Any:
    return tqdm(total=total, desc=desc, unit="img" if "caption" not in desc else "cap", disable=not progress)


def _image_gallery(model: Any, data: SplitData, batch_size: int, device: str, progress: bool) -> _Stream:
    """The split's images: embeddings with rows {source path, captions, scene (embedded benchmark)}."""
    sources, scenes = image_sources(data)
    caps = data.captions_of_images()
    timings: dict[str, float] = {}

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with _bar(data.num_images, "embedding gallery images", progress) as bar:
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

    return _Stream(chunks(), data.num_images, timings)


def _caption_gallery(model: Any, data: SplitData, batch_size: int, device: str, progress: bool) -> _Stream:
    """The split's captions: embeddings with rows {caption, source of its image, image_id}."""
    sources, _ = image_sources(data)
    timings: dict[str, float] = {}
    n = len(data.captions)
    step = max(batch_size, 512)  # captions are cheap to embed: larger batches

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with _bar(n, "embedding gallery captions", progress) as bar:
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

    return _Stream(chunks(), n, timings)


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


def _distractor_stream(
    model: Any,
    data: SplitData | None,
    given: Distractors,
    dim: int,
    batch_size: int,
    device: str,
    progress: bool,
) -> _Stream | None:
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
        with _bar(n, "embedding distractors", progress) as bar, threads_beside_workers(workers, device):
            batches = stream.batches(batch_size, workers=workers)
            rendered = _timed(batches, timings, "distractor_render_seconds")
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

    return _Stream(chunks(), n, timings)


def _distractor_row(source: str, scene: dict[str, Any] | None = None) -> dict[str, Any]:
    """A distractor's metadata row (its id is assigned by :func:`_feed`)."""
    return {"source": source, "captions": [], "is_distractor": True, "scene": scene, "image_id": None}


def _folder_distractors(model: Any, folder: Path, batch_size: int, device: str, progress: bool) -> _Stream:
    """Distractor images from a folder (see :mod:`index.photo_folder`); a file that does not decode
    stops the build with its name (nothing is replaced: the index is built in a temporary folder)."""
    photos = PhotoGallery(folder)
    timings: dict[str, float] = {}

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with _bar(photos.count, "embedding distractors", progress) as bar:
            batches = _timed(
                photos.batches(model, 0, photos.count, batch_size, device),
                timings,
                "distractor_embed_seconds",
            )
            for batch in batches:
                rows = [_distractor_row(r["source"]) for r in batch.rows]
                bar.update(len(rows))
                yield batch.vectors, rows

    return _Stream(chunks(), photos.count, timings)


def _file_distractors(path: Path, dim: int, chunk: int, progress: bool) -> _Stream:
    """Distractors from an (N, D) .npy, memory-mapped and read chunk by chunk."""
    emb = open_embeddings(path, dim)  # (N, D) memory-mapped

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with _bar(len(emb), "reading distractor embeddings", progress) as bar:
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

    return _Stream(chunks(), len(emb))


def _layout_distractors(root: Path, dim: int, progress: bool) -> _Stream:
    """Distractors from an embeddings folder (``icr embed`` or clip-retrieval layout), shard by
    shard; sources are the image paths its metadata records (``distractor:{k}`` without one)."""
    folder = open_embeddings_folder(root, dim)

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        k = 0
        with _bar(folder.count, "reading distractor embeddings", progress) as bar:
            for vectors, meta in folder.chunks():
                rows = []
                for m in meta:
                    rows.append(_distractor_row(str(m.get("image_path") or f"distractor:{k}")))
                    k += 1
                bar.update(len(rows))
                yield vectors, rows

    return _Stream(chunks(), folder.count)


# --- directory handling ---------------------------------------------------------------------------
def _remove_stale_builds(out: Path) -> None:
    """Delete temporary folders of builds of ``out`` whose process is gone (killed, power loss)."""
    for tmp in out.parent.glob(f".{out.name}{_BUILDING}*"):
        try:
            pid = int(tmp.name[len(f".{out.name}{_BUILDING}") :].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
