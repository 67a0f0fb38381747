"""An index folder loaded for serving, and the checks that the artifacts belong together.

``preflight`` compares checkpoint and indices by their manifests (cheap: the server runs it before
loading anything, so a mismatch stops it with one message); :func:`load_index_folder` loads one
folder (FAISS, metadata, calibration) with its micro-batcher and filter cache, and records the
files read while serving, so a file rewritten in place under the server is noticed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import faiss
import numpy as np
from threadpoolctl import ThreadpoolController

from icr.index.calibration import CALIBRATION_FILE, ServedCalibration
from icr.index.exact_kernel import kernel_for
from icr.index.feedback_labels import index_key
from icr.index.filters import Filter, FilterCache
from icr.index.index_folder import load_index_dir
from icr.index.live_index import LiveIndex, base_ids
from icr.index.live_snapshot import snapshot_log
from icr.index.live_writes import WRITES_FILE, Ack, NewImage
from icr.index.manifest import MANIFEST_FILE, Manifest, check_compatible
from icr.index.metadata import MetadataStore
from icr.index.rerank import RAW_FILE, is_reranked
from icr.index.vector_index import (
    Rescorer,
    VectorReader,
    batch_independent_rescorer,
    has_gpu_form,
    nprobe_of,
    rescored,
    search,
    set_nprobe,
    stored_vectors,
    use_gpu,
)
from icr.service.batcher import MicroBatcher
from icr.service.quality import calibration_due
from icr.service.watcher import Stat, changed_in_place, snapshot
from icr.training.checkpoint import CheckpointMeta, read_checkpoint_config

log = logging.getLogger("icr.service")


class NotServable(ValueError):
    """The artifacts cannot be served together; the message says which command fixes it."""


# Files whose bytes are read while serving (SQLite pages, on-disk inverted lists, a memory-mapped
# index), not only at load: rewritten in place, what is served changes under the server.
READ_WHILE_SERVING = ("metadata.sqlite", "index.ivfdata", "index.faiss", RAW_FILE)


class StateView(Protocol):
    """What one request reads of a live index: one state of its writes (:class:`LiveState`), or
    of a sharded index's shards (:class:`service.sharded_index.ShardedState`)."""

    @property
    def seq(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def base_ntotal(self) -> int: ...
    @property
    def ids_end(self) -> int: ...
    @property
    def added(self) -> int: ...
    @property
    def deleted(self) -> int: ...
    def is_live(self, image_id: int) -> bool: ...
    def added_vector(self, image_id: int) -> np.ndarray | None: ...


class Live(Protocol):
    """How the service searches and reads an index: :class:`LiveIndex` (one folder and its write
    log) or :class:`service.sharded_index.ShardedLive` (shards searched as one index)."""

    @property
    def writable(self) -> bool: ...
    @property
    def uploads(self) -> Path | None: ...
    @property
    def state(self) -> StateView: ...
    def refresh(self) -> StateView: ...
    def search(
        self, query: np.ndarray, depth: int, state: Any, selection: Any = None
    ) -> tuple[np.ndarray, np.ndarray]: ...
    def rows(self, ids: Sequence[int], state: Any) -> list[dict[str, Any]]: ...
    def unanswered(self, state: Any) -> list[str]: ...
    def close(self) -> None: ...
    # writes (when ``writable``): each acknowledged once durable, and visible before it returns
    def add(self, images: Sequence[NewImage], who: str) -> list[Ack]: ...
    def patch(self, image_id: int, fields: dict[str, Any], who: str) -> Ack: ...
    def delete(self, ids: Sequence[int], who: str) -> list[Ack]: ...
    def delete_matching(self, filter_: Filter, who: str) -> list[Ack]: ...


class Filters(Protocol):
    def select(self, filter_: Any, state: Any) -> tuple[Any, bool]: ...


@dataclass
class LoadedIndex:
    directory: Path
    index: Any  # faiss.Index (GPU copy when serving on a GPU)
    manifest: Manifest
    metadata: MetadataStore | None  # None: a sharded index (each shard holds its own)
    calibration: ServedCalibration | None
    # every search goes through it: merges concurrent ones, sets FAISS threads (None: a sharded
    # index, whose replicas batch)
    batcher: MicroBatcher | None
    filters: Filters  # the ids recent query filters select (FilterCache)
    # the base index with the writes since its build (images added, patched, deleted online), or the
    # shards of a sharded index: a request takes ``live.state`` once and reads only it
    live: Live
    rescore: Rescorer | None = None  # exact, batch-independent scores (None: FAISS's as they are)
    on_gpu: bool = False
    gpu_resources: Any = None  # faiss.StandardGpuResources: must outlive the GPU index
    # the files read while serving (not only at load), as they were when loaded: see changed_in_place
    served_stats: dict[Path, Stat] = field(default_factory=dict)
    # {metadata field: the JSON kinds its values have}: what a filter's values are checked against
    field_types: dict[str, list[str]] = field(default_factory=dict)
    # the stored vectors by id (searches by a stored image); None: this index cannot give them back
    vectors: VectorReader | None = None

    @property
    def approximate_vectors(self) -> bool:
        """Whether the stored vectors are compressed codes (PQ, SQ): read back, they approximate
        the embeddings that were added (a re-ranked index reads its raw vectors back)."""
        factory = self.manifest.factory
        return any(code in factory for code in ("PQ", "SQ")) and not is_reranked(factory)

    def why_no_vectors(self) -> str:
        """Why :attr:`vectors` is None, and what to do instead."""
        if self.on_gpu:
            held = f"served on the GPU as {self.manifest.factory}"
            fix = "serve it on the CPU (icr serve --gpu off)"
        else:  # the builder's factories all can on the CPU: this index was made some other way
            held = f"a FAISS {type(self.index).__name__}"
            fix = "rebuild it with icr index build"
        return (
            f"the index {self.directory.name!r} ({held}) cannot give back its stored vectors, so it "
            f"cannot search from a stored image; {fix}, or send the image's embedding to POST "
            "/v1/search/vector"
        )

    def folder_live(self, action: str) -> LiveIndex:
        """The live index of this server's own index folder; NotServable saying why ``action``
        (e.g. "take writes") needs one when it serves shards."""
        if not isinstance(self.live, LiveIndex):
            raise NotServable(
                f"this server coordinates index shards, which cannot {action} yet: do it on the source "
                "index folder and cut it into shards again (icr index shard)"
            )
        return self.live

    def changed_in_place(self) -> list[Path]:
        """Served files rewritten on disk since they were loaded (same inode, other size or mtime):
        their open handles may now read bytes of another build. A file replaced by a rename is not
        listed: the handles keep reading the old one, which is still whole."""
        return changed_in_place(self.served_stats, snapshot(list(self.served_stats)))

    @property
    def source_root(self) -> str | None:
        """The folder the gallery's files are shown relative to: the dataset, the photo folder, or
        for an index built from embeddings the folder those were made from."""
        data = self.manifest.data
        origin = data.get("origin") if data.get("kind") == "embeddings" else None
        return str(origin["path"]) if isinstance(origin, dict) and origin.get("path") else data.get("path")

    def calibration_due(self) -> str | None:
        """The warning that the live index has changed past what its calibration (fitted on the
        build) was measured to survive, None while it has not (:func:`service.quality.calibration_due`)."""
        state, m = self.live.state, self.manifest  # a compacted folder's own changes count too
        return calibration_due(m.added_count + state.added, state.deleted, m.built)

    def summary(self) -> dict[str, Any]:
        m, state = self.manifest, self.live.state
        distractors = m.data.get("distractor_source")
        data = {  # names, never the server's paths
            "name": Path(m.data.get("path", "")).name,
            "kind": m.data.get("kind"),
            "split": m.data.get("split"),
            "distractor_source": distractors
            if distractors in (None, "generator")
            else Path(distractors).name,
            "skipped_files": len(m.data.get("skipped") or []),
        }
        return {
            "name": self.directory.name,  # a name, never the server's absolute path
            "modality": m.modality,
            "factory": m.factory,
            "dim": m.dim,
            "ntotal": m.ntotal,
            "gallery_count": m.gallery_count,
            "distractor_count": m.distractor_count,
            "recall_check": m.recall_check,
            "nprobe": m.recall_check.get("nprobe"),
            "on_gpu": self.on_gpu,
            "images": state.size,  # live now: the build's, less deletions, plus additions
            "writes": {
                "seq": state.seq,
                "added": state.added,
                "deleted": state.deleted,
                "accepted": self.live.writable,
                # the warning searches carry once writes outgrow what the calibration survives
                "calibration_due": self.calibration is not None and self.calibration_due() is not None,
            },
            "metadata_fields": m.metadata_fields,
            "metadata_field_types": self.field_types,
            "data": data,
        }


def preflight(
    index: Path, checkpoint: Path | None, caption_index: Path | None
) -> tuple[Path, CheckpointMeta]:
    """Cheap agreement check of checkpoint and indices (no weights or vectors loaded).

    Returns (checkpoint folder, its config). Raises NotServable with one message naming every
    problem and the command that rebuilds what.
    """
    try:
        manifest = Manifest.read(Path(index) / MANIFEST_FILE)
    except (FileNotFoundError, ValueError) as err:
        raise NotServable(f"--index {index}: {err}") from None
    if manifest.modality != "image":
        raise NotServable(
            f"--index {index} holds {manifest.modality} vectors; text->image search needs an image index "
            f"(pass the caption index as --caption-index)"
        )
    checkpoint = Path(checkpoint or manifest.checkpoint_path)
    try:
        config = read_checkpoint_config(checkpoint)
    except (FileNotFoundError, ValueError) as err:
        raise NotServable(f"--checkpoint {checkpoint}: {err}") from None
    problems = []
    for directory, modality in ((index, "image"), (caption_index, "text")):
        if directory is None:
            continue
        try:
            m = manifest if directory == index else Manifest.read(Path(directory) / MANIFEST_FILE)
            if m.modality != modality:
                raise ValueError(f"holds {m.modality} vectors, expected {modality}")
            check_compatible(m, config, index_dir=directory, checkpoint_path=checkpoint)
        except (FileNotFoundError, ValueError) as err:
            problems.append(f"{directory}: {err}")
    if problems:
        raise NotServable("cannot serve these artifacts together:\n  " + "\n  ".join(problems))
    return checkpoint, config


def _load_calibration(directory: Path, sha256: str) -> ServedCalibration | None:
    """The index's calibration.json (format 2 or 1), None without one; NotServable naming the file
    and the command that refits it when it does not parse or belongs to another checkpoint."""
    path = directory / CALIBRATION_FILE
    if not path.is_file():
        return None
    refit = f"refit it with `icr index calibrate {directory}`"
    try:
        calibration = ServedCalibration.read(path)
    except ValueError as err:  # names the file already
        raise NotServable(f"{err}; {refit}") from None
    except (OSError, AttributeError, KeyError, TypeError) as err:  # unreadable, or JSON but not an object
        raise NotServable(f"{path}: unreadable calibration ({err}); {refit}") from None
    if calibration.info.get("checkpoint_sha256") != sha256:
        raise NotServable(f"{path}: fitted for another checkpoint; {refit}")
    return calibration


def _batcher(index: Any, rescore: Rescorer | None, max_batch: int, faiss_threads: int) -> MicroBatcher:
    # A batch over a flat index goes to our kernel, which reads the gallery once per batch (FAISS
    # scans it once per query below 20 queries). A lone query on one thread stays with FAISS's scan
    # (the faster one-thread scan: 27.0 ms at 1M x 128 against the kernel's 33.8); given more
    # threads it goes to the kernel's matrix-vector scan on that many (23.2 ms on 2 cores, where
    # FAISS's parallel scan takes 51.8; icr bench on a 2-core AMD EPYC, 2026-11-27). Scores then
    # depend on the kernel a query lands in; the hits are rescored so they do not.
    kernel = kernel_for(index)
    # what a served index's first search would pay once is paid here, at load: the exact kernel's
    # batch pass (compiled, or loaded from numba's cache); the 8-bit list scan's copy of the lists
    # and its kernels (784 ms on the demo's 101k IVF1271,SQ8,RFlat, then 1.0 ms a search)
    if kernel is not None:
        kernel.warm()
    else:
        search(index, np.zeros((1, index.d), np.float32), 1)
    blas = ThreadpoolController() if kernel is not None and faiss_threads > 1 else None

    def run(queries: np.ndarray, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if kernel is not None and len(queries) > 1:
            found_s, found_i = kernel.search(queries, k)  # (Q, k') each, k' = min(k, N)
            scores, ids = list(found_s), list(found_i)
        elif kernel is not None and blas is not None:
            with blas.limit(limits=faiss_threads, user_api="blas"):
                found_s, found_i = kernel.search(queries, k)  # (1, k')
            scores, ids = list(found_s), list(found_i)
        else:
            scores, ids = search(index, queries, k)
        return (scores, ids) if rescore is None else rescored(rescore, queries, ids)

    return MicroBatcher(run, max_batch=max_batch, single_threads=faiss_threads)


def load_index_folder(
    directory: Path,
    gpu: str,
    max_batch: int,
    faiss_threads: int,
    writes: Path | None = None,
    *,
    mmap: bool = False,
) -> LoadedIndex:
    """``writes``: the state directory whose write log this index takes writes into (None: none). A
    snapshot folder (:mod:`index.live_snapshot`) is served with the log it carries, written to only
    when ``writes`` is given. ``mmap``: an exact or inverted-file index is read in place from the
    page cache, shared by every process serving the same folder, instead of copied into each."""
    index, manifest, metadata = load_index_dir(directory, mmap=mmap)
    calibration = _load_calibration(directory, manifest.checkpoint_sha256)
    nprobe = manifest.recall_check.get("nprobe")
    if nprobe and nprobe_of(index) is not None:
        set_nprobe(index, int(nprobe))  # the value the build tuned to reach its recall target
    resources = None
    # an HNSW graph and fast-scan codes (CPU SIMD kernels) stay on the CPU
    if use_gpu(gpu) and has_gpu_form(manifest.factory) and isinstance(index, faiss.Index):
        resources = faiss.StandardGpuResources()
        index = faiss.index_cpu_to_gpu(resources, 0, index)
    served = snapshot([directory / name for name in READ_WHILE_SERVING if (directory / name).is_file()])
    vectors = stored_vectors(index)
    rescore = batch_independent_rescorer(index)
    batcher = _batcher(index, rescore, max_batch, faiss_threads)
    log = snapshot_log(directory) or (None if writes is None else writes / WRITES_FILE)
    live = LiveIndex(
        index,
        metadata,
        log,
        index_key(manifest.checkpoint_sha256, manifest.created),
        batched=batcher.search,
        rescore=rescore,
        writable=writes is not None,
        base=base_ids(directory, manifest),
    )
    filters = FilterCache(metadata, manifest.ntotal, live=live)
    return LoadedIndex(
        directory,
        index,
        manifest,
        metadata,
        calibration,
        batcher,
        filters,
        live,
        rescore,
        resources is not None,
        resources,
        served,
        field_types=_field_types(directory, manifest, metadata),
        vectors=vectors,
    )


def _field_types(directory: Path, manifest: Manifest, metadata: MetadataStore) -> dict[str, list[str]]:
    """{field: kinds} as the build recorded them; an index built before they were recorded has them
    read from its metadata once, here (one pass over metadata.sqlite, ~2 s per million rows)."""
    recorded = manifest.metadata_field_types
    if recorded is not None:
        return {name: list(recorded.get(name, [])) for name in manifest.metadata_fields}
    if not manifest.metadata_fields:
        return {}
    t0 = time.perf_counter()
    stored = metadata.field_types()
    log.info(
        "%s: its manifest predates recorded field kinds; read them from %s in %.2f s "
        "(a rebuild records them)",
        directory.name,
        metadata.path.name,
        time.perf_counter() - t0,
    )
    return {name: list(stored.get(name, [])) for name in manifest.metadata_fields}


def public_source(source: str, root: str | None) -> str:
    """A hit's source as clients see it: a gallery file relative to the dataset folder the index was
    built from (or its file name), never the server's absolute path; other sources as they are."""
    path, sep, row = source.partition("#")  # precomp: features.npy#row
    if not os.path.isabs(path):
        return source
    if root:
        try:
            return str(Path(path).relative_to(Path(root).resolve())) + sep + row
        except ValueError:
            pass
    return Path(path).name + sep + row


def calibration_summary(calibration: ServedCalibration | None) -> dict[str, Any] | None:
    """The /v1/info calibration block: which map is served, what labelled its fit, the per-kind
    table and the held-out evaluation's pooled figures per map (format 1: what such a file has)."""
    if calibration is None:
        return None
    info = calibration.info
    out: dict[str, Any] = {
        "format_version": info.get("format_version"),
        "method": calibration.method,
        "global_method": calibration.global_map.method,
        "labels": info.get("labels"),
        "labels_note": calibration.labels_note,
        "fit": info.get("fit"),
        "kinds": calibration.kinds,
        "score_for_relevance": info.get("score_for_relevance"),
        # which text queries get a relevance at all (null: a file from before the check)
        "evidence": None
        if calibration.evidence is None
        else {"alpha": calibration.evidence.alpha, "queries": len(calibration.evidence.reference)},
    }
    evaluation = info.get("evaluation")
    if isinstance(evaluation, dict):
        maps = evaluation.get("maps") or {}
        out["evaluation"] = {
            **{k: v for k, v in evaluation.items() if k != "maps"},
            "maps": {name: (r or {}).get("pooled") for name, r in maps.items()},
        }
    for key in ("ece", "score_thresholds_for_precision", "global_ece_all_pairs"):  # format 1; split fits
        if key in info:
            out[key] = info[key]
    return out
