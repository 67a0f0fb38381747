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

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from icr.index.filters import Filter, Selection, to_sql
from icr.index.index_folder import read_holes
from icr.index.live_state import LiveState, merge
from icr.index.live_writes import UPLOADS_FOLDER, Ack, NewImage, UnknownImage, WriteLog
from icr.index.manifest import Manifest
from icr.index.metadata import MetadataStore
from icr.index.vector_index import Rescorer, rescored, search

# Deleted base ids up to this many are skipped by searching that much deeper (the micro-batched
# path); beyond, a FAISS selector of the live ids is cheaper than the extra depth.
OVERFETCH_LIMIT = 1_000
BaseSearch = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class LiveSelection:
    """A filter's live matches at one state: the base ids as a bitmap, the added images as a mask."""

    base_ids: np.ndarray  # (b,) int64 ascending
    base_bitmap: np.ndarray  # (ceil(base_ntotal / 8),) uint8
    added: np.ndarray  # (m,) bool over the state's added images


@dataclass(frozen=True)
class BaseIds:
    """The id space of a base index: ids below ``ids_end``; a compacted base's (index/live_compact.py)
    also includes the log's writes up to ``seq`` and holds no vector for its ``holes`` (ascending);
    a shard's holds the ids [``lo``, ``hi``) only (``hi`` None: ``ids_end``), holes among them."""

    ids_end: int
    seq: int = 0
    holes: np.ndarray | None = None
    lo: int = 0
    hi: int | None = None

    @property
    def own(self) -> tuple[int, int]:
        """[lo, hi): the base ids this index may hold."""
        return self.lo, self.ids_end if self.hi is None else self.hi


def base_ids(directory: str | os.PathLike[str], manifest: Manifest) -> BaseIds:
    """The id space of the index folder ``directory`` (its compaction's, if it was compacted)."""
    return BaseIds(manifest.ntotal, manifest.base_seq, read_holes(directory, manifest), *manifest.own_ids)


