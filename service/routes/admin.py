"""POST /v1/admin/reload: swap in rebuilt artifacts without a restart and without a failed request;
POST /v1/admin/snapshot: a self-contained folder of the served index and its writes;
POST /v1/admin/compact: the served index rewritten with its writes folded in, and served."""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, FastAPI, Request

from icr.index.live_compact import compact
from icr.index.live_snapshot import SNAPSHOTS_FOLDER, snapshot_log, write_snapshot
from icr.service.config import Settings
from icr.service.errors import ApiError
from icr.service.loaded_index import preflight
from icr.service.retriever import Retriever
from icr.service.routes.deps import folder_live, retriever_of, settings_of
from icr.service.schemas import CompactResult, SnapshotRequest, SnapshotResult, error_responses
from icr.service.serving import install_retriever, load_retriever, without_paths

log = logging.getLogger("icr.service")
router = APIRouter(prefix="/v1/admin", tags=["admin"])
_reloading = threading.Lock()


@router.post(
    "/reload",
    summary="Load the configured index folders and checkpoint again, then switch to them",
    responses=error_responses(401, 403, 409),
)
def reload(request: Request) -> dict[str, Any]:
    """Loads the artifacts at the configured paths (e.g. an index folder rebuilt and renamed into
    place) beside the served ones, checks that they belong together, and switches new requests to
    them in one step; requests already running finish on the previous ones, so none fails. If the
    new artifacts do not load, nothing changes: 409 with the reason. Needs the admin key
    (ICR_ADMIN_KEY; unset: clients on this machine only)."""
    started = time.perf_counter()
    fresh = reload_artifacts(request.app, settings_of(request))
    return {
        "status": "reloaded",
        "seconds": round(time.perf_counter() - started, 3),
        "index": fresh.images.summary(),
        "caption_index": fresh.captions.summary() if fresh.captions is not None else None,
    }


@router.post(
    "/snapshot",
    response_model=SnapshotResult,
    summary="Write a self-contained folder of the served image index and its writes, to serve or keep",
    responses=error_responses(401, 403, 409, 503),
)
def snapshot(request: Request, body: SnapshotRequest | None = None) -> SnapshotResult:
    """Writes STATE_DIR/snapshots/<name>: the index folder's files (hard-linked: they never change),
    the write log up to now and the images uploaded into it, complete or not at all. `icr serve
    --index` on that folder serves the index as it is now, with no state directory; with writes on, it
    takes new writes into the folder (serve a copy to keep the snapshot). 409 when the name is taken.
    Needs the admin key (ICR_ADMIN_KEY; unset: clients on this machine only)."""
    settings = settings_of(request)
    target = retriever_of(request).images
    live = folder_live(target, "take snapshots", "sharded")
    name = (body.name if body is not None else None) or (
        f"{target.directory.name}-seq{live.state.seq}-{datetime.now(UTC):%Y%m%dT%H%M%S%fZ}"
    )
    try:
        info = write_snapshot(live, target.directory, settings.state_path / SNAPSHOTS_FOLDER / name)
    except FileExistsError as err:
        raise ApiError(409, "snapshot_exists", str(err)) from None
    log.info("snapshot %s: %d images at seq %d in %.2f s", name, info["images"], info["seq"], info["seconds"])
    return SnapshotResult(folder=f"{SNAPSHOTS_FOLDER}/{name}", **{k: info[k] for k in _SNAPSHOT_FIELDS})


_compacting = threading.Lock()


@router.post(
    "/compact",
    response_model=CompactResult,
    summary="Rewrite the served image index with its writes folded in, then serve it",
    responses=error_responses(401, 403, 409, 503),
)
def compact_index(request: Request) -> CompactResult:
    """Writes a fresh index folder of the live images (deleted vectors gone, added ones in, ids
    unchanged, the inverted file trained again when its lists have drifted), renames it over the
    served folder and switches to it as POST /v1/admin/reload does: requests running meanwhile
    finish on the old one, none fails, and writes arriving meanwhile are applied over the new one.
    Other servers on the same folder and state directory switch when they see it change
    (ICR_WATCH_SECONDS). 409 when another compaction runs or this server takes no writes. Needs the
    admin key (ICR_ADMIN_KEY; unset: clients on this machine only)."""
    settings = settings_of(request)
    target = retriever_of(request).images
    live = folder_live(target, "be compacted", "sharded")
    if not live.writable or snapshot_log(target.directory) is not None:
        raise ApiError(
            409,
            "not_compactable",
            "this server serves no write log of its own (ICR_WRITES=false, or a snapshot folder): serve the "
            "index with a state directory and writes on to compact it",
        )
    if not _compacting.acquire(blocking=False):
        raise ApiError(
            409, "compaction_in_progress", "a compaction is already running; retry when it has finished"
        )
    try:
        report = compact(live, target.directory, target.directory, say=log.info)
        fresh = reload_artifacts(request.app, settings, wait_s=120)
    finally:
        _compacting.release()
    return CompactResult(images=fresh.images.live.state.size, **report)


_SNAPSHOT_FIELDS = ("seq", "images", "writes", "uploads", "files_linked", "files_copied", "seconds")


def reload_artifacts(app: FastAPI, settings: Settings, wait_s: float = 0.0) -> Retriever:
    """Load the configured artifacts again and serve them (this route, and the refit of
    routes/feedback.py once it has written a new calibration.json); returns what is served now.
    One reload at a time: ApiError 409 when another one is still running after ``wait_s``, and
    409 with the reason when the artifacts do not load (the served ones stay)."""
    acquired = _reloading.acquire(timeout=wait_s) if wait_s > 0 else _reloading.acquire(blocking=False)
    if not acquired:
        raise ApiError(409, "reload_in_progress", "a reload is already running; retry when it has finished")
    try:
        try:
            preflight(settings.index, settings.checkpoint, settings.caption_index)
            fresh = load_retriever(settings, app.state.shards)
        except Exception as err:  # anything the new artifacts do: the served ones stay
            reason = without_paths(f"{type(err).__name__}: {err}", settings)
            log.warning("reload refused: the new artifacts did not load (%s)", reason)
            raise ApiError(
                409,
                "reload_failed",
                f"the new artifacts did not load ({reason}); {_served_now(app)}",
            ) from None
        install_retriever(app, fresh)
        if app.state.watcher is not None:
            app.state.watcher.rebase()  # what is served is what is on disk now
        return fresh
    finally:
        _reloading.release()


def _served_now(app: FastAPI) -> str:
    """What the server serves after a failed reload, truthfully."""
    state = app.state
    retriever = state.retriever
    if retriever is None:
        return "nothing is served: the artifacts have not loaded since the server started"
    problem = state.refused or retriever.integrity_problem()
    if problem is not None:
        return f"nothing is served meanwhile (searches answer 503): {problem}"
    return "still serving the previous ones"
