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

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from icr.core.devices import resolve_device
from icr.index.calibration import ServedCalibration
from icr.index.filters import Filter
from icr.service.gallery_images import GalleryImages
from icr.service.loaded_index import (
    LoadedIndex,
    NotServable,
    calibration_summary,
    load_index_folder,
    preflight,
)
from icr.service.quality import TOP_N, over_embedded_benchmark
from icr.service.sharded_index import ShardSet, sharded_index
from icr.training.checkpoint import CheckpointMeta, load_checkpoint
from icr.training.evaluation.metrics.query_evidence import Evidence

log = logging.getLogger("icr.service")


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
    unanswered: list[str] = field(default_factory=list)  # shards left out of this answer (by name)

    @property
    def expected_precision(self) -> float | None:
        """Mean relevance of this page's hits (None without calibration or hits)."""
        if self.relevance is None or len(self.relevance) == 0:
            return None
        return float(self.relevance.mean())


class Retriever:
    """The loaded model and indices; thread-safe for concurrent searches (FAISS and torch in eval
    mode are re-entrant, the metadata store serialises its reads)."""

    def __init__(
        self,
        model: Any,
        config: CheckpointMeta,
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
        self.gallery = GalleryImages(images)  # the pixels of the image index's items

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
        writes: Path | None = None,
        shards: ShardSet | None = None,
        mmap: bool = False,
    ) -> Retriever:
        """``faiss_threads``: OpenMP threads of a one-query search (set per searching thread by the
        batcher, since OpenMP's setting is per thread); ``micro_batch``: most queries per FAISS call;
        ``writes``: the state directory whose write log the image index takes writes into (a sharded
        index's: where uploaded images are kept; each shard keeps its own log);
        ``shards``: serve these shards as the image index (``index`` is one of them, read for the
        agreement check; each shard searches its own folder); ``mmap``: read the image index in
        place (shared by the processes serving it)."""
        checkpoint, _ = preflight(index, checkpoint, caption_index)
        t0 = time.perf_counter()
        device = resolve_device(device)
        model, config = load_checkpoint(checkpoint, device)
        images = (
            load_index_folder(Path(index), gpu, micro_batch, faiss_threads, writes, mmap=mmap)
            if shards is None
            else sharded_index(shards, writes)
        )
        captions = (
            load_index_folder(Path(caption_index), gpu, micro_batch, faiss_threads)
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
        with torch.inference_mode():
            batch = {k: v.to(self.device) for k, v in self.model.tokenize([text]).items()}
            out: np.ndarray = self.model.encode_text(batch).float().cpu().numpy()  # (1, D)
            return out

    def encode_image(self, image: Any) -> np.ndarray:
        """(1, D) float32 of a PIL image (RGB)."""
        with torch.inference_mode():
            x = self._image_transform(image, np.random.default_rng(0))  # (C, S, S)
            x = x.unsqueeze(0).to(self.device)  # (1, C, S, S)
            out: np.ndarray = self.model.encode_image(x).float().cpu().numpy()  # (1, D)
            return out

    def stored_vector(self, target: LoadedIndex, item: int) -> np.ndarray:
        """(1, D) float32: the unit vector of the item ``item`` of ``target``, the query of a search
        by a stored image (normalised again: a compressed code reads back slightly off unit length).
        KeyError when no such id; NotServable (saying why and what to do) when the index cannot give
        its vectors back."""
        state = target.live.state
        if not state.is_live(item):
            raise KeyError(item)
        added = state.added_vector(item)  # (D,) an image added since the build
        if added is not None:
            return unit_query(added.tolist(), target.manifest.dim, "the stored vector")
        if target.vectors is None:
            raise NotServable(target.why_no_vectors())
        stored = target.vectors(np.array([item], np.int64))[0]  # (D,)
        return unit_query(stored.tolist(), target.manifest.dim, "the stored vector")

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
        exclude: int | None = None,
        timings: dict[str, float],
    ) -> Page:
        """Top-``depth`` neighbours of ``query`` (1, D), thresholded, then hits [offset, offset + k).

        ``calibrated=False``: no relevance, since the calibration maps caption-image scores and an
        image-image score has no such meaning. A text query (``text`` given, image index) is mapped
        by the calibration's per-query map when it has one; an image query (caption index) by its
        global map, as the per-query map reads a text query's words, embedding and score list.
        ``exclude``: an id never returned nor counted (a stored image searching for its neighbours);
        one more is retrieved in its place, so ``depth`` candidates are still searched.
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
        state = target.live.state  # the writes this search sees, all of them or none of each
        universe = state.size  # the items the query could be given
        extra = 0
        if exclude is not None and state.is_live(exclude):
            universe, extra = universe - 1, 1
        depth = max(1, min(depth, universe))
        t0 = time.perf_counter()
        # (n,) best first
        scores, ids = _without(exclude, depth, *target.live.search(query, depth + extra, state))
        relevance = method = matched = None
        if filter_ is not None:
            selection, cached = target.filters.select(filter_, state)
            f_scores, f_ids = _without(
                exclude, depth, *target.live.search(query, depth + extra, state, selection)
            )
            # read after the search: a sharded index's shards count and time theirs while searching
            timings["select_ms"] = timings.get("select_ms", 0.0) + (
                0.0 if cached else selection.seconds * 1000
            )
            matched = selection.count
            universe = matched - (extra if exclude is not None and selection.contains(exclude) else 0)
        unanswered = target.live.unanswered(state)
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
        rows = target.live.rows(page_ids.tolist(), state)
        t3 = time.perf_counter()
        timings["search_ms"] = timings.get("search_ms", 0.0) + (t1 - t0) * 1000
        timings["filter_ms"] = timings.get("filter_ms", 0.0) + (t2 - t1) * 1000
        timings["metadata_ms"] = timings.get("metadata_ms", 0.0) + (t3 - t2) * 1000
        return Page(
            threshold=threshold,
            passed=passed,
            passed_is_exact=not unanswered and (passed < len(scores) or len(scores) >= universe),
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
            unanswered=unanswered,
        )

    def batching(self) -> dict[str, dict[str, int]]:
        """Per index: FAISS calls made and queries they answered (queries / calls = mean batch)."""
        return {
            loaded.manifest.modality: {
                "calls": loaded.batcher.batches,
                "queries": loaded.batcher.batched_queries,
            }
            for loaded in (self.images, self.captions)
            if loaded is not None and loaded.batcher is not None
        }

    # --- description ------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        c = self.config
        return {
            "checkpoint": {
                "name": self.checkpoint.name,
                "sha256": c.weights_sha256,
                "objective": c.objective,
                "decoding": c.decoding,
                "step": c.step,
                "embed_dim": c.embed_dim,
                "accepts_images": self.accepts_images,
            },
            "index": self.images.summary(),
            "caption_index": self.captions.summary() if self.captions is not None else None,
            "calibration": calibration_summary(self.images.calibration),
            "device": self.device,
        }


def unit_query(values: list[float], dim: int, field: str = "vector") -> np.ndarray:
    """(1, D) float32: a query vector normalised as the index's vectors are;
    ValueError naming ``field`` and the fix for a vector of another length, a value that is not a
    finite number, or a vector of norm 0 (no direction to search in).

    The norm is taken after scaling by the largest magnitude, so neither 1e300 nor 1e-320 (both
    finite, as JSON may carry them) overflows or vanishes on the way."""
    if len(values) != dim:
        raise ValueError(
            f"{field}: {len(values)} values; this index's vectors have {dim} (the served checkpoint's "
            "embed_dim): embed with the checkpoint GET /v1/info names"
        )
    v = np.asarray(values, np.float64)  # (D,)
    bad = np.flatnonzero(~np.isfinite(v))
    if len(bad):
        raise ValueError(
            f"{field}[{int(bad[0])}]: not a finite number (beyond the float range); send finite numbers"
        )
    scale = float(np.abs(v).max())
    if scale == 0.0:
        raise ValueError(f"{field}: every value is 0 (norm 0), which has no direction to search in")
    unit = v / scale
    out: np.ndarray = (unit / np.linalg.norm(unit)).astype(np.float32)[None, :]  # (1, D)
    return out


def _without(
    exclude: int | None, depth: int, scores: np.ndarray, ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The best-first (scores, ids) without the id ``exclude`` (None: all of them), at most ``depth``."""
    if exclude is not None:
        keep = ids != exclude
        scores, ids = scores[keep], ids[keep]
    return scores[:depth], ids[:depth]


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
