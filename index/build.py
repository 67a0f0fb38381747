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
import resource
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from icr.index.manifest import MANIFEST_FILE, Manifest, Modality
from icr.index.metadata import METADATA_FILE, MetadataStore
from icr.index.vector_index import (
    ExactTopK,
    build_index,
    choose_factory,
    nprobe_of,
    parse_factory,
    recall_at_k,
    save_index,
    tune_nprobe,
    use_gpu,
)
from icr.training.atomic import replace_dir, sha256_file
from icr.training.data.training_data import SplitData
from icr.training.devices import resolve_device

INDEX_FILE = "index.faiss"
# Default memory budget for the index's codes: raw float32 vectors up to 2 GiB (1M x 512), PQ above.
DEFAULT_MEMORY_BUDGET = 2 << 30
RECALL_QUERIES = 200
RECALL_K = 10
# Recall@10 an IVF index's nprobe is tuned to reach on the held-out queries.
NPROBE_TARGET = 0.95
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
    recall_queries: int = RECALL_QUERIES,
    device: str = "auto",
    seed: int = 0,
) -> Manifest:
    """Index the images of ``split`` (+ distractors) for text->image search; returns the manifest.

    ``distractors``: N images from the embedded benchmark's generator (its seed and image size);
    ``distractor_embeddings``: an (N, D) float32 .npy of L2-normalised embeddings, memory-mapped;
    ``distractor_images``: a folder of image files (searched recursively, sorted by path).
    ``factory``: ``auto`` (see :func:`index.vector_index.choose_factory`) or a factory string.
    ``gpu``: FAISS on the GPU (``auto``: when one is visible); ``device``: where the model embeds
    (``auto``: CUDA when available). The recall check uses ``recall_queries`` captions of the split.
    """
    given = [bool(distractors), distractor_embeddings is not None, distractor_images is not None]
    if sum(given) > 1:
        raise ValueError(
            "give one distractor source: --distractors N, --distractor-embeddings FILE or "
            "--distractor-images DIR"
        )
    _check_args(distractors, distractor_embeddings, factory, gpu, batch_size, out)
    if distractor_images is not None and not Path(distractor_images).is_dir():
        raise FileNotFoundError(f"{distractor_images}: distractor image folder not found")
    return _build(
        "image",
        checkpoint,
        data,
        split=split,
        distractors=distractors,
        distractor_path=distractor_embeddings or distractor_images,
        factory=factory,
        gpu=gpu,
        out=out,
        batch_size=batch_size,
        progress=progress,
        memory_budget_bytes=memory_budget_bytes,
        recall_queries=recall_queries,
        device=device,
        seed=seed,
    )


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
    recall_queries: int = RECALL_QUERIES,
    device: str = "auto",
    seed: int = 0,
) -> Manifest:
    """Index the captions of ``split`` for image->text search (modality ``text``); see
    :func:`build_image_index`. Metadata rows: the caption, and ``image_id`` of the image it
    describes; the recall check uses ``recall_queries`` images of the split as queries."""
    _check_args(0, None, factory, gpu, batch_size, out)
    return _build(
        "text",
        checkpoint,
        data,
        split=split,
        distractors=0,
        distractor_path=None,
        factory=factory,
        gpu=gpu,
        out=out,
        batch_size=batch_size,
        progress=progress,
        memory_budget_bytes=memory_budget_bytes,
        recall_queries=recall_queries,
        device=device,
        seed=seed,
    )


