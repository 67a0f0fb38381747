"""The FastAPI app: ``create_app(settings)``; the model and indices load in the lifespan.

Loading runs in a background thread so the process answers /healthz at once and /readyz turns from
503 to 200 when search can run; the cheap agreement check of checkpoint and indices runs first, in
the foreground, so a mismatch stops the server with one message instead of serving nothing. A load
that fails is retried with backoff (``ICR_LOAD_RETRY_SECONDS``, doubling up to 60 s), and /readyz
answers 503 with the reason and the next attempt meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles

from icr.index.filters import filter_schema
from icr.service.access import KEY_HEADER, AccessMiddleware, access_of
from icr.service.body_limit import BodyLimitMiddleware
from icr.service.config import Settings, get_settings
from icr.service.errors import install_error_handlers
from icr.service.headers import SecurityHeadersMiddleware
from icr.service.jobs import JobRunner, JobStore
from icr.service.loaded_index import preflight
from icr.service.refusal_penalty import RefusalPenaltyMiddleware
from icr.service.routes import admin, benchmarks, feedback, health, image_writes, images, page, search
from icr.service.routes.deps import DecodeSlots
from icr.service.schemas import FILTER_DESCRIPTION, NONBLANK_TEXT_PATTERN
from icr.service.serving import install_retriever, load_retriever, without_paths
from icr.service.sharded_index import ShardConnector
from icr.service.telemetry import MetricsMiddleware, Telemetry
from icr.service.watcher import ArtifactWatcher, watched_files

log = logging.getLogger("icr.service")
VERSION = "1"
# multipart framing around an upload of max_upload_bytes
_MULTIPART_SLACK = 64 << 10
# The routes whose bodies are image uploads (ICR_MAX_UPLOAD_BYTES); every other body is a small
# JSON object (ICR_MAX_JSON_BYTES).
UPLOAD_PATHS = frozenset({"/v1/search/image", "/v1/images:upload"})


# Loading that fails (a file being replaced, a disk not yet mounted) is retried after 1x, 2x, 4x...
# ICR_LOAD_RETRY_SECONDS, at most this long apart.
_MAX_RETRY_SECONDS = 60.0


def _load(app: FastAPI, settings: Settings, stop: threading.Event) -> None:
    delay = settings.load_retry_seconds
    attempt = 1
    while not stop.is_set():
        try:
            install_retriever(app, load_retriever(settings, app.state.shards))
            log.info("ready: %s", settings.index)
            if settings.watch_seconds > 0 and not stop.is_set():
                app.state.watcher = _watcher(app, settings)
                app.state.watcher.start()
            return
        except Exception as err:  # reported by /readyz and every search; the first with its traceback
            reason = without_paths(f"{type(err).__name__}: {err}", settings)
            log.error(
                "loading failed (attempt %d, retrying in %.1f s): %s",
                attempt,
                delay,
                reason,
                exc_info=attempt == 1,
            )
            app.state.load_error = f"{reason} (attempt {attempt}; retrying in {delay:.1f} s)"
        stop.wait(delay)
        delay = min(2 * delay, _MAX_RETRY_SECONDS)
        attempt += 1


def _watcher(app: FastAPI, settings: Settings) -> ArtifactWatcher:
    """Reloads the artifacts when their files change on disk (see :mod:`service.watcher`)."""

    def files() -> list[Path]:
        retriever = app.state.retriever
        folders = [settings.index, *([settings.caption_index] if settings.caption_index else [])]
        return watched_files(folders, retriever.checkpoint if retriever is not None else None)

    def refuse(reason: str | None) -> None:
        if reason is not None and reason != app.state.refused:
            log.warning("searches and /readyz answer 503 until the artifacts are whole: %s", reason)
        elif reason is None and app.state.refused is not None:
            log.warning("the artifacts are whole again: serving")
        app.state.refused = reason

    return ArtifactWatcher(
        files,
        settings.watch_seconds,
        reload=lambda: load_retriever(settings, app.state.shards),
        swap=lambda fresh: install_retriever(app, fresh),
        refuse=refuse,
        describe=lambda err: without_paths(f"{type(err).__name__}: {err}", settings),
    )


def _tail_writes(app: FastAPI, settings: Settings, stop: threading.Event) -> None:
    """Apply what other servers on the state directory wrote (this server's own writes are applied
    before they are acknowledged), every ICR_WRITES_POLL_SECONDS."""
    failing = False
    while not stop.wait(settings.writes_poll_seconds):
        retriever = app.state.retriever
        if retriever is None:
            continue
        try:
            retriever.images.live.refresh()
            failing = False
        except Exception:  # a locked or damaged file: searches go on at the last state applied
            if not failing:
                log.exception("applying the write log failed; searches see the writes applied so far")
            failing = True


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    checkpoint, _ = preflight(settings.index, settings.checkpoint, settings.caption_index)
    torch.set_num_threads(settings.encode_threads)  # process-wide; benchmark jobs run in their own
    stop = threading.Event()
    loader = threading.Thread(target=_load, args=(app, settings, stop), name="icr-load", daemon=True)
    loader.start()
    if settings.writes:
        threading.Thread(
            target=_tail_writes, args=(app, settings, stop), name="icr-writes", daemon=True
        ).start()
    app.state.jobs = JobStore(settings.jobs_path)
    app.state.runner = JobRunner(
        app.state.jobs,
        checkpoint,
        dict(settings.datasets),
        device=settings.device,
        lease_s=settings.job_lease_seconds,
        retention_days=settings.job_retention_days,
    )
    app.state.runner.start()
    try:
        yield
    finally:
        stop.set()
        if app.state.watcher is not None:
            app.state.watcher.close()
        app.state.runner.stop()


def _openapi_with_limits(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """FastAPI's schema, made to tell the truth about this server: the paging bounds its settings
    set (ICR_MAX_K, ICR_SEARCH_DEPTH) and the error body every 4xx/5xx really has."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = FastAPI.openapi(app)
    components = schema["components"]["schemas"]
    _search_bounds(components, settings)
    benchmark = components["BenchmarkRequest"]["properties"]
    benchmark["distractors"]["maximum"] = settings.max_benchmark_distractors
    if settings.datasets:  # the names this server has (a request may still name another: 404)
        benchmark["dataset"]["enum"] = sorted(settings.datasets)
    # an upload must have content
    components["Body_search_image_v1_search_image_post"]["properties"]["file"]["minLength"] = 1
    retriever = app.state.retriever
    _served_index_bounds(components, retriever)
    _text_bounds(schema, settings)
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    for operations in schema["paths"].values():
        for operation in operations.values():
            for status, response in operation.get("responses", {}).items():
                if status.startswith(("4", "5")):  # FastAPI's default 422 body is not what we send
                    response["content"] = {"application/json": {"schema": error_ref}}
    schema["components"]["securitySchemes"] = {
        "ApiKey": {"type": "apiKey", "in": "header", "name": KEY_HEADER}
    }
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            need = access_of(method.upper(), path, settings)
            key = {"read": settings.api_key, "admin": settings.admin_key}.get(need)
            if key is not None:  # declared where this server really asks for it
                operation["security"] = [{"ApiKey": []}]
                for code, meaning in ((401, "The X-API-Key header is missing."), (403, "Wrong X-API-Key.")):
                    body = {"application/json": {"schema": error_ref}}
                    operation["responses"].setdefault(str(code), {"description": meaning, "content": body})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    if retriever is None:
        app.openapi_schema = None
    return schema


