"""Search over loaded artifacts, with no FastAPI: encode a query, search FAISS, threshold, paginate.

Thresholds are applied before pagination, over the ``search_depth`` nearest neighbours: FAISS GPU
has no range search, so every backend retrieves top-``depth`` and filters. ``passed_is_exact`` says
whether the count of passing hits is complete (some candidate failed the threshold, or the whole
index was retrieved) or a lower bound. A calibrated threshold filters on the relevance itself, so
every returned hit provably meets it; ``threshold.score`` reports the equivalent raw score for this
query (the lowest retrieved score that passed).

Relevance comes from the index's ``calibration.json`` (:class:`index.calibration.ServedCalibration`):
the per-query map where the file has one (format 2), else its global score -> probability map
(format 1 files hold only that). The per-query map was fitted on text queries (their score lists
and embeddings), so image queries (the caption index) are mapped by the global map.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from icr.core.devices import resolve_device
from icr.core.image_input import GALLERY_FORMATS, ImageLimits, ImageRefused, open_image
from icr.index.build import load_index_dir
from icr.index.calibration import CALIBRATION_FILE, ServedCalibration
from icr.index.exact_kernel import kernel_for
from icr.index.filters import Filter, FilterCache
from icr.index.manifest import MANIFEST_FILE, Manifest, check_compatible
from icr.index.metadata import MetadataStore
from icr.index.vector_index import (
    Rescorer,
    batch_independent_rescorer,
    has_gpu_form,
    nprobe_of,
    rescored,
    search,
    set_nprobe,
    use_gpu,
)
from icr.service.batcher import MicroBatcher
from icr.service.quality import TOP_N, over_embedded_benchmark
from icr.service.watcher import Stat, changed_in_place, snapshot
from icr.training.checkpoint import load_checkpoint, read_checkpoint_config
from icr.training.data.synthetic.generate import DistractorStream
from icr.training.evaluation.metrics.query_evidence import Evidence

log = logging.getLogger("icr.service")
DISTRACTOR_PREFIX = "distractor:"


THUMB_CACHE_BYTES = 64 << 20
GALLERY_LIMITS = ImageLimits(formats=GALLERY_FORMATS)  # the server passes its own pixel and aspect limits


class BytesLRU:
    """A thread-safe LRU of byte strings bounded by their total size."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self._items: OrderedDict[Any, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> bytes | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Any, value: bytes) -> None:
        if len(value) > self.capacity:
            return
        with self._lock:
            old = self._items.pop(key, None)
            self.size += len(value) - (len(old) if old is not None else 0)
            self._items[key] = value
            while self.size > self.capacity:
                _, dropped = self._items.popitem(last=False)
                self.size -= len(dropped)


class NotServable(ValueError):
    """The artifacts cannot be served together; the message says which command fixes it."""


# Files whose bytes are read while serving (SQLite pages, on-disk inverted lists, a memory-mapped
# index), not only at load: rewritten in place, what is served changes under the server.
READ_WHILE_SERVING = ("metadata.sqlite", "index.ivfdata", "index.faiss")


@dataclass
class LoadedIndex:
    directory: Path
    index: Any  # faiss.Index (GPU copy when serving on a GPU)
    manifest: Manifest
    metadata: MetadataStore
    calibration: ServedCalibration | None
    batcher: MicroBatcher  # every search goes through it: merges concurrent ones, sets FAISS threads
    filters: FilterCache  # the ids recent query filters select
    rescore: Rescorer | None = None  # exact, batch-independent scores (None: FAISS's as they are)
    on_gpu: bool = False
    gpu_resources: Any = None  # faiss.StandardGpuResources: must outlive the GPU index
    # the files read while serving (not only at load), as they were when loaded: see changed_in_place
    served_stats: dict[Path, Stat] = field(default_factory=dict)

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

    def summary(self) -> dict[str, Any]:
        m = self.manifest
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
            "ntotal": m.ntotal,
            "gallery_count": m.gallery_count,
            "distractor_count": m.distractor_count,
            "recall_check": m.recall_check,
            "nprobe": m.recall_check.get("nprobe"),
            "on_gpu": self.on_gpu,
            "metadata_fields": m.metadata_fields,
            "data": data,
        }