def _check_args(
    distractors: int, embeddings: Any, factory: str, gpu: str, batch_size: int, out: str | os.PathLike[str]
) -> None:
    """Everything checkable before minutes of embedding."""
    if distractors < 0:
        raise ValueError(f"--distractors must be >= 0, got {distractors}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if embeddings is not None and not Path(embeddings).is_file():
        raise FileNotFoundError(f"{embeddings}: distractor embeddings file not found")
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
    distractors: int,
    distractor_path: str | os.PathLike[str] | None,  # an embeddings .npy or an image folder
    factory: str,
    gpu: str,
    out: str | os.PathLike[str],
    batch_size: int,
    progress: bool,
    memory_budget_bytes: int,
    recall_queries: int,
    device: str,
    seed: int,
) -> Manifest:
    from icr.training.checkpoint import load_checkpoint, trained_captions_per_image
    from icr.training.data.training_data import open_split
    from icr.training.embedding import embed_captions, embed_images

    started = time.perf_counter()
    out = Path(out)
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
        extra = _distractor_stream(
            model, data, distractors, distractor_path, dim, gallery.count, batch_size, device, progress
        )
    else:
        gallery = _caption_gallery(model, data, batch_size, device, progress)
        pick = np.sort(rng.choice(data.num_images, min(recall_queries, data.num_images), replace=False))
        queries = embed_images(model, data, pick, batch_size=batch_size, device=device)  # (Q, D)
        extra = None
    n_distractors = extra.count if extra is not None else 0
    ntotal = gallery.count + n_distractors
    if factory == "auto":
        factory, reason = choose_factory(ntotal, dim, memory_budget_bytes)
    else:
        reason = "chosen by the caller (--factory)"

    _remove_stale_builds(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}{_BUILDING}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        exact = ExactTopK(queries, 2 * RECALL_K)
        built: dict[str, str] = {}
        with MetadataStore.create(tmp / METADATA_FILE) as store:
            streams = [gallery] if extra is None else [gallery, extra]
            index = build_index(_feed(streams, store, exact), dim, factory, gpu=gpu, report=built)
        if index.ntotal != ntotal:
            raise RuntimeError(f"index holds {index.ntotal} vectors, {ntotal} were expected")
        t0 = time.perf_counter()
        if nprobe_of(index) is not None:
            nprobe, recall = tune_nprobe(index, exact, queries, RECALL_K, NPROBE_TARGET)
        else:
            nprobe, recall = None, recall_at_k(index, exact, queries, RECALL_K)
        recall_seconds = time.perf_counter() - t0
        save_index(index, tmp / INDEX_FILE)
        _fsync(tmp / INDEX_FILE)
        _fsync(tmp / METADATA_FILE)
        timings = {**gallery.timings, **(extra.timings if extra is not None else {})}
        throughput = _throughput(gallery.count, n_distractors, timings)
        manifest = Manifest(
            modality=modality,
            checkpoint_sha256=str(config["weights_sha256"]),
            checkpoint_path=str(checkpoint),
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
                "query_modality": "text" if modality == "image" else "image",
                "nprobe": nprobe,
                "nprobe_target": NPROBE_TARGET if nprobe is not None else None,
            },
            build_seconds=round(time.perf_counter() - started, 3),
            peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            created=datetime.now(UTC).isoformat(timespec="seconds"),
            data={
                "path": str(data_path),
                "split": split,
                "kind": data.kind,
                "distractor_source": _distractor_source(distractors, distractor_path),
            },
            built_on="gpu" if built["built_on"] == "gpu" else "cpu",
            files={name: sha256_file(tmp / name) for name in (INDEX_FILE, METADATA_FILE)},
            extra={
                "embed_device": device,
                **throughput,
                **{k: round(v, 3) for k, v in timings.items()},
                "recall_seconds": round(recall_seconds, 3),
                "faiss_threads": faiss.omp_get_max_threads(),
                **({"gpu_fallback": built["gpu_fallback"]} if "gpu_fallback" in built else {}),
            },
        )
        (tmp / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
        _fsync(tmp / MANIFEST_FILE)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


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


def _distractor_source(distractors: int, embeddings: str | os.PathLike[str] | None) -> str | None:
    if embeddings is not None:
        return str(embeddings)
    return "generator" if distractors else None


def _feed(streams: list[_Stream], store: MetadataStore, exact: ExactTopK) -> Iterator[np.ndarray]:
    """The streams' vectors for FAISS; their rows go to ``store`` and the exact top-k on the way."""
    for stream in streams:
        for vectors, rows in stream.chunks:
            store.add(rows)
            exact.add(vectors)
            yield vectors


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
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="img" if "caption" not in desc else "cap", disable=not progress)


def _image_gallery(model: Any, data: SplitData, batch_size: int, device: str, progress: bool) -> _Stream:
    """The split's images: embeddings with rows {source path, captions, scene (embedded benchmark)}."""
    from icr.training.embedding import embed_image_batch

    sources, scenes = _image_sources(data)
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


def _image_sources(data: SplitData) -> tuple[list[str], list[dict[str, Any]] | None]:
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


def _caption_gallery(model: Any, data: SplitData, batch_size: int, device: str, progress: bool) -> _Stream:
    """The split's captions: embeddings with rows {caption, source of its image, image_id}."""
    from icr.training.embedding import embed_captions

    sources, _ = _image_sources(data)
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


