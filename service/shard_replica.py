"""One shard of a sharded index, served to a coordinator (:mod:`service.sharded_index`).

A replica loads one shard folder (``icr index shard``) as the single-process server loads an index
folder (its micro-batcher merges concurrent queries into one FAISS call; an on-disk or memory-mapped
index is read in place) and answers what a coordinator asks of a shard: the top ``depth`` of its
own images for already-encoded queries (filtered in its own metadata), metadata rows and stored
vectors of the ids it owns, a description (manifest, calibration, live count) checked once
when the coordinator starts, and the writes routed to it. The same class runs in process (tests,
one machine) and as a Ray Serve deployment (:mod:`service.ray_serving`); its arguments and answers
are plain numpy arrays and Python values, so they cross a process boundary as they are.

Writes: a shard served with a state directory keeps its own write log there (``writes.sqlite``,
:mod:`index.live_writes`), shared by every replica of the shard. Each call first applies what the
log holds past the replica's state (:meth:`LiveIndex.refresh`, one indexed SQLite read), so a write
acknowledged by one replica is seen by the next call on any other. Every answer carries the
shard's :class:`ShardStatus`, from which the coordinator counts the live images.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from icr.index.calibration import CALIBRATION_FILE
from icr.index.filters import Filter
from icr.index.live_state import LiveState
from icr.index.live_writes import Ack, NewImage
from icr.service.config import Settings
from icr.service.loaded_index import LoadedIndex, NotServable, load_index_folder

SHARDS_STATE = "shards"  # a coordinator's state directory holds each shard's in shards/<folder name>/


def shard_state_dir(state_dir: Path, folder: str | Path) -> Path:
    """Where the replicas of the shard folder ``folder`` keep their write log: one directory per
    shard (every shard of a build has the same index key, so they cannot share one log)."""
    return state_dir / SHARDS_STATE / Path(folder).name


def shard_writes(settings: Settings, folder: str | Path) -> Path | None:
    """The state directory a replica of ``folder`` takes writes into under ``settings`` (None:
    the server takes no writes, ICR_WRITES=false)."""
    return shard_state_dir(settings.state_path, folder) if settings.writes else None


@dataclass(frozen=True)
class ShardStatus:
    """A shard's live counts at its state ``seq`` (the shard's own write log's sequence number)."""

    seq: int
    size: int  # live images
    added: int  # images added since the cut, live now
    deleted: int  # images of the shard deleted since the cut
    ids_end: int  # one past the largest id given


@dataclass(frozen=True)
class ShardWrite:
    """What a write did on a shard, and the shard's status after it."""

    acks: list[Ack]
    status: ShardStatus


@dataclass(frozen=True)
class ShardHits:
    """A shard's answer to a batch of queries: best-first (scores, ids) per query (global ids)."""

    scores: list[np.ndarray]  # Q x (n,) float32
    ids: list[np.ndarray]  # Q x (n,) int64
    matched: int | None  # the shard's live images the filter selects (None: no filter)
    select_ms: float = 0.0  # what selecting them cost on the shard (0 when cached)
    seconds: float = 0.0  # the whole call on the shard (a coordinator's hop and merge are the rest)
    status: ShardStatus | None = None  # the shard as of the state searched


