"""The coordinator's side of a sharded index: S shard replicas searched as one index.

A search is encoded once (by the retriever), scattered to every shard, and each shard's best-first
top ``depth`` (global ids) merged into the global top ``depth`` (:func:`index.live_state.merge`): for
exact shards the very list one index over all the images returns, up to the order of tied scores.
Calibration, thresholds, filters' counts and pagination then run on the merged list exactly as on
one machine (:class:`service.retriever.Retriever`), and metadata rows are fetched from the shards
that own the page's ids only.

Writes go to the shard that owns the id (a shard's range; ids past the whole index's are the last
shard's): a patch to its owner, a delete by ids to each owner of some of them, a delete by filter to
every shard, an added image to the last shard (one transaction per request). Each shard's writes
commit in one transaction on it; a request spanning shards is atomic per shard, not across them:
when a shard does not answer, the request fails 503 naming it, the other shards' deletes stand,
and sending it again completes it (a delete of an id that is gone does nothing).

Failure policy: a shard that does not answer within ``timeout_s`` (no live replica, a crash, a
network partition) is either left out of the answer, which then says so (``passed_is_exact: false``
and a warning naming the shard), or fails the request with 503 (``require_all``). Never silent.

Backends: :class:`LocalShard` calls a :class:`service.shard_replica.ShardReplica` in this process
(tests, one machine); :mod:`service.ray_serving` calls Ray Serve deployments of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from icr.index.calibration import CALIBRATION_FILE, ServedCalibration
from icr.index.filters import Filter
from icr.index.live_state import merge
from icr.index.live_writes import UPLOADS_FOLDER, Ack, NewImage, UnknownImage
from icr.index.manifest import Manifest
from icr.index.shard import check_shards
from icr.service.loaded_index import LoadedIndex, NotServable
from icr.service.shard_replica import ShardHits, ShardReplica, ShardStatus, ShardWrite

log = logging.getLogger("icr.service")

Waiter = Callable[[float], Any]  # waits up to the given seconds for a call's answer


class ShardDown(Exception):
    """A shard did not answer: no live replica, a crash, or no answer in time."""


class ShardsUnavailable(Exception):
    """Shards did not answer where the request cannot go without them (a 503): every shard when
    the server requires them all, the owner of an image asked for, the shards a write goes to."""

    def __init__(self, names: Sequence[str], why: str | None = None):
        self.names = list(names)
        why = why or (
            "and this server requires every shard (ICR_SHARD_FAILURE=unavailable); retry shortly, or "
            "serve partial answers with ICR_SHARD_FAILURE=partial"
        )
        super().__init__(
            f"shard{'s' if len(names) > 1 else ''} {', '.join(names)} did not answer (no live replica or "
            f"no answer in time) {why}"
        )


class ShardBackend(Protocol):
    """How the coordinator reaches one shard: ``submit`` starts a call of the replica's method and
    returns a waiter, which raises :class:`ShardDown` when the shard did not answer and the
    replica's own exception (KeyError, NotServable) when it answered with one."""

    def submit(self, method: str, *args: Any) -> Waiter: ...


ShardConnector = Callable[[], list[ShardBackend]]  # reaches the replicas of every shard (at each load)


class LocalShard:
    """A shard replica in this process; calls run on a shared thread pool, so a scatter is parallel."""

    def __init__(self, replica: ShardReplica, pool: ThreadPoolExecutor):
        self.replica, self.pool = replica, pool
        self.down = False  # a shard that stops answering (set by tests)

    def submit(self, method: str, *args: Any) -> Waiter:
        if self.down:
            return _raise_down
        future: Future[Any] = self.pool.submit(getattr(self.replica, method), *args)

        def wait(timeout: float) -> Any:
            try:
                return future.result(timeout)
            except TimeoutError:
                raise ShardDown(f"no answer in {timeout:.1f} s") from None

        return wait


def _raise_down(_timeout: float) -> Any:
    raise ShardDown("marked down")


