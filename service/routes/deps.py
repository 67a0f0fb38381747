"""Shared request helpers of the routers."""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

from fastapi import Request

from icr.index.live_index import LiveIndex
from icr.service.config import Settings
from icr.service.errors import ApiError
from icr.service.loaded_index import LoadedIndex, NotServable
from icr.service.retriever import Retriever
from icr.service.schemas import BLANK

log = logging.getLogger("icr.service")


def settings_of(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def folder_live(target: LoadedIndex, action: str, code: str) -> LiveIndex:
    """The live index of the served folder (:meth:`LoadedIndex.folder_live`); 409 ``code`` saying
    why ``action`` needs one when the server coordinates shards."""
    try:
        return target.folder_live(action)
    except NotServable as err:
        raise ApiError(409, code, str(err)) from None


def retriever_of(request: Request) -> Retriever:
    """The loaded retriever; 503 while the model and index are still loading (or failed to), and
    while a served file is changed on disk (logged once at warning level)."""
    retriever: Retriever | None = request.app.state.retriever
    refused = request.app.state.refused
    if refused is not None:
        raise ApiError(503, "artifacts_changed", refused)
    if retriever is None:
        error = request.app.state.load_error
        if error is not None:
            raise ApiError(503, "load_failed", f"the model or index failed to load: {error}")
        raise ApiError(
            503,
            "not_ready",
            "the model and index are still loading; retry in a few seconds "
            "(GET /readyz turns 200 when ready)",
        )
    problem = retriever.integrity_problem()
    if problem is not None:
        if request.app.state.integrity_warned != problem:  # once per problem, not per request
            request.app.state.integrity_warned = problem
            log.warning("searches and /readyz answer 503: %s", problem)
        raise ApiError(503, "artifacts_changed", problem)
    return retriever


class DecodeSlots:
    """At most ``size`` images decoded at once: a 116 KB PNG can declare 40 M pixels (160 MB decoded,
    as much again converted), and eight such uploads at once took a server from 0.6 to 2.8 GB. A
    request waits up to ``wait_s`` for a slot (a burst is queued and answered), then gets 503 with
    Retry-After (sustained overload is refused at once, not left to time out)."""

    RETRY_AFTER_S = 2

    def __init__(self, size: int, wait_s: float) -> None:
        self.size = size
        self.wait_s = wait_s
        self._free = threading.BoundedSemaphore(size)

    @contextmanager
    def slot(self) -> Iterator[None]:
        # the request's worker thread waits here (the image routes are sync), at most wait_s
        if not self._free.acquire(timeout=self.wait_s):
            raise ApiError(
                503,
                "busy",
                f"the server is decoding {self.size} images already (ICR_MAX_CONCURRENT_DECODES) and none "
                f"finished within {self.wait_s:g} s (ICR_DECODE_WAIT_SECONDS); retry in "
                f"{self.RETRY_AFTER_S} s",
                headers={"Retry-After": str(self.RETRY_AFTER_S)},
            )
        try:
            yield
        finally:
            self._free.release()
            release_freed_memory()


@cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim  # noqa: B018 (probe: not glibc -> AttributeError)
    except (OSError, AttributeError):
        return None
    return libc


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    glibc keeps a decoded image's freed blocks in the arena of the worker thread that decoded it,
    so eight 40 M-pixel uploads decoded two at a time (DecodeSlots) still grew the peak RSS by
    1.8 GB, one image per thread. Trimming after each decode bounds the peak by the decodes in
    flight; it costs a walk over the arenas on image requests only, and leaves the allocator's
    behaviour for searches as it is.
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def decode_slots_of(request: Request) -> DecodeSlots:
    slots: DecodeSlots = request.app.state.decode_slots
    return slots


def query_text(raw: str, settings: Settings, field: str, empty_fix: str, long_fix: str) -> str:
    """A text query as search reads it: stripped of blank (as the schema's pattern reads it, U+FEFF
    too), not empty, and at most ICR_MAX_TEXT_CHARS as sent (the limit the schema states); 422s that
    name ``field`` and end with the fix."""
    text = raw.strip(BLANK)
    if not text:
        raise ApiError(422, "invalid_request", f"{field}: empty; {empty_fix}")
    if len(raw) > settings.max_text_chars:
        raise ApiError(
            422,
            "invalid_request",
            f"{field}: {len(raw)} characters, at most {settings.max_text_chars} "
            f"(ICR_MAX_TEXT_CHARS){long_fix}",
        )
    return text
