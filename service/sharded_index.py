"""The coordinator's side of a sharded index: S shard replicas searched as one index.

A search is encoded once (by the retriever), scattered to every shard, and each shard's best-first
top ``depth`` (global ids) merged into the global top ``depth`` (:func:`index.live_state.merge`): for
exact shards the very list one index over all the images returns, up to the order of tied scores.
Calibration, thresholds, filters' counts and pagination then run on the merged list exactly as on
one machine (:class:`service.retriever.Retriever`), and metadata rows are fetched from the shards
that own the page's ids only.

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
from icr.index.manifest import Manifest
from icr.index.shard import check_shards
from icr.service.loaded_index import LoadedIndex, NotServable
from icr.service.shard_replica import ShardHits, ShardReplica

log = logging.getLogger("icr.service")

Waiter = Callable[[float], Any]  # waits up to the given seconds for a call's answer


class ShardDown(Exception):
    """A shard did not answer: no live replica, a crash, or no answer in time."""


class ShardsUnavailable(Exception):
    """Shards did not answer and the server is configured to require every shard (a 503)."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        super().__init__(
            f"shard{'s' if len(names) > 1 else ''} {', '.join(names)} did not answer (no live replica or "
            "no answer in time) and this server requires every shard (ICR_SHARD_FAILURE=unavailable); "
            "retry shortly, or serve partial answers with ICR_SHARD_FAILURE=partial"
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
        texts = {d["calibration"] for d in self.described}
        if len(texts) > 1:
            raise ValueError(
                "the shards hold different calibration.json files; calibrate the source index once and "
                "cut it into shards again (icr index shard copies its calibration to every shard)"
            )

    @property
    def names(self) -> list[str]:
        return [str(d["folder"]) for d in self.described]

    @property
    def size(self) -> int:
        """Live images over all shards, as described at start."""
        return sum(int(d["size"]) for d in self.described)

    def owner(self, image_id: int) -> int | None:
        """The shard whose id range holds ``image_id`` (None: no shard's)."""
        s = int(np.searchsorted(self.starts, image_id, side="right")) - 1
        return s if s >= 0 and image_id < self.ends[s] else None

    def ask_owner(self, image_id: int, method: str, *args: Any) -> Any:
        """The answer of the shard owning ``image_id`` to ``method(*args)``; None when no shard's
        range holds the id; ShardsUnavailable when its shard does not answer."""
        s = self.owner(image_id)
        if s is None:
            return None
        answers, _ = self.ask({s: args}, method)
        if s not in answers:
            raise ShardsUnavailable([self.names[s]])
        return answers[s]

    def ask(
        self, calls: dict[int, tuple[Any, ...]], method: str, timeout_s: float | None = None
    ) -> tuple[dict[int, Any], list[int]]:
        """Call ``method`` on each shard in ``calls`` (shard -> arguments) at once; returns the
        answers by shard and the shards that did not answer within the timeout (one deadline for
        all). A replica's own exception (KeyError, NotServable, ...) propagates."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        waiters = {s: self.backends[s].submit(method, *args) for s, args in calls.items()}
        answers, missing = {}, []
        for s, wait in waiters.items():
            try:
                answers[s] = wait(max(0.0, deadline - time.monotonic()))
            except ShardDown as err:
                log.warning("shard %s did not answer %s: %s", s, method, err)
                missing.append(s)
        if missing and self.require_all:
            raise ShardsUnavailable([self.names[s] for s in missing])
        return answers, missing


class ShardedState:
    """What one request sees of a sharded index (read-only shards: the images described at start)
    and which shards left its searches unanswered."""

    seq = 0
    added = 0
    deleted = 0

    def __init__(self, shards: ShardSet):
        self.shards = shards
        self.size = shards.size
        self.base_ntotal = self.ids_end = int(shards.ends[-1])  # one past the last shard's range
        self.unanswered: set[int] = set()

    def is_live(self, image_id: int) -> bool:
        """Asked of the shard owning ``image_id``; ShardsUnavailable when it does not answer."""
        return bool(self.shards.ask_owner(image_id, "is_live", image_id))

    def added_vector(self, _image_id: int) -> np.ndarray | None:
        return None  # shards take no writes yet: no image was added since the build


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
    """The shards as the retriever searches an index: merged searches, rows from their owners.
    Read-only: the write routes answer 409 (``writable`` False)."""

    writable = False
    uploads: Path | None = None

    def __init__(self, shards: ShardSet):
        self.shards = shards

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
        answers, missing = self.shards.ask({s: (owned,) for s, owned in owners.items()}, "rows")
        if missing:  # the page's hits came from them a moment ago: they went down since
            raise ShardsUnavailable([self.shards.names[s] for s in missing])
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

    def close(self) -> None:
        pass


def sharded_index(shards: ShardSet) -> LoadedIndex:
    """The shards as the retriever serves one image index: shard 0's manifest (every shard keeps
    the source's checkpoint, build stamp and counts) and the calibration every shard carries (the
    source index's, fitted on the whole gallery, so relevance means what it means on one machine)."""
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
    live = ShardedLive(shards)
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