def _text_bounds(schema: dict[str, Any], settings: Settings) -> None:
    """Every text query (searched, labelled, or whose labels are read): not blank (the server strips
    it), and at most ICR_MAX_TEXT_CHARS as sent."""
    components = schema["components"]["schemas"]
    texts = [components[model]["properties"][field] for model, field in _TEXTS]
    texts += [  # the same text, read from the query string
        parameter["schema"]
        for parameter in schema["paths"]["/v1/feedback/labels"]["get"]["parameters"]
        if parameter["name"] == "query"
    ]
    for text in texts:
        text.update(pattern=NONBLANK_TEXT_PATTERN, maxLength=settings.max_text_chars)


_TEXTS = (("TextSearchRequest", "text"), ("FeedbackRequest", "query"))
_SEARCHES = (
    "TextSearchRequest",
    "Body_search_image_v1_search_image_post",
    "SimilarSearchRequest",
    "VectorSearchRequest",
)


def _search_bounds(components: dict[str, Any], settings: Settings) -> None:
    """The paging bounds and thresholds of every search's body (and the image upload's form)."""
    for name in _SEARCHES:
        model = components[name]
        props = model["properties"]
        props["k"].update(minimum=1, maximum=settings.max_k)
        props["offset"].update(minimum=0, maximum=settings.search_depth - settings.max_k)
        # a form cannot send null: there a threshold is a number or absent
        form = name.startswith("Body_")
        for field, lo in (("min_score", -1.0), ("min_relevance", 0.0)):
            if field in props:  # searches by vector have no calibrated relevance to threshold
                props[field] = _bounded_number(props[field], lo, 1.0, nullable=not form)
        if "min_relevance" in props:  # never both thresholds
            numbers = {"min_score": {"type": "number"}, "min_relevance": {"type": "number"}}
            model["not"] = {"required": ["min_score", "min_relevance"], "properties": numbers}


