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
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from icr.core.atomic import fsync_file, sha256_file, staged_dir
from icr.core.devices import resolve_device
from icr.core.memory import peak_rss_mb
from icr.index.distractor_sources import Distractors, distractor_stream
from icr.index.factory_choice import Targets, choose_by_measurement
from icr.index.gallery_streams import (
    Stream,
    caption_gallery,
    embedded_gallery,
    feed,
    image_gallery,
    photo_gallery,
)
from icr.index.graph import GRAPH_FILE, GraphIndex, build_graph, graph_links, is_graph
from icr.index.index_folder import INDEX_FILE
from icr.index.manifest import MANIFEST_FILE, Manifest, Modality
from icr.index.metadata import METADATA_FILE, MetadataStore
from icr.index.on_disk import ONDISK_DATA, OnDiskBuild, build_on_disk, choose_on_disk_factory, load_on_disk
from icr.index.rerank import RAW_FILE, Rerank, RerankedIndex, is_reranked, load_raw, raw_blocks, save_raw
from icr.index.vector_index import (
    ExactTopK,
    Searchable,
    build_index,
    choose_factory,
    exact_depth,
    nprobe_of,
    parse_factory,
    random_training_sample,
    recall_at_k,
    save_index,
    tune_ef,
    tune_nprobe,
    use_gpu,
)
from icr.training.checkpoint import CheckpointMeta, load_checkpoint
from icr.training.data.training_data import open_split
from icr.training.embedding import embed_captions, embed_images

# Default memory budget for the index's codes: raw float32 vectors up to 2 GiB (1M x 512), PQ above.
DEFAULT_MEMORY_BUDGET = 2 << 30
RECALL_QUERIES = 200
RECALL_K = 10
# What an IVF index's nprobe is tuned to reach on the held-out queries: recall@10, and recall of the
# top SEARCH_DEPTH (the service's ICR_SEARCH_DEPTH, where thresholds count what passes them).
NPROBE_TARGET = 0.98
SEARCH_DEPTH = 1000
DEPTH_TARGET = 0.95
_BUILDING = ".building-"
# An inverted file's stream, spilled while it is built so that it trains on a random sample of it
STREAM_FILE = "stream.f32"


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
    dim = config.embed_dim
    if embeddings is not None:
        gallery, queries, query_modality, fields, source = embedded_gallery(
            Path(embeddings), checkpoint, config, recall_queries, seed, progress
        )
    else:
        assert images is not None
        gallery, queries, query_modality, fields, source = photo_gallery(
            model, images, metadata, skip_bad, workers, batch_size, device, recall_queries, seed, progress
        )
    extra = distractor_stream(model, None, given, dim, batch_size, device, progress)
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
    dim = config.embed_dim
    per_image = config.captions_per_image
    data = open_split(Path(data_path), split, captions_per_image=per_image, progress=progress)
    if data.num_images == 0:
        raise ValueError(f"{data_path}: split {split!r} has no images to index")

    rng = np.random.default_rng(seed)
    if modality == "image":
        gallery = image_gallery(model, data, batch_size, device, progress)
        pick = np.sort(rng.choice(len(data.captions), min(recall_queries, len(data.captions)), replace=False))
        queries = embed_captions(model, [data.captions[i] for i in pick], device=device)  # (Q, D)
        extra = distractor_stream(model, data, distractors, dim, batch_size, device, progress)
    else:
        gallery = caption_gallery(model, data, batch_size, device, progress)
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
    config: CheckpointMeta
    device: str
    started: float  # perf_counter at the start of the build


