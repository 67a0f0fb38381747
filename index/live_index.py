"""A built index that takes writes: the base index folder, its write log, and the current state.

Writes go to the log (:mod:`index.live_writes`) and are acknowledged once durable; the state
(:mod:`index.live_state`) then applies everything the log holds past it, including what other
processes on the same state directory wrote (:meth:`LiveIndex.refresh`). A search takes the state
once and reads only it, so it sees each write whole or not at all:

* the base index is searched for the live ids: deeper by the number of deleted base ids while
  they are few (the deleted ones dropped after), through a FAISS selector of the live ids beyond;
* the added images are searched exactly and the two lists merged;
* a filter selects in the base metadata and in the log's rows as of the state (a written id takes
  its version from the log), so ``matched`` counts exactly the live images it selects.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from icr.index.filters import Filter, to_sql
from icr.index.live_state import LiveState, merge
from icr.index.live_writes import Ack, NewImage, WriteLog
from icr.index.metadata import MetadataStore
from icr.index.vector_index import search

# Deleted base ids up to this many are skipped by searching that much deeper (the micro-batched
# path); beyond, a FAISS selector of the live ids is cheaper than the extra depth.
OVERFETCH_LIMIT = 1_000


@dataclass(frozen=True)
class LiveSelection:
    """A filter's live matches at one state: the base ids as a bitmap, the added images as a mask."""

    seq: int
    matched: int  # live images selected
    base_ids: np.ndarray  # (b,) int64 ascending
    base_bitmap: np.ndarray  # (ceil(base_ntotal / 8),) uint8
    added: np.ndarray  # (m,) bool over the state's added images


class LiveIndex:
    """``index`` (a FAISS index, never modified), its ``metadata`` store and its write ``log``."""

    def __init__(self, index: Any, metadata: MetadataStore, log: WriteLog) -> None:
        self.index, self.metadata, self.log = index, metadata, log
        self._state = LiveState.empty(index.ntotal, index.d)
        self._apply_lock = threading.Lock()
        self.refresh()

    @property
    def state(self) -> LiveState:
        return self._state

    def refresh(self) -> LiveState:
        """Apply what the log holds past the current state (this process's writes and others');
        returns the new state. Replaying a whole log at start-up is this call."""
        with self._apply_lock:
            state = self._state
            while batch := self.log.since(state.seq):
                state = state.apply(batch)
            self._state = state  # one reference swap: a search holds the old state or the new
            return state

    # --- writes: acknowledged once in the log, visible once applied (before they return) ---------
    def add(self, images: Sequence[NewImage], who: str) -> list[Ack]:
        acks = self.log.add(images, who)
        self.refresh()
        return acks

    def patch(self, image_id: int, fields: dict[str, Any], who: str) -> Ack:
        ack = self.log.patch(image_id, fields, who)
        self.refresh()
        return ack

    def delete(self, ids: Sequence[int], who: str) -> list[Ack]:
        acks = self.log.delete(ids, who)
        self.refresh()
        return acks

    # --- reads at one state -----------------------------------------------------------------------
    def rows(self, ids: Sequence[int], state: LiveState) -> list[dict[str, Any]]:
        """Metadata rows of live ``ids`` as of ``state``, in order; KeyError for an id not live there."""
        for i in ids:
            if not state.is_live(int(i)):
                raise KeyError(f"no live image {int(i)} in this index")
        written = self.log.rows(ids, state.seq)
        base = [int(i) for i in ids if int(i) not in written]
        from_base = dict(zip(base, self.metadata.get(base), strict=True)) if base else {}
        out = []
        for i in ids:
            row = written.get(int(i)) if int(i) in written else from_base[int(i)]
            assert row is not None  # live at this state, so not a delete
            out.append(row)
        return out

    def select(self, filter_: Filter, state: LiveState) -> LiveSelection:
        """The live images ``filter_`` selects as of ``state``."""
        where, params = to_sql(filter_)
        base_match = self.metadata.matching_ids(where, params)  # (b,) as built
        # a written id (deleted ones included) takes its version at this state from the log
        written_match, written = self.log.matching(where, params, state.seq)
        base_ids = np.union1d(
            np.setdiff1d(base_match, written, assume_unique=True),
            written_match[written_match < state.base_ntotal],
        )
        added = np.isin(state.ids, written_match) & state.alive
        return LiveSelection(
            state.seq, len(base_ids) + int(added.sum()), base_ids, state.base_bitmap(base_ids), added
        )

    def search(
        self, query: np.ndarray, depth: int, state: LiveState, selection: LiveSelection | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Best-first top-``depth`` (scores, ids) of the live images for ``query`` (1, D) as of
        ``state``, among ``selection`` when given (made at the same state)."""
        if selection is not None and selection.seq != state.seq:
            raise ValueError(f"a selection made at write {selection.seq} used at {state.seq}")
        base = self._search_base(query, depth, state, selection)
        added = state.search_added(query, depth, None if selection is None else selection.added)
        return merge(depth, base, added)

    def _search_base(
        self, query: np.ndarray, depth: int, state: LiveState, selection: LiveSelection | None
    ) -> tuple[np.ndarray, np.ndarray]:
        import faiss  # noqa: PLC0415 (faiss: only the selector paths need it)

        if selection is None and len(state.base_dead) <= OVERFETCH_LIMIT:
            scores, ids = search(self.index, query, depth + len(state.base_dead))
            return state.without_dead(scores[0], ids[0])
        bitmap = state.base_alive_bitmap if selection is None else selection.base_bitmap
        live = state.base_ntotal - len(state.base_dead) if selection is None else len(selection.base_ids)
        if live == 0:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        selector = faiss.IDSelectorBitmap(state.base_ntotal, faiss.swig_ptr(bitmap))
        scores, ids = search(self.index, query, min(depth, live), selector=selector)
        return scores[0], ids[0]