@dataclass
class ShardSet:
    """S shard backends of one build, described once at start (manifests checked together)."""

    backends: list[ShardBackend]
    timeout_s: float = 10.0
    require_all: bool = False
    described: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        answers, missing = self.ask(dict.fromkeys(range(len(self.backends)), ()), "describe", self.timeout_s)
        if missing:
            raise ShardDown(f"shards {missing} did not answer when the coordinator started")
        self.described = [answers[s] for s in range(len(self.backends))]
        manifests = [Manifest.model_validate(d["manifest"]) for d in self.described]
        check_shards(manifests)
        order = sorted(range(len(manifests)), key=lambda s: manifests[s].extra["shard"]["index"])
        self.backends = [self.backends[s] for s in order]
        self.described = [self.described[s] for s in order]
        self.manifests = [manifests[s] for s in order]
        self.starts = np.array([m.extra["shard"]["ids"][0] for m in self.manifests], np.int64)  # (S,)
        self.ends = np.array([m.extra["shard"]["ids"][1] for m in self.manifests], np.int64)  # (S,)
        self.status: list[ShardStatus] = [d["status"] for d in self.described]  # the latest seen
        texts = {d["calibration"] for d in self.described}
        if len(texts) > 1:
            raise ValueError(
                "the shards hold different calibration.json files; calibrate the source index once and "
                "cut it into shards again (icr index shard copies its calibration to every shard)"
            )

    @property
    def names(self) -> list[str]:
        return [str(d["folder"]) for d in self.described]

    def saw(self, s: int, status: ShardStatus | None) -> None:
        """Keep shard ``s``'s latest status (answers may arrive out of order: the larger seq wins)."""
        if status is not None and status.seq >= self.status[s].seq:
            self.status[s] = status

    def owner(self, image_id: int) -> int | None:
        """The shard whose id range holds ``image_id`` (None: no shard's); ids past the whole
        index's are the last shard's (images added since the cut)."""
        s = int(np.searchsorted(self.starts, image_id, side="right")) - 1
        return s if s >= 0 else None

    def ask_owner(self, image_id: int, method: str, *args: Any) -> Any:
        """The answer of the shard owning ``image_id`` to ``method(*args)``; None when no shard's
        range holds the id; ShardsUnavailable when its shard does not answer."""
        s = self.owner(image_id)
        why = "and it holds the image this request needs; retry shortly"
        return None if s is None else self.ask_all({s: args}, method, why)[s]

    def ask_all(
        self, calls: dict[int, tuple[Any, ...]], method: str, why: str | None = None
    ) -> dict[int, Any]:
        """:meth:`ask` where every shard asked must answer: ShardsUnavailable (``why``) otherwise."""
        answers, missing = self._ask(calls, method, self.timeout_s)
        if missing:
            raise ShardsUnavailable([self.names[s] for s in missing], why)
        return answers

    def ask(
        self, calls: dict[int, tuple[Any, ...]], method: str, timeout_s: float | None = None
    ) -> tuple[dict[int, Any], list[int]]:
        """Call ``method`` on each shard in ``calls`` (shard -> arguments) at once; returns the
        answers by shard and the shards that did not answer within the timeout (one deadline for
        all). A replica's own exception (KeyError, NotServable, ...) propagates."""
        answers, missing = self._ask(calls, method, self.timeout_s if timeout_s is None else timeout_s)
        if missing and self.require_all:
            raise ShardsUnavailable([self.names[s] for s in missing])
        return answers, missing

    def _ask(
        self, calls: dict[int, tuple[Any, ...]], method: str, timeout_s: float
    ) -> tuple[dict[int, Any], list[int]]:
        deadline = time.monotonic() + timeout_s
        waiters = {s: self.backends[s].submit(method, *args) for s, args in calls.items()}
        answers, missing = {}, []
        for s, wait in waiters.items():
            try:
                answers[s] = wait(max(0.0, deadline - time.monotonic()))
            except ShardDown as err:
                log.warning("shard %s did not answer %s: %s", s, method, err)
                missing.append(s)
        return answers, missing