def _write_index(
    out: Path,
    built_by: _Built,
    gallery: Stream,
    extra: Stream | None,
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
    dim = config.embed_dim
    planned = gallery.count + (extra.count if extra is not None else 0)
    measure = False  # auto and in memory: the ANN candidates are measured after the build
    if factory == "auto":
        choose = choose_on_disk_factory if on_disk else choose_factory
        factory, reason = choose(planned, dim, memory_budget_bytes)
        measure = not on_disk and parse_factory(factory)["kind"] == "IVF"
    else:
        reason = "chosen by the caller (--factory)"
        pq = int(parse_factory(factory).get("pq", 0))
        if pq and dim % pq:
            raise ValueError(
                f"--factory {factory}: PQ{pq} cuts each vector into {pq} parts, so the embedding dim "
                f"({dim}) must be a multiple of {pq}; use a divisor of {dim}"
                + (f" (e.g. PQ{dim // 2}x4fs,RFlat)" if dim % 2 == 0 else "")
            )
    reranked, graph = is_reranked(factory), is_graph(factory)
    if on_disk and (graph or "x4fs" in factory or not any(p.startswith("IVF") for p in factory.split(","))):
        raise ValueError(
            f"--on-disk needs an inverted-file factory (IVF<k>,Flat, IVF<k>,PQ<m> or IVF<k>,PQ<m>,RFlat; "
            f"FAISS keeps no fast-scan lists on disk), not {factory}"
        )
    if graph and gpu == "on":
        raise ValueError(f"{factory} has no GPU form (hnswlib builds on the CPU); use --gpu auto or off")

    _remove_stale_builds(out)
    with staged_dir(out, _BUILDING) as tmp:
        exact = ExactTopK(queries, max(exact_depth(RECALL_K), exact_depth(SEARCH_DEPTH)))
        built: dict[str, str] = {}
        on_disk_build = None
        with MetadataStore.create(tmp / METADATA_FILE) as store:
            streams = [gallery] if extra is None else [gallery, extra]
            if on_disk:
                on_disk_build = build_on_disk(
                    feed(streams, store, exact),
                    dim,
                    factory,
                    tmp,
                    INDEX_FILE,
                    memory_budget_bytes=memory_budget_bytes,
                )
                index = load_on_disk(tmp / INDEX_FILE)
                if reranked:  # the raw vectors the build wrote beside the codes, mapped
                    index = RerankedIndex(
                        index,
                        load_raw(tmp / RAW_FILE, index.ntotal, dim, mmap=True),
                        0,
                        Rerank.for_factory(factory),
                    )
                built["built_on"] = "cpu"
            else:
                vectors = feed(streams, store, exact)
                if parse_factory(factory)["kind"] == "IVF":
                    spill = tmp / (RAW_FILE if reranked else STREAM_FILE)
                    index = _trained_on_all(vectors, dim, factory, spill, gpu, built)
                elif graph:
                    index = _graph_of(vectors, dim, factory, tmp, built)
                else:
                    index = build_index(vectors, dim, factory, gpu=gpu, report=built)
            # what each field holds, recorded so the server can refuse a filter of the wrong kind
            # without reading every row at load
            stored = store.field_types()
        field_types = {name: stored.get(name, []) for name in metadata_fields or []}
        n_distractors = extra.count if extra is not None else 0
        ntotal = gallery.count + n_distractors  # as delivered (see gallery_streams.feed)
        if index.ntotal != ntotal:
            raise RuntimeError(f"index holds {index.ntotal} vectors, {ntotal} were streamed")
        if ntotal != planned:  # files left out (--skip-bad) after the factory was chosen for the listing
            left_out = planned - ntotal
            reason += f" (chosen for the {planned:,} items listed; {left_out:,} left out, {ntotal:,} indexed)"
        t0 = time.perf_counter()
        tuned = _tuned(index, factory, reason, measure, exact, queries, memory_budget_bytes)
        index, factory, reason = tuned.index, tuned.factory, tuned.reason
        nprobe, ef_search, recall, deep = tuned.nprobe, tuned.ef_search, tuned.recall, tuned.recall_at_depth
        recall_seconds = time.perf_counter() - t0
        written = [GRAPH_FILE if graph else INDEX_FILE, METADATA_FILE, *([ONDISK_DATA] if on_disk else [])]
        if isinstance(index, RerankedIndex):
            if not reranked:  # chosen by --factory auto: its raw vectors were the inverted file's
                index.raw.tofile(tmp / RAW_FILE)
            written.append(RAW_FILE)
        # an on-disk index and a graph were written by their builds (index.faiss names index.ivfdata)
        if not on_disk and not isinstance(index, GraphIndex):
            save_index(index.codes if isinstance(index, RerankedIndex) else index, tmp / INDEX_FILE)
        for name in written:
            fsync_file(tmp / name)
        timings = {**gallery.timings, **(extra.timings if extra is not None else {})}
        throughput = _throughput(gallery.count, n_distractors, timings)
        manifest = Manifest(
            modality=built_by.modality,
            checkpoint_sha256=config.weights_sha256,
            # absolute: the index is served, calibrated and rebuilt from other working directories
            checkpoint_path=str(Path(built_by.checkpoint).resolve()),
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
            metadata_field_types=field_types,
            rerank=index.rerank.to_dict() if isinstance(index, RerankedIndex) else None,
            extra={
                "embed_device": built_by.device,
                **throughput,
                **{k: round(v, 3) for k, v in timings.items()},
                "recall_seconds": round(recall_seconds, 3),
                **tuned.trials,
                "faiss_threads": faiss.omp_get_max_threads(),
                **(_on_disk_details(on_disk_build, memory_budget_bytes) if on_disk_build is not None else {}),
                **({"gpu_fallback": built["gpu_fallback"]} if "gpu_fallback" in built else {}),
            },
        )
        (tmp / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
        fsync_file(tmp / MANIFEST_FILE)
    return manifest


@dataclass(frozen=True)
class _Tuned:
    """The index as served after its recall check: the factory and why, its setting and recalls."""

    index: Searchable
    factory: str
    reason: str
    nprobe: int | None
    ef_search: int | None
    recall: float
    recall_at_depth: float | None
    trials: dict[str, Any]


def _tuned(
    index: Searchable,
    factory: str,
    reason: str,
    measure: bool,
    exact: ExactTopK,
    queries: np.ndarray,
    memory_budget_bytes: int,
) -> _Tuned:
    """``measure`` (--factory auto, in memory): the candidates measured and the fastest kept;
    otherwise the built index's nprobe (an inverted file) or ef (a graph) tuned to the recall
    targets, or its recall checked (exact and FAISS HNSW)."""
    if measure and isinstance(index, faiss.Index):  # an inverted file of raw vectors or PQ codes
        measured = Targets(RECALL_K, NPROBE_TARGET, SEARCH_DEPTH, DEPTH_TARGET)
        c = choose_by_measurement(
            index, factory, reason, exact, queries, measured, memory_budget_bytes=memory_budget_bytes
        )
        trials = {"factory_trials": c.trials_json()}
        deep = c.recall_at_depth
        return _Tuned(c.index, c.factory, c.reason, c.nprobe, c.ef_search, c.recall, deep, trials)
    if isinstance(index, GraphIndex):
        ef, recall, deep = tune_ef(
            index, exact, queries, RECALL_K, NPROBE_TARGET, depth=SEARCH_DEPTH, depth_target=DEPTH_TARGET
        )
        return _Tuned(index, factory, reason, None, ef, recall, deep, {})
    if nprobe_of(index) is not None:
        nprobe, recall, deep = tune_nprobe(
            index, exact, queries, RECALL_K, NPROBE_TARGET, depth=SEARCH_DEPTH, depth_target=DEPTH_TARGET
        )
        return _Tuned(index, factory, reason, nprobe, None, recall, deep, {})
    return _Tuned(index, factory, reason, None, None, recall_at_k(index, exact, queries, RECALL_K), None, {})


def _trained_on_all(
    vectors: Iterable[np.ndarray], dim: int, factory: str, path: Path, gpu: str, report: dict[str, str]
) -> faiss.Index | RerankedIndex:
    """An inverted file of the streamed ``vectors``, trained on a random sample of all of them, not
    on the first ones the stream brings. A photo folder streams in path order; on 200,000 vectors
    streamed one group after another, training on the first ones cut recall@1000 at nprobe 64 from
    0.98 to 0.72 (docs/results/2026-11-27-training-sample.md). The stream is written to ``path``
    first: a re-ranked index keeps it as its raw vectors, any other deletes it once added."""
    save_raw(path, vectors)
    mapped = load_raw(path, os.path.getsize(path) // (4 * dim), dim, mmap=True)
    sample = random_training_sample(mapped, factory)
    del mapped  # unmapped: the adds read the file in order, a chunk at a time
    index = build_index(raw_blocks(path, dim), dim, factory, train_sample=sample, gpu=gpu, report=report)
    if is_reranked(factory):
        return RerankedIndex(index, load_raw(path, index.ntotal, dim), 0, Rerank.for_factory(factory))
    path.unlink()
    return index


def _graph_of(
    vectors: Iterable[np.ndarray], dim: int, factory: str, folder: Path, report: dict[str, str]
) -> GraphIndex:
    """The graph (:mod:`index.graph`) of the streamed ``vectors``, written to ``folder`` as
    :data:`GRAPH_FILE`. The stream is spilled to a file first and read back mapped: the nodes go in
    at random, and the layout needs every vector's k-means cell."""
    spill = folder / STREAM_FILE
    save_raw(spill, vectors)
    n = os.path.getsize(spill) // (4 * dim)
    mapped = load_raw(spill, n, dim, mmap=True)
    threads = len(os.sched_getaffinity(0))
    ids = np.arange(n, dtype=np.int64)
    graph = build_graph(mapped, ids, graph_links(factory), folder / GRAPH_FILE, threads=threads)
    del mapped
    spill.unlink()
    report["built_on"] = "cpu"  # hnswlib has no GPU form
    return graph


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