def _served_index_bounds(components: dict[str, Any], retriever: Any) -> None:
    """What the served index allows: the filter names its fields, each with values of the kinds
    it holds, ids within it, vectors of its dim. Until it is loaded (``retriever`` None) any field
    is allowed and the document is not cached (a reload with other fields also drops it, see
    routes/admin.py)."""
    fields = retriever.images.manifest.metadata_fields if retriever is not None else None
    types = retriever.images.field_types if retriever is not None else None
    for name in ("TextSearchRequest", "SimilarSearchRequest", "VectorSearchRequest"):
        search = components[name]["properties"]
        search["filter"] = {
            "anyOf": [filter_schema(fields, types), {"type": "null"}],
            "description": search["filter"].get("description", ""),
        }
    deleting = components["DeleteByFilter"]["properties"]
    deleting["filter"] = {
        **filter_schema(fields, types),
        "minProperties": 1,
        "description": FILTER_DESCRIPTION,
    }
    if retriever is None:
        return
    manifest = retriever.images.manifest
    writable = retriever.images.live.writable
    if manifest.ntotal:
        # images added online take ids from ntotal up: a similar search may name them
        for name in ("FeedbackRequest",) if writable else ("SimilarSearchRequest", "FeedbackRequest"):
            components[name]["properties"]["image_id"]["maximum"] = manifest.ntotal - 1
    for name in ("VectorSearchRequest", "ImageToAdd"):
        vector = components[name]["properties"]["vector"]
        vector.update(minItems=manifest.dim, maxItems=manifest.dim)
        # not all 0 (no direction to search in): some value above or below 0
        vector["contains"] = {"type": "number", "anyOf": [{"exclusiveMinimum": 0}, {"exclusiveMaximum": 0}]}
    written = _fields_schema(manifest.metadata_fields, retriever.images.field_types)
    components["ImageToAdd"]["properties"]["fields"] = {"anyOf": [written, {"type": "null"}]}
    if manifest.metadata_fields:  # an index without fields has none to set (a patch is a 422)
        components["PatchImageRequest"]["properties"]["fields"] = {**written, "minProperties": 1}


# a field's recorded JSON kinds -> the JSON Schema types a written value may have (numbers mix)
_WRITTEN_TYPES = {
    "string": ["string"],
    "integer": ["number"],
    "number": ["number"],
    "boolean": ["boolean"],
    "array": ["array"],
    "object": ["object"],
}


def _fields_schema(fields: list[str], types: dict[str, list[str]]) -> dict[str, Any]:
    """JSON Schema of the fields a write may set: the index's own, each with a value of a kind it
    holds (any kind where none is recorded), or null."""
    properties = {}
    for name in fields:
        kinds = sorted({t for kind in types.get(name, []) for t in _WRITTEN_TYPES.get(kind, [])})
        properties[name] = {"type": [*kinds, "null"]} if kinds else {}
    return {"type": "object", "properties": properties, "additionalProperties": False}


def _bounded_number(prop: dict[str, Any], lo: float, hi: float, nullable: bool) -> dict[str, Any]:
    """A pydantic ``float | None`` property as a number in [lo, hi], or null when ``nullable``."""
    out = {k: v for k, v in prop.items() if k not in ("anyOf", "default", "type", "minimum", "maximum")}
    number = {"type": "number", "minimum": lo, "maximum": hi}
    return {**out, "anyOf": [number, {"type": "null"}]} if nullable else {**out, **number}


def create_app(settings: Settings | None = None, shards: ShardConnector | None = None) -> FastAPI:
    """``shards``: serve a sharded index whose shards this reaches (``settings.index`` is one of
    them, read for the agreement check and watched); the API is the same."""
    settings = settings if settings is not None else get_settings()
    app = FastAPI(
        title="icr: image-caption retrieval",
        version=VERSION,
        description="Text->image and image->text search thresholded by raw cosine or calibrated relevance, "
        "and offline Flickr30k/COCO/synthetic benchmark jobs. The search page is at /.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.shards = shards
    app.state.retriever = None
    app.state.load_error = None
    app.state.refused = None  # why the served artifacts may not be used (changed in place on disk)
    app.state.integrity_warned = None  # the last served-file problem logged (service.routes.deps)
    app.state.watcher = None
    app.state.telemetry = Telemetry()
    app.state.decode_slots = DecodeSlots(settings.max_concurrent_decodes, settings.decode_wait_seconds)
    install_error_handlers(app)
    for module in (health, search, images, image_writes, benchmarks, admin, feedback, page):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=page.STATIC_DIR), name="static")
    app.openapi = lambda: _openapi_with_limits(app, settings)  # type: ignore[method-assign]
    # Innermost first: the body bound and the keys see a request before anything reads its body; the
    # refusal penalty and the metrics sit outside them, so 401, 403 and 413 are slowed and counted too.
    app.add_middleware(
        BodyLimitMiddleware,
        json_max_bytes=settings.max_json_bytes,
        upload_max_bytes=settings.max_upload_bytes + _MULTIPART_SLACK,
        upload_paths=UPLOAD_PATHS,
        read_timeout_s=settings.body_timeout_seconds,
        bulk_paths=frozenset({"/v1/images"}),  # up to 1,000 embeddings: admin only, parsed at once
    )
    app.add_middleware(AccessMiddleware)  # before any body is read
    app.add_middleware(SecurityHeadersMiddleware)
    rate = settings.refusals_per_second
    app.add_middleware(RefusalPenaltyMiddleware, rate=rate, burst=2 * rate)
    app.add_middleware(MetricsMiddleware, telemetry=app.state.telemetry)
    if settings.cors_origins:  # outermost: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Content-Type", KEY_HEADER],
        )
    return app
