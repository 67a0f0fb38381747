"""``icr serve --workers N``: N server processes on one port, so a query's Python work (parsing,
tokenising, encoding, JSON) runs on every core instead of one.

uvicorn starts the workers (spawned processes sharing the listening socket) and restarts one that
dies. Each builds the same app from the settings the command resolved, passed in the environment
(``ICR_WORKER_SETTINGS``, JSON), encodes with its share of the cores (ICR_TORCH_THREADS) and loads
the index into its own memory, or memory-mapped with ICR_MMAP=true: one copy in the page cache for
all N, searched 1.7x slower (an inverted file at 1M, measured). They are N replicas of one server:
writes go through the shared write log and every worker applies the others' (as separate servers
on one state directory do), benchmark jobs are leased from the shared jobs database, and each
worker counts its own metrics.
"""

from __future__ import annotations

import os
from typing import Any

from icr.service.config import Settings
from icr.service.http_protocol import bounded_protocol
from icr.service.main import create_app

SETTINGS_ENV = "ICR_WORKER_SETTINGS"
APP = "icr.service.workers:app"  # the factory each worker calls
PROTOCOL = "icr.service.workers:Protocol"  # the HTTP protocol class each worker imports


def environment(settings: Settings) -> dict[str, str]:
    """The variables that carry ``settings`` to the workers."""
    return {SETTINGS_ENV: settings.model_dump_json(exclude_none=True)}


def _settings() -> Settings:
    # validated as given: the worker reads no ICR_* variable or file again
    return Settings.model_validate_json(os.environ[SETTINGS_ENV])


def app() -> Any:
    """The app of one worker (uvicorn's factory)."""
    return create_app(_settings())


def __getattr__(name: str) -> Any:
    # ``Protocol``: the bounded HTTP protocol with the server's limits, made when a worker imports it
    # (a class made at run time cannot be pickled into a spawned worker, an import string can)
    if name == "Protocol":
        settings = _settings()
        return bounded_protocol(settings.header_timeout_seconds, settings.max_connections_per_client)
    raise AttributeError(name)