class ShardedState:
    """What one request sees of a sharded index: the counts of the shards' latest statuses (``seq``
    their sequence numbers' sum, which every write on any shard increases), and which shards left
    its searches unanswered."""

    def __init__(self, shards: ShardSet):
        self.shards = shards
        status = list(shards.status)
        self.seq = sum(st.seq for st in status)
        self.size = sum(st.size for st in status)
        self.added = sum(st.added for st in status)
        self.deleted = sum(st.deleted for st in status)
        self.base_ntotal = int(shards.ends[-1])  # the whole index's id space when it was cut
        self.ids_end = max(st.ids_end for st in status)
        self.unanswered: set[int] = set()

    def is_live(self, image_id: int) -> bool:
        """Asked of the shard owning ``image_id``; ShardsUnavailable when it does not answer."""
        return bool(self.shards.ask_owner(image_id, "is_live", image_id))

    def added_vector(self, _image_id: int) -> np.ndarray | None:
        return None  # an added image's vector is its shard's to give (ShardedLive.vectors)


@dataclass
class ShardedSelection:
    """A filter as every shard applies it to its own images; ``count``: how many live images it
    selects over the answering shards, known once a search with it has run."""

    filter_: Filter
    shards: ShardSet
    count: int = 0
    seconds: float = 0.0

    def contains(self, image_id: int) -> bool:
        return bool(self.shards.ask_owner(image_id, "selects", self.filter_, image_id))


class ShardedFilters:
    def __init__(self, shards: ShardSet):
        self.shards = shards

    def select(self, filter_: Filter, _state: ShardedState) -> tuple[ShardedSelection, bool]:
        return ShardedSelection(filter_, self.shards), False


