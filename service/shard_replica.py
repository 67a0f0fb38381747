"""One shard of a sharded index, served to a coordinator (:mod:`service.sharded_index`).

A replica loads one shard folder (``icr index shard``) as the single-process server loads an index
folder (its micro-batcher merges concurrent queries into one FAISS call; an on-disk or memory-mapped
index is read in place) and answers what a coordinator asks of a shard: the top ``depth`` of its
own images for already-encoded queries (filtered in its own metadata), metadata rows and stored
vectors of the ids it owns, and a description (manifest, calibration, live count) checked once
when the coordinator starts. The same class runs in process (tests, one machine) and as a Ray
Serve deployment (:mod:`service.ray_serving`); its arguments and answers are plain numpy arrays
and Python values, so they cross a process boundary as they are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from icr.index.calibration import CALIBRATION_FILE
from icr.index.filters import Filter
from icr.service.loaded_index import LoadedIndex, NotServable, load_index_folder


@dataclass(frozen=True)
class ShardHits:
    """A shard's answer to a batch of queries: best-first (scores, ids) per query (global ids)."""

    scores: list[np.ndarray]  # Q x (n,) float32
    ids: list[np.ndarray]  # Q x (n,) int64
    matched: int | None  # the shard's live images the filter selects (None: no filter)
    select_ms: float = 0.0  # what selecting them cost on the shard (0 when cached)
    seconds: float = 0.0  # the whole call on the shard (a coordinator's hop and merge are the rest)


class ShardReplica:
    """The shard folder ``folder`` loaded for searching (read-only)."""

    def __init__(
        self,
        folder: str | Path,
        *,
        gpu: str = "auto",
        faiss_threads: int = 1,
        micro_batch: int = 64,
        mmap: bool = False,
    ) -> None:
        self.folder = Path(folder)
        self.loaded: LoadedIndex = load_index_folder(self.folder, gpu, micro_batch, faiss_threads, mmap=mmap)
        shard = self.loaded.manifest.extra.get("shard")
        if not isinstance(shard, dict):
            raise NotServable(
                f"{self.folder}: not a shard folder (its manifest names no shard); cut an index into "
                "shards with `icr index shard INDEX --shards S --out DIR`"
            )
        self.shard: dict[str, Any] = shard

    def describe(self) -> dict[str, Any]:
        """What the coordinator checks and serves from: this shard's manifest, calibration file
        text (None without one), metadata field kinds, live image count and id range."""
        calibration = self.folder / CALIBRATION_FILE
        return {
            "folder": self.folder.name,
            "manifest": self.loaded.manifest.model_dump(mode="json"),
            "calibration": calibration.read_text() if calibration.is_file() else None,
            "field_types": self.loaded.field_types,
            "size": self.loaded.live.state.size,
            "shard": self.shard,
            "vectors": self.loaded.vectors is not None,
        }

    def search(self, queries: np.ndarray, depth: int, filter_: Filter | None = None) -> ShardHits:
        """Top ``depth`` of this shard's live images for each of ``queries`` (Q, D), among those
        ``filter_`` selects when given."""
        t0 = time.perf_counter()
        live = self.loaded.live
        state = live.state
        selection, select_ms = None, 0.0
        if filter_ is not None:
            selection, cached = self.loaded.filters.select(filter_, state)
            select_ms = 0.0 if cached else (time.perf_counter() - t0) * 1000
        scores, ids = [], []
        for query in queries:  # one at a time: concurrent callers' queries meet in the micro-batcher
            s, i = live.search(query[None, :], depth, state, selection)  # (n,) each
            scores.append(s)
            ids.append(i)
        matched = None if selection is None else len(selection.ids)
        return ShardHits(scores, ids, matched, select_ms, time.perf_counter() - t0)

    def selects(self, filter_: Filter, image_id: int) -> bool:
        """Whether ``filter_`` selects the live image ``image_id`` of this shard."""
        selection, _ = self.loaded.filters.select(filter_, self.loaded.live.state)
        return bool(selection.contains(image_id))

    def rows(self, ids: list[int]) -> list[dict[str, Any] | None]:
        """Metadata rows of ``ids`` (None for an id that is not a live image of this shard)."""
        state = self.loaded.live.state
        live = [i for i in ids if state.is_live(i)]
        found = dict(zip(live, self.loaded.live.rows(live, state), strict=True))
        return [found.get(i) for i in ids]

    def is_live(self, image_id: int) -> bool:
        return self.loaded.live.state.is_live(image_id)

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """(n, D) the stored vectors of ``ids``; NotServable when this index cannot give them back."""
        if self.loaded.vectors is None:
            raise NotServable(self.loaded.why_no_vectors())
        return self.loaded.vectors(ids)

    def close(self) -> None:
        self.loaded.live.close()
        if self.loaded.metadata is not None:
            self.loaded.metadata.close()