class ShardReplica:
    """The shard folder ``folder`` loaded for searching, taking writes into the log in ``writes``
    (a directory, :func:`shard_state_dir`; None: read-only). Only the last shard takes added
    images: new ids start past the whole index's id space, so they are the last range's."""

    # the methods a coordinator may call (a Ray Serve deployment dispatches only these)
    CALLS = frozenset(
        {
            "describe",
            "search",
            "selects",
            "rows",
            "is_live",
            "vectors",
            "add",
            "patch",
            "delete",
            "delete_matching",
        }
    )
    NOT_REPEATABLE = frozenset({"add"})  # made twice, it adds twice (the others are idempotent)

    def __init__(
        self,
        folder: str | Path,
        *,
        gpu: str = "auto",
        faiss_threads: int = 1,
        micro_batch: int = 64,
        mmap: bool = False,
        writes: Path | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.loaded: LoadedIndex = load_index_folder(
            self.folder, gpu, micro_batch, faiss_threads, writes, mmap=mmap
        )
        shard = self.loaded.manifest.extra.get("shard")
        if not isinstance(shard, dict):
            raise NotServable(
                f"{self.folder}: not a shard folder (its manifest names no shard); cut an index into "
                "shards with `icr index shard INDEX --shards S --out DIR`"
            )
        self.shard: dict[str, Any] = shard
        if self.loaded.manifest.id_range is None:  # cut before shards recorded their range
            raise NotServable(
                f"{self.folder}: a shard cut by an older icr (it lists every other shard's id as a hole, "
                "8 bytes per id); cut the source index again with `icr index shard`"
            )
        self.live = self.loaded.folder_live("serve a shard")  # its own folder and write log

    def _state(self) -> LiveState:
        """The shard's state with every write in its log applied (other replicas' too)."""
        return self.live.refresh()

    def status(self, state: LiveState | None = None) -> ShardStatus:
        state = self._state() if state is None else state
        return ShardStatus(state.seq, state.size, state.added, state.deleted, state.ids_end)

    def describe(self) -> dict[str, Any]:
        """What the coordinator checks and serves from: this shard's manifest, calibration file
        text (None without one), metadata field kinds, live image count and id range."""
        calibration = self.folder / CALIBRATION_FILE
        return {
            "folder": self.folder.name,
            "manifest": self.loaded.manifest.model_dump(mode="json"),
            "calibration": calibration.read_text() if calibration.is_file() else None,
            "field_types": self.loaded.field_types,
            "status": self.status(),
            "shard": self.shard,
            "vectors": self.loaded.vectors is not None,
            "writes": self.live.writable,
        }

    def search(self, queries: np.ndarray, depth: int, filter_: Filter | None = None) -> ShardHits:
        """Top ``depth`` of this shard's live images for each of ``queries`` (Q, D), among those
        ``filter_`` selects when given."""
        t0 = time.perf_counter()
        live = self.live
        state = self._state()
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
        seconds = time.perf_counter() - t0
        return ShardHits(scores, ids, matched, select_ms, seconds, self.status(state))

    def selects(self, filter_: Filter, image_id: int) -> bool:
        """Whether ``filter_`` selects the live image ``image_id`` of this shard."""
        selection, _ = self.loaded.filters.select(filter_, self._state())
        return bool(selection.contains(image_id))

    def rows(self, ids: list[int]) -> list[dict[str, Any] | None]:
        """Metadata rows of ``ids`` (None for an id that is not a live image of this shard)."""
        state = self._state()
        live = [i for i in ids if state.is_live(i)]
        found = dict(zip(live, self.live.rows(live, state), strict=True))
        return [found.get(i) for i in ids]

    def is_live(self, image_id: int) -> bool:
        return self._state().is_live(image_id)

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """(n, D) the stored vectors of ``ids`` (an image added online: the vector it was added
        with); NotServable when this index cannot give a built image's back."""
        state = self._state()
        added = [state.added_vector(int(i)) for i in ids]
        built = np.array([int(i) for i, v in zip(ids, added, strict=True) if v is None], np.int64)
        stored = iter(np.zeros((0, self.loaded.manifest.dim), np.float32))
        if len(built):
            if self.loaded.vectors is None:
                raise NotServable(self.loaded.why_no_vectors())
            stored = iter(self.loaded.vectors(built))  # (b, D)
        return np.stack([v if v is not None else next(stored) for v in added])  # (n, D)

    # --- writes (each acknowledged once in the shard's log, and applied before it returns) ------
    def add(self, images: list[NewImage], who: str) -> ShardWrite:
        """Add ``images`` in one transaction (the last shard only: see the class)."""
        if self.shard["index"] != self.shard["count"] - 1:
            raise ValueError(f"{self.folder.name}: only the last shard takes added images")
        return self._written(self.live.add(images, who))

    def patch(self, image_id: int, fields: dict[str, Any], who: str) -> ShardWrite:
        """Merge ``fields`` into a live image's; UnknownImage when it is not a live image here."""
        return self._written([self.live.patch(image_id, fields, who)])

    def delete(self, ids: list[int], who: str) -> ShardWrite:
        """Delete the live images among ``ids`` in one transaction (the others: no ack)."""
        return self._written(self.live.delete(ids, who))

    def delete_matching(self, filter_: Filter, who: str) -> ShardWrite:
        """Delete every live image of this shard that ``filter_`` selects, in one transaction."""
        return self._written(self.live.delete_matching(filter_, who))

    def _written(self, acks: list[Ack]) -> ShardWrite:
        return ShardWrite(acks, self.status(self.live.state))

    def close(self) -> None:
        self.live.close()
        if self.loaded.metadata is not None:
            self.loaded.metadata.close()