class LiveIndex:
    """``index`` (a FAISS index, never modified) and its ``metadata`` store, with the write log at
    ``log_path`` (None: an index with no writes) for the index named ``key``, taking writes into it
    when ``writable`` (a snapshot's log is read by a server that takes none). The log file
    is created by the first write (a server nobody writes to leaves none); until then the state is
    the base alone, and :meth:`refresh` opens the file once another process has created it.

    ``batched``: the service's micro-batched search of the base index, ``(query (1, D), k) ->
    best-first (scores, ids)``, used for unfiltered searches (default: FAISS directly);
    ``rescore``: the exact scores the batched search reports, given to the selector searches too.
    """

    def __init__(
        self,
        index: Any,
        metadata: MetadataStore,
        log_path: str | os.PathLike[str] | None,
        key: str,
        batched: BaseSearch | None = None,
        rescore: Rescorer | None = None,
        writable: bool = True,
        base: BaseIds | None = None,
    ) -> None:
        self.index, self.metadata, self.key = index, metadata, key
        self.log_path = None if log_path is None else Path(log_path)
        self.writable = writable and self.log_path is not None
        self._batched, self._rescore = batched, rescore
        self._log: WriteLog | None = None
        self.base = base or BaseIds(index.ntotal)
        base = self.base
        self._state = LiveState.empty(base.ids_end, index.d, base.seq, base.holes, *base.own)
        self._apply_lock = threading.Lock()
        self.refresh()
        held = self._log.last_seq() if self._log is not None else 0
        if self.log_path is not None and held < self.base.seq:  # later writes: numbered anew, never applied
            raise ValueError(
                f"this index folder was compacted with the write log up to write {self.base.seq}, and "
                f"{self.log_path} holds {held}: serve it with the state directory it was compacted with "
                "(or with writes off, ICR_WRITES=false, as it is)"
            )

    @property
    def uploads(self) -> Path | None:
        """Where uploaded images are kept (beside the write log), None for an index without a log."""
        return None if self.log_path is None else self.log_path.parent / UPLOADS_FOLDER

    @property
    def state(self) -> LiveState:
        return self._state

    @property
    def log(self) -> WriteLog | None:
        """The write log, None while its file does not exist."""
        return self._log

    def _writer(self) -> WriteLog:
        if not self.writable or self.log_path is None:
            raise ValueError("this index takes no writes (it is served without a state directory)")
        with self._apply_lock:
            if self._log is None:
                self._log = self._open_log()
            return self._log

    def _open_log(self) -> WriteLog:
        assert self.log_path is not None
        base = self.base
        return WriteLog(
            self.log_path, self.key, self.metadata, base.ids_end, self.index.d, base.holes, base.own
        )

    def refresh(self) -> LiveState:
        """Apply what the log holds past the current state (this process's writes and others');
        returns the new state. Replaying a whole log at start-up is this call."""
        with self._apply_lock:
            if self._log is None and self.log_path is not None and self.log_path.is_file():
                self._log = self._open_log()
            state = self._state
            if self._log is not None:
                while batch := self._log.since(state.seq):
                    state = state.apply(batch)
            self._state = state  # one reference swap: a search holds the old state or the new
            return state

    def unanswered(self, _state: LiveState) -> list[str]:
        """Parts of the index that left a search unanswered: none (one folder, in this process)."""
        return []

    def close(self) -> None:
        if self._log is not None:
            self._log.close()

    # --- writes: acknowledged once in the log, visible once applied (before they return) ---------
    def add(self, images: Sequence[NewImage], who: str) -> list[Ack]:
        acks = self._writer().add(images, who)
        self.refresh()
        return acks

    def patch(self, image_id: int, fields: dict[str, Any], who: str) -> Ack:
        ack = self._writer().patch(image_id, fields, who)
        self.refresh()
        return ack

    def delete(self, ids: Sequence[int], who: str) -> list[Ack]:
        acks = self._writer().delete(ids, who)
        self.refresh()
        return acks

    def delete_matching(self, filter_: Filter, who: str) -> list[Ack]:
        """Delete every live image ``filter_`` selects as of now, in one transaction."""
        state = self.refresh()
        selection = self.select(filter_, state)
        ids = np.concatenate([selection.base_ids, state.ids[selection.added]])  # (n,)
        return self.delete(ids.tolist(), who) if len(ids) else []

    def resolve_external(self, external_id: str) -> int:
        """The live image ``external_id`` names; UnknownImage if none."""
        if self._log is None:
            raise UnknownImage(f"no live image with external_id {external_id!r} in this index")
        return self._log.resolve_external(external_id)

    # --- reads at one state -----------------------------------------------------------------------
    def rows(self, ids: Sequence[int], state: LiveState) -> list[dict[str, Any]]:
        """Metadata rows of live ``ids`` as of ``state``, in order; KeyError for an id not live there."""
        for i in ids:
            if not state.is_live(int(i)):
                raise KeyError(f"no live image {int(i)} in this index")
        written = self._log.rows(ids, state.seq) if self._log is not None and state.seq else {}
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
        if self._log is not None and state.seq:
            written_match, written = self._log.matching(where, params, state.seq)
        else:
            written_match = written = np.zeros(0, np.int64)
        base_ids = np.union1d(
            np.setdiff1d(base_match, written, assume_unique=True),
            written_match[written_match < state.base_ntotal],
        )
        added = np.isin(state.ids, written_match) & state.alive
        return LiveSelection(base_ids, state.base_bitmap(base_ids), added)

    def search(
        self, query: np.ndarray, depth: int, state: LiveState, selection: Selection | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Best-first top-``depth`` (scores, ids) of the live images for ``query`` (1, D) as of
        ``state``, among ``selection`` when given (a :class:`FilterCache` selection at that state)."""
        if selection is not None and selection.seq != state.seq:
            raise ValueError(f"a selection made at write {selection.seq} used at {state.seq}")
        base = self._search_base(query, depth, state, selection)
        added = state.search_added(query, depth, None if selection is None else selection.added)
        if not len(added[1]):  # nothing added (or selected) since the build: the base list as it is
            return base[0][:depth], base[1][:depth]
        return merge(depth, base, added)

    def _search_base(
        self, query: np.ndarray, depth: int, state: LiveState, selection: Selection | None
    ) -> tuple[np.ndarray, np.ndarray]:
        import faiss  # noqa: PLC0415 (faiss: only the selector paths need it)

        dead = state.dead_in_base_index
        if selection is None and dead <= OVERFETCH_LIMIT:
            return state.without_dead(*self._unfiltered(query, depth + dead))
        if selection is None:
            selector = faiss.IDSelectorBitmap(state.base_ntotal, faiss.swig_ptr(state.base_alive_bitmap))
            count = state.base_live
        else:
            selector = selection.selector
            count = len(selection.ids) - (0 if selection.added is None else int(selection.added.sum()))
        if count == 0:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        try:
            scores, ids = search(self.index, query, min(depth, count), selector=selector)
        except RuntimeError:  # an index that cannot search a selection (FAISS GPU before 1.9)
            found_s, found_i = self._unfiltered(query, depth + dead if selection is None else depth)
            keep = (
                ~np.isin(found_i, state.base_dead) if selection is None else np.isin(found_i, selection.ids)
            )
            return found_s[keep][:depth], found_i[keep][:depth]
        if self._rescore is not None:  # the scores the unfiltered search reports for the same ids
            scores, ids = rescored(self._rescore, query, ids)
        return scores[0], ids[0]

    def _unfiltered(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self._batched is not None:
            return self._batched(query, k)
        scores, ids = search(self.index, query, k)
        return scores[0], ids[0]