def _distractor_stream(
    model: Any,
    data: SplitData,
    n: int,
    embeddings: str | os.PathLike[str] | None,
    dim: int,
    first_id: int,
    batch_size: int,
    device: str,
    progress: bool,
) -> _Stream | None:
    if embeddings is not None and Path(embeddings).is_dir():
        return _folder_distractors(model, Path(embeddings), first_id, batch_size, device, progress)
    if embeddings is not None:
        return _file_distractors(Path(embeddings), dim, first_id, batch_size * 16, progress)
    if n == 0:
        return None
    from icr.training.data.training_data import synthetic_dir

    directory = synthetic_dir(data)
    if directory is None:
        raise ValueError(
            "--distractors N draws images from the embedded benchmark's generator; for Flickr30k/COCO embed "
            "your distractor images first and pass --distractor-embeddings FILE.npy"
        )
    from icr.training.data.synthetic.generate import DistractorStream, render_workers
    from icr.training.embedding import embed_image_batch

    stream = DistractorStream.for_dataset(directory, n)
    timings: dict[str, float] = {}

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with _bar(n, "embedding distractors", progress) as bar:
            rendered = _timed(
                stream.batches(batch_size, workers=render_workers()), timings, "distractor_render_seconds"
            )
            for ks, images, scenes in rendered:
                t0 = time.perf_counter()
                vectors = embed_image_batch(model, list(images), device=device)  # (b, D)
                timings["distractor_embed_seconds"] = timings.get("distractor_embed_seconds", 0.0) + (
                    time.perf_counter() - t0
                )
                rows = [
                    {
                        "id": first_id + int(k),
                        "source": f"distractor:{int(k)}",
                        "captions": [],
                        "is_distractor": True,
                        "scene": s.to_dict(),
                        "image_id": None,
                    }
                    for k, s in zip(ks, scenes, strict=True)
                ]
                bar.update(len(rows))
                yield vectors, rows

    return _Stream(chunks(), n, timings)


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def _folder_distractors(
    model: Any, folder: Path, first_id: int, batch_size: int, device: str, progress: bool
) -> _Stream:
    """Distractor images from a folder (recursive, sorted paths); a file that does not decode stops
    the build with its name (nothing is replaced: the index is built in a temporary folder)."""
    from icr.training.data.karpathy import load_image
    from icr.training.embedding import embed_image_batch

    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not paths:
        raise ValueError(f"{folder}: no image files ({', '.join(IMAGE_SUFFIXES)}) to use as distractors")
    timings: dict[str, float] = {}

    def chunks() -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
        with _bar(len(paths), "embedding distractors", progress) as bar:
            for lo in range(0, len(paths), batch_size):
                batch = paths[lo : lo + batch_size]
                t0 = time.perf_counter()
                images = [load_image(p) for p in batch]  # DatasetError names a corrupt file
                timings["distractor_render_seconds"] = timings.get("distractor_render_seconds", 0.0) + (
                    time.perf_counter() - t0
                )
                t0 = time.perf_counter()
                vectors = embed_image_batch(model, images, device=device)  # (b, D)
                timings["distractor_embed_seconds"] = timings.get("distractor_embed_seconds", 0.0) + (
                    time.perf_counter() - t0
                )
                rows: list[dict[str, Any]] = [
                    {
                        "id": first_id + lo + j,
                        "source": str(p),
                        "captions": [],
                        "is_distractor": True,
                        "scene": None,
                        "image_id": None,
                    }
                    for j, p in enumerate(batch)
                ]
                bar.update(len(rows))
                yield vectors, rows

    return _Stream(chunks(), len(paths), timings)


def _file_distractors(path: Path, dim: int, first_id: int, chunk: int, progress: bool) -> _Stream:
    """Distractors from an (N, D) .npy, memory-mapped and read chunk by chunk."""
    from icr.training.embedding import open_embeddings

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
                rows: list[dict[str, Any]] = [
                    {
                        "id": first_id + k,
                        "source": f"distractor:{k}",
                        "captions": [],
                        "is_distractor": True,
                        "scene": None,
                        "image_id": None,
                    }
                    for k in range(lo, lo + len(vectors))
                ]
                bar.update(len(rows))
                yield vectors, rows

    return _Stream(chunks(), len(emb))


# --- directory handling ---------------------------------------------------------------------------
def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


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


# --- loading --------------------------------------------------------------------------------------
def load_index_dir(
    directory: str | os.PathLike[str], *, mmap: bool = False
) -> tuple[faiss.Index, Manifest, MetadataStore]:
    """(index, manifest, read-only metadata) of an index directory, checked against each other.

    Errors name the missing or corrupt file and the command that rebuilds the index.
    """
    from icr.index.vector_index import load_index

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{directory}: index directory not found; build one with "
            "`icr index build --checkpoint C --data D --out DIR`"
        )
    manifest = Manifest.read(directory / MANIFEST_FILE)
    rebuild = f"rebuild it with `{manifest.rebuild_command(directory, manifest.checkpoint_path)}`"
    for name, recorded in manifest.files.items():  # manifests before files were recorded: none
        file = directory / name
        if file.is_file() and sha256_file(file) != recorded:
            raise ValueError(
                f"{file}: its content changed since the build ({MANIFEST_FILE} records sha256 "
                f"{recorded[:12]}...): replace the whole index folder, never a file inside it, or {rebuild}"
            )
    path = directory / INDEX_FILE
    try:
        index = load_index(path, mmap=mmap)
    except (FileNotFoundError, ValueError) as err:
        raise type(err)(f"{err}; {rebuild}") from None
    if index.d != manifest.dim or index.ntotal != manifest.ntotal:
        raise ValueError(
            f"{path}: holds {index.ntotal} vectors of dim {index.d}, {MANIFEST_FILE} says "
            f"{manifest.ntotal} of dim {manifest.dim}; the folder mixes files of two builds, {rebuild}"
        )
    try:
        metadata = MetadataStore.open(directory / METADATA_FILE)
    except (FileNotFoundError, ValueError) as err:
        raise type(err)(f"{str(err).split('; rebuild')[0]}; {rebuild}") from None
    if metadata.count() != manifest.ntotal:
        count = metadata.count()
        metadata.close()
        raise ValueError(
            f"{directory / METADATA_FILE}: {count} rows for {manifest.ntotal} vectors; {rebuild}"
        )
    return index, manifest, metadata