@dataclass
class Page:
    """One page of thresholded hits: ids/scores/relevance are the page's, counts are the whole query's."""

    threshold: dict[str, Any]
    passed: int
    passed_is_exact: bool
    searched: int
    k: int
    offset: int
    ids: np.ndarray  # (n,) int64
    scores: np.ndarray  # (n,) float32
    relevance: np.ndarray | None  # (n,) float64
    rows: list[dict[str, Any]] = field(default_factory=list)
    calibration: str | None = None  # the map that produced relevance: "per_query" | "global" | None
    expected_relevant: float | None = None  # sum of relevance over every hit that passed
    top_relevance: float | None = None  # mean relevance of the top TOP_N retrieved (before threshold/offset)
    top_count: int = 0  # how many retrieved hits top_relevance averages (TOP_N, or fewer in a tiny index)
    matched: int | None = None  # items the query's filter selects (None: no filter)
    evidence: Evidence | None = None  # what the calibration has seen of a text query (None: not checked)

    @property
    def expected_precision(self) -> float | None:
        """Mean relevance of this page's hits (None without calibration or hits)."""
        if self.relevance is None or len(self.relevance) == 0:
            return None
        return float(self.relevance.mean())


def preflight(
    index: Path, checkpoint: Path | None, caption_index: Path | None
) -> tuple[Path, dict[str, Any]]:
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
    # scans it once per query below 20 queries); a lone query stays with FAISS's one-thread scan,
    # at the bandwidth floor. Scores then depend on the kernel a query lands in; the hits are
    # rescored so they do not.
    kernel = kernel_for(index)

    def run(queries: np.ndarray, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if kernel is not None and len(queries) > 1:
            found_s, found_i = kernel.search(queries, k)  # (Q, k') each, k' = min(k, N)
            scores, ids = list(found_s), list(found_i)
        else:
            scores, ids = search(index, queries, k)
        return (scores, ids) if rescore is None else rescored(rescore, queries, ids)

    return MicroBatcher(run, max_batch=max_batch, single_threads=faiss_threads)


def _load_index(directory: Path, gpu: str, max_batch: int, faiss_threads: int) -> LoadedIndex:

    index, manifest, metadata = load_index_dir(directory)
    calibration = _load_calibration(directory, manifest.checkpoint_sha256)
    nprobe = manifest.recall_check.get("nprobe")
    if nprobe and nprobe_of(index) is not None:
        set_nprobe(index, int(nprobe))  # the value the build tuned to reach its recall target
    resources = None
    if use_gpu(gpu) and has_gpu_form(manifest.factory):  # an HNSW graph stays on the CPU
        import faiss  # noqa: PLC0415 (faiss: only this path needs it)

        resources = faiss.StandardGpuResources()
        index = faiss.index_cpu_to_gpu(resources, 0, index)
    served = snapshot([directory / name for name in READ_WHILE_SERVING if (directory / name).is_file()])
    rescore = batch_independent_rescorer(index)
    batcher = _batcher(index, rescore, max_batch, faiss_threads)
    filters = FilterCache(metadata, manifest.ntotal)
    return LoadedIndex(
        directory,
        index,
        manifest,
        metadata,
        calibration,
        batcher,
        filters,
        rescore,
        resources is not None,
        resources,
        served,
    )


class Retriever:
    """The loaded model and indices; thread-safe for concurrent searches (FAISS and torch in eval
    mode are re-entrant, the metadata store serialises its reads)."""

    def __init__(
        self,
        model: Any,
        config: dict[str, Any],
        checkpoint: Path,
        images: LoadedIndex,
        captions: LoadedIndex | None,
        device: str = "cpu",
    ):
        self.model = model
        self.config = config
        self.checkpoint = checkpoint
        self.images = images
        self.captions = captions
        self.device = device
        if captions is not None and captions.calibration is None:
            # Same checkpoint, same cosine score: the image index's map holds for captions too.
            captions.calibration = images.calibration
        # Text queries over the embedded benchmark get their query kind (and the model's figures for it).
        self.benchmark = over_embedded_benchmark(images.manifest.data)
        self._image_transform = model.image_transform(train=False)
        self._distractors: Any = None
        self._thumbs = BytesLRU(THUMB_CACHE_BYTES)

    @classmethod
    def load(
        cls,
        index: Path,
        checkpoint: Path | None = None,
        caption_index: Path | None = None,
        *,
        device: str = "cpu",
        gpu: str = "auto",
        faiss_threads: int = 1,
        micro_batch: int = 64,
    ) -> Retriever:
        """``faiss_threads``: OpenMP threads of a one-query search (set per searching thread by the
        batcher, since OpenMP's setting is per thread); ``micro_batch``: most queries per FAISS call."""

        checkpoint, _ = preflight(index, checkpoint, caption_index)
        t0 = time.perf_counter()
        device = resolve_device(device)
        model, config = load_checkpoint(checkpoint, device)
        images = _load_index(Path(index), gpu, micro_batch, faiss_threads)
        captions = (
            _load_index(Path(caption_index), gpu, micro_batch, faiss_threads)
            if caption_index is not None
            else None
        )
        log.info("loaded %s and %s in %.1f s", checkpoint, index, time.perf_counter() - t0)
        return cls(model, config, checkpoint, images, captions, device)

    def integrity_problem(self) -> str | None:
        """Why the served artifacts can no longer be trusted (None: they can): a file read while
        serving was rewritten in place since it was loaded. A few stat calls: cheap per request."""
        loaded = [self.images, *([self.captions] if self.captions is not None else [])]
        changed = [
            f"{index.directory.name}/{path.name}" for index in loaded for path in index.changed_in_place()
        ]
        if not changed:
            return None
        return (
            f"{', '.join(changed)} changed on disk while being served (same file, other size or modification "
            "time), so results could mix two builds; restore the file, or rebuild the index folder (icr "
            "index build renames a complete one into place), then POST /v1/admin/reload or restart"
        )

    # --- encoding ---------------------------------------------------------------------------------
    @property
    def accepts_images(self) -> bool:
        """False for checkpoints whose image tower reads precomputed region features."""
        return bool(self.model.preprocessing.get("input") == "image")

    def encode_text(self, text: str) -> np.ndarray:
        """(1, D) float32, L2-normalised by the model."""
        import torch  # noqa: PLC0415 (torch takes seconds to import)

        with torch.inference_mode():
            batch = {k: v.to(self.device) for k, v in self.model.tokenize([text]).items()}
            out: np.ndarray = self.model.encode_text(batch).float().cpu().numpy()  # (1, D)
            return out

    def encode_image(self, image: Any) -> np.ndarray:
        """(1, D) float32 of a PIL image (RGB)."""
        import torch  # noqa: PLC0415 (torch takes seconds to import)

        with torch.inference_mode():
            x = self._image_transform(image, np.random.default_rng(0))  # (C, S, S)
            x = x.unsqueeze(0).to(self.device)  # (1, C, S, S)
            out: np.ndarray = self.model.encode_image(x).float().cpu().numpy()  # (1, D)
            return out

    # --- searching --------------------------------------------------------------------------------
    def search(
        self,
        target: LoadedIndex,
        query: np.ndarray,
        *,
        k: int,
        offset: int,
        depth: int,
        min_score: float | None = None,
        min_relevance: float | None = None,
        calibrated: bool = True,
        text: str | None = None,
        filter_: Filter | None = None,
        timings: dict[str, float],
    ) -> Page:
        """Top-``depth`` neighbours of ``query`` (1, D), thresholded, then hits [offset, offset + k).

        ``calibrated=False``: no relevance, since the calibration maps caption-image scores and an
        image-image score has no such meaning. A text query (``text`` given, image index) is mapped
        by the calibration's per-query map when it has one; an image query (caption index) by its
        global map, as the per-query map reads a text query's words, embedding and score list.
        """
        calibration = target.calibration if calibrated else None
        evidence = None
        if calibration is not None and calibration.evidence is not None and text is not None:
            # no promise without evidence: outside it, no relevance and min_relevance passes nothing
            evidence = calibration.evidence.assess(text, self.model.unknown_words(text))
        if min_relevance is not None and calibration is None:
            raise NotServable(
                f"min_relevance needs a calibration: run `icr index calibrate` on the index folder "
                f"{target.directory.name!r} and "
                "restart, or threshold by min_score"
            )
        depth = max(1, min(depth, target.manifest.ntotal))
        t0 = time.perf_counter()
        scores, ids = target.batcher.search(query, depth)  # (n,) best first
        relevance = method = matched = None
        if filter_ is not None:
            selection, cached = target.filters.select(filter_)
            timings["select_ms"] = timings.get("select_ms", 0.0) + (
                0.0 if cached else selection.seconds * 1000
            )
            matched = len(selection.ids)
            f_scores, f_ids = self._filtered(target, query, depth, selection)
        t1 = time.perf_counter()
        if calibration is not None and (evidence is None or evidence.inside):
            if filter_ is None:
                relevance = calibration.relevance(scores, query, text)  # (n,)
            else:
                relevance = _relevance_of_subset(calibration, scores, ids, f_scores, f_ids, query, text)
            method = calibration.method if text is not None else "global"
        if filter_ is not None:
            scores, ids = f_scores, f_ids
        if min_score is not None:
            keep = scores >= min_score
            threshold = {"kind": "min_score", "value": min_score, "score": min_score}
        elif min_relevance is not None:
            # without a calibration it was refused above; outside its evidence nothing passes
            keep = relevance >= min_relevance if relevance is not None else np.zeros(len(scores), bool)
            # Relevance never rises down a best-first list, so the passing hits are a prefix and
            # their lowest score is this query's raw-score equivalent of the threshold.
            threshold = {
                "kind": "min_relevance",
                "value": min_relevance,
                "score": float(scores[keep].min()) if keep.any() else None,
            }
        else:
            keep = np.ones(len(scores), bool)
            threshold = {"kind": "none", "value": None, "score": None}
        passed = int(keep.sum())
        window = slice(offset, offset + k)
        page_ids, page_scores = ids[keep][window], scores[keep][window]
        page_rel = relevance[keep][window] if relevance is not None else None
        top_count = min(TOP_N, len(scores))
        expected_relevant = top_relevance = None
        if relevance is not None:
            expected_relevant = float(relevance[keep].sum())
            top_relevance = float(relevance[:top_count].mean()) if top_count else None
        t2 = time.perf_counter()
        rows = target.metadata.get(page_ids.tolist())
        t3 = time.perf_counter()
        timings["search_ms"] = timings.get("search_ms", 0.0) + (t1 - t0) * 1000
        timings["filter_ms"] = timings.get("filter_ms", 0.0) + (t2 - t1) * 1000
        timings["metadata_ms"] = timings.get("metadata_ms", 0.0) + (t3 - t2) * 1000
        return Page(
            threshold=threshold,
            passed=passed,
            passed_is_exact=passed < len(scores)
            or len(scores) >= (target.manifest.ntotal if matched is None else matched),
            searched=len(scores),
            k=k,
            offset=offset,
            ids=page_ids,
            scores=page_scores,
            relevance=page_rel,
            rows=rows,
            calibration=method,
            expected_relevant=expected_relevant,
            top_relevance=top_relevance,
            top_count=top_count,
            matched=matched,
            evidence=evidence,
        )

    @staticmethod
    def _filtered(
        target: LoadedIndex, query: np.ndarray, depth: int, selection: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``depth`` among the selected ids, best first: FAISS searches only them; an index that
        cannot (older FAISS GPU indices) is searched unfiltered to depth and the matches kept."""

        if len(selection.ids) == 0:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        try:
            rows = search(target.index, query, min(depth, len(selection.ids)), selector=selection.selector)
        except RuntimeError:
            scores, ids = target.batcher.search(query, depth)
            keep = np.isin(ids, selection.ids)
            return scores[keep], ids[keep]
        if target.rescore is not None:  # the scores the unfiltered search reports for the same ids
            rows = rescored(target.rescore, query, rows[1])
        return rows[0][0], rows[1][0]

    def batching(self) -> dict[str, dict[str, int]]:
        """Per index: FAISS calls made and queries they answered (queries / calls = mean batch)."""
        return {
            loaded.manifest.modality: {
                "calls": loaded.batcher.batches,
                "queries": loaded.batcher.batched_queries,
            }
            for loaded in (self.images, self.captions)
            if loaded is not None
        }

    # --- images -----------------------------------------------------------------------------------
    def has_pixels(self, row: dict[str, Any]) -> bool:
        source = row["source"]
        return source.startswith(DISTRACTOR_PREFIX) or "#" not in source

    def image(self, image_id: int, limits: ImageLimits = GALLERY_LIMITS) -> Any:
        """The PIL image of an image-index id; KeyError if unknown, OSError without pixels or when
        its file is outside ``limits`` (a file replaced since the build is as untrusted as an upload)."""

        if not 0 <= image_id < self.images.manifest.ntotal:
            raise KeyError(image_id)
        row = self.images.metadata.get([image_id])[0]
        source = row["source"]
        if source.startswith(DISTRACTOR_PREFIX):
            return Image.fromarray(self._distractor_stream().image(int(source[len(DISTRACTOR_PREFIX) :])))
        shown = public_source(source, self.images.source_root)  # errors reach clients: never a server path
        if "#" in source:
            raise FileNotFoundError(f"item {image_id} is a row of precomputed features ({shown}): no image")
        try:
            return open_image(source, limits)
        except ImageRefused as err:  # over the limits, another format, or damaged since the build
            raise OSError(f"{shown}: {err}") from None
        except OSError as err:  # moved or unreadable since the build (its message names the path)
            raise OSError(f"{shown}: {err.strerror or 'not a readable image'}") from None

    def _distractor_stream(self) -> Any:
        if self._distractors is None:
            data = Path(self.images.manifest.data["path"])
            self._distractors = DistractorStream.for_dataset(data, self.images.manifest.distractor_count)
        return self._distractors

    def png(
        self,
        image_id: int,
        thumb_size: int | None,
        limits: ImageLimits = GALLERY_LIMITS,
        decoding: AbstractContextManager[Any] | None = None,
    ) -> bytes:
        """The image as PNG; thumbnails (a results page asks for the same ones again and again) come
        from an LRU cache of :data:`THUMB_CACHE_BYTES`. ``decoding`` is held while the image is
        decoded and encoded (the server's bound on concurrent decodes), not for a cached thumbnail."""
        if thumb_size is not None:
            cached = self._thumbs.get((image_id, thumb_size))
            if cached is not None:
                return cached
        out = io.BytesIO()
        with decoding or nullcontext():
            image = self.image(image_id, limits)
            if thumb_size is not None:
                image.thumbnail((thumb_size, thumb_size))
            image.save(out, format="PNG")
            del image
        data = out.getvalue()
        if thumb_size is not None:
            self._thumbs.put((image_id, thumb_size), data)
        return data

    # --- description ------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        c = self.config
        return {
            "checkpoint": {
                "name": self.checkpoint.name,
                "sha256": c.get("weights_sha256"),
                "objective": c.get("objective"),
                "decoding": c.get("decoding"),
                "step": c.get("step"),
                "embed_dim": c.get("embed_dim"),
                "accepts_images": self.accepts_images,
            },
            "index": self.images.summary(),
            "caption_index": self.captions.summary() if self.captions is not None else None,
            "calibration": calibration_summary(self.images.calibration),
            "device": self.device,
        }


def _relevance_of_subset(
    calibration: ServedCalibration,
    scores: np.ndarray,  # (n,) the unfiltered top-depth, best first
    ids: np.ndarray,  # (n,)
    f_scores: np.ndarray,  # (m,) the filtered hits, best first
    f_ids: np.ndarray,  # (m,)
    query: np.ndarray,
    text: str | None,
) -> np.ndarray:
    """(m,) relevance of the filtered hits as the unfiltered list's map gives it; hits beyond that
    list are appended to it (ranked just below it) and the result kept non-increasing."""
    position = {int(i): j for j, i in enumerate(ids)}
    out = np.empty(len(f_ids))  # (m,)
    found = np.array([int(i) in position for i in f_ids], dtype=bool)
    base = calibration.relevance(scores, query, text)  # (n,) the map reads the list as it is
    out[found] = base[[position[int(i)] for i in f_ids[found]]]
    if not found.all():  # below it: mapped as if ranked just after its end, never above its last
        extended = calibration.relevance(np.concatenate([scores, f_scores[~found]]), query, text)
        tail = extended[len(scores) :]
        out[~found] = np.minimum(tail, base[-1]) if len(base) else tail
    return np.minimum.accumulate(out) if len(out) else out


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
