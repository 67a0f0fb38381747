"""Loading the artifacts and switching the app to them: at start-up, on ``POST /v1/admin/reload`` and
when the watcher reloads (one module, so the app and its admin route both import it)."""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI

from icr.index.calibration import CALIBRATION_FILE
from icr.service.config import Settings
from icr.service.retriever import Retriever
from icr.service.sharded_index import ShardConnector, ShardSet

log = logging.getLogger("icr.service")


def without_paths(text: str, settings: Settings) -> str:
    """``text`` with the server's artifact folders named, not spelled out (clients see /readyz)."""
    given = (settings.index, settings.caption_index, settings.checkpoint)
    folders = [Path(p) for p in given if p is not None]
    spelled = {str(f.resolve()): f.name for f in folders} | {str(f): f.name for f in folders}
    for path in sorted(spelled, key=len, reverse=True):
        text = text.replace(path, spelled[path])
    return text


def load_retriever(settings: Settings, shards: ShardConnector | None = None) -> Retriever:
    """The model and indices at the configured paths (at start-up, and on POST /v1/admin/reload);
    ``shards``: connects to the shard replicas of a sharded index (``settings.index`` is one of them)."""
    return Retriever.load(
        settings.index,
        settings.checkpoint,
        settings.caption_index,
        device=settings.device,
        gpu=settings.gpu,
        faiss_threads=settings.faiss_threads,
        micro_batch=settings.micro_batch,
        writes=settings.state_path if settings.writes else None,
        mmap=settings.mmap,
        shards=None
        if shards is None
        else ShardSet(
            shards(),
            timeout_s=settings.shard_timeout_seconds,
            require_all=settings.shard_failure == "unavailable",
        ),
    )


def install_retriever(app: FastAPI, fresh: Retriever) -> None:
    """Serve ``fresh`` (at start-up, on POST /v1/admin/reload, when the watcher reloads)."""
    old: Retriever | None = app.state.retriever
    if old is not None and old.images.calibration is not None and fresh.images.calibration is None:
        log.warning(
            "%s is gone from %s: relevance is no longer given and min_relevance answers 409; "
            "run `icr index calibrate` on the index folder to restore it",
            CALIBRATION_FILE,
            fresh.images.directory.name,
        )
    app.state.retriever = fresh  # one assignment: each request sees the old or the new one
    app.state.integrity_warned = None
    app.openapi_schema = None  # the filter schema names the index's fields
    app.state.load_error = None