class ShardedLive:
    """The shards as the retriever searches an index: merged searches, rows from their owners,
    writes routed to them (see the module). ``writes``: the coordinator's state directory (uploaded
    images are kept in it), None: the server takes no writes; it takes them when every shard does."""

    def __init__(self, shards: ShardSet, writes: Path | None = None):
        self.shards = shards
        self.writable = writes is not None and all(d["writes"] for d in shards.described)
        self.uploads = None if writes is None else writes / UPLOADS_FOLDER

    @property
    def state(self) -> ShardedState:
        return ShardedState(self.shards)  # fresh per request: it collects that request's unanswered

    def refresh(self) -> ShardedState:
        return self.state

    def search(
        self, query: np.ndarray, depth: int, state: ShardedState, selection: ShardedSelection | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Best-first global top ``depth`` (scores, ids) for ``query`` (1, D): every shard's own
        top ``depth`` merged."""
        filter_ = None if selection is None else selection.filter_
        calls = dict.fromkeys(range(len(self.shards.backends)), (query, depth, filter_))
        answers, missing = self.shards.ask(calls, "search")
        state.unanswered.update(missing)
        for s, answer in answers.items():
            self.shards.saw(s, answer.status)
        hits: list[ShardHits] = list(answers.values())
        if selection is not None:
            selection.count = sum(h.matched or 0 for h in hits)
            selection.seconds = max((h.select_ms for h in hits), default=0.0) / 1000
        return merge(depth, *((h.scores[0], h.ids[0]) for h in hits))

    def unanswered(self, state: ShardedState) -> list[str]:
        """The shards that did not answer this request's searches, by name."""
        return [self.shards.names[s] for s in sorted(state.unanswered)]

    def rows(self, ids: Sequence[int], _state: ShardedState) -> list[dict[str, Any]]:
        """Rows of ``ids`` from the shards that own them; KeyError for an id no shard holds live."""
        owners: dict[int, list[int]] = {}
        for i in ids:
            s = self.shards.owner(int(i))
            if s is None:
                raise KeyError(f"no live image {int(i)} in this index")
            owners.setdefault(s, []).append(int(i))
        # the page's hits came from them a moment ago: one that went down since fails the request
        answers = self.shards.ask_all({s: (owned,) for s, owned in owners.items()}, "rows")
        found = {i: row for s, owned in owners.items() for i, row in zip(owned, answers[s], strict=True)}
        out = []
        for i in ids:
            row = found[int(i)]
            if row is None:
                raise KeyError(f"no live image {int(i)} in this index")
            out.append(row)
        return out

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """(n, D) stored vectors, each from its owner (a search by a stored image)."""
        out = []
        for i in ids:
            found = self.shards.ask_owner(int(i), "vectors", np.array([i], np.int64))  # (1, D)
            if found is None:
                raise KeyError(int(i))
            out.append(found[0])
        return np.stack(out)

    # --- writes: each acknowledged by its shard's log, the shard's new status kept -----------------
    def _write(self, calls: dict[int, tuple[Any, ...]], method: str) -> list[Ack]:
        why = (
            "to this write, so whether its part was made is unknown: send the same request again once "
            "it answers (deletes and patches are safe to repeat; an add is too when its images carry "
            "an external_id, which replaces)"
        )
        if len(calls) > 1:
            why += "; the other shards made their parts, each in one transaction"
        answers: dict[int, ShardWrite] = self.shards.ask_all(calls, method, why)
        for s, answer in answers.items():
            self.shards.saw(s, answer.status)
        return [ack for s in sorted(answers) for ack in answers[s].acks]

    def add(self, images: Sequence[NewImage], who: str) -> list[Ack]:
        """Added to the last shard, whose range is open-ended (new ids follow the whole index's)."""
        return self._write({len(self.shards.backends) - 1: (list(images), who)}, "add")

    def patch(self, image_id: int, fields: dict[str, Any], who: str) -> Ack:
        s = self.shards.owner(image_id)
        if s is None:
            raise UnknownImage(f"no live image {image_id} in this index")
        return self._write({s: (image_id, fields, who)}, "patch")[0]

    def delete(self, ids: Sequence[int], who: str) -> list[Ack]:
        owned: dict[int, list[int]] = {}
        asked = list(dict.fromkeys(int(i) for i in ids))
        for i in asked:
            s = self.shards.owner(i)
            if s is not None:  # no shard's: not an image of this index
                owned.setdefault(s, []).append(i)
        if not owned:
            return []
        acks = self._write({s: (part, who) for s, part in owned.items()}, "delete")
        order = {i: k for k, i in enumerate(asked)}
        return sorted(acks, key=lambda ack: order[ack.id])  # as asked, as one index answers

    def delete_matching(self, filter_: Filter, who: str) -> list[Ack]:
        return self._write(dict.fromkeys(range(len(self.shards.backends)), (filter_, who)), "delete_matching")

    def close(self) -> None:
        pass


def sharded_index(shards: ShardSet, writes: Path | None = None) -> LoadedIndex:
    """The shards as the retriever serves one image index: shard 0's manifest (every shard keeps
    the source's checkpoint, build stamp and counts) and the calibration every shard carries (the
    source index's, fitted on the whole gallery, so relevance means what it means on one machine).
    ``writes``: the coordinator's state directory, when it takes writes (:class:`ShardedLive`)."""
    first = shards.manifests[0]
    source = str(first.extra["shard"].get("from") or "shards")
    manifest = first.model_copy(
        update={"extra": {**first.extra, "shard": {"count": len(shards.backends), "folders": shards.names}}}
    )
    text = shards.described[0]["calibration"]
    calibration = (
        None if text is None else ServedCalibration.from_text(text, f"{shards.names[0]}/{CALIBRATION_FILE}")
    )
    if calibration is not None and calibration.info.get("checkpoint_sha256") != first.checkpoint_sha256:
        raise NotServable(f"{shards.names[0]}/{CALIBRATION_FILE}: fitted for another checkpoint")
    live = ShardedLive(shards, writes)
    return LoadedIndex(
        directory=Path(source),
        index=None,
        manifest=manifest,
        metadata=None,
        calibration=calibration,
        batcher=None,
        filters=ShardedFilters(shards),
        live=live,
        field_types=dict(shards.described[0]["field_types"]),
        vectors=live.vectors if all(d["vectors"] for d in shards.described) else None,
    )
