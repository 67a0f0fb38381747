"""Every error leaves the API as JSON ``{"error", "message", "detail"}`` with a 4xx that says how to fix it.

Validation errors are reworded from pydantic's list into one sentence naming each field; an
unexpected exception is logged with its traceback and answered with a 500 that still has a body
(the server keeps serving).
"""

from __future__ import annotations

import difflib
import json
import logging
import re
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from icr.index.metadata import MetadataUnreadable
from icr.service.sharded_index import ShardsUnavailable

log = logging.getLogger("icr.service")


class ApiError(Exception):
    """An error a client can fix (or wait out): status, short code, and a message saying how."""

    def __init__(
        self, status: int, code: str, message: str, detail: Any = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.detail = detail
        self.headers = headers


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error can always be sent, even when a message quotes client
    input that is not valid Unicode (a lone surrogate cannot be encoded as UTF-8)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


# An absolute file path (two components at least; "file://" in front too), which the response
# names by its last component. API paths (/v1/...) are routes, not files, and stay.
_ABSOLUTE_PATH = re.compile(
    r"(?:file://|(?<![\w./:~-]))/(?!v1/)(?:[^/\s'\"`,;()\[\]{}<>]+/)+([^/\s'\"`,;()\[\]{}<>]*)"
)


def without_absolute_paths(text: str) -> str:
    """``text`` with every absolute path replaced by its last component: no response tells a client
    where the server keeps its files (a manifest records where the build ran)."""
    return _ABSOLUTE_PATH.sub(lambda m: m.group(1) or "(a folder)", text)


def error_response(
    status: int, code: str, message: str, detail: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return _AsciiJSONResponse(
        {"error": code, "message": without_absolute_paths(message), "detail": detail},
        status_code=status,
        headers=headers,
    )


_LOCATIONS = ("body", "query", "path", "form", "header", "cookie")


def _field(loc: tuple[Any, ...]) -> str:
    """The field an error's ``loc`` names, without where it was sent: ("query", "query") is the
    query parameter ``query``, ("body", "query") the body's field ``query``."""
    parts = [str(p) for p in (loc[1:] if loc and loc[0] in _LOCATIONS else loc)]
    return ".".join(parts) or "body"


def _one(error: Mapping[str, Any], known: Sequence[str]) -> str:
    if error.get("type") == "json_invalid":
        return 'the body is not valid JSON; send e.g. {"text": "a red circle", "k": 10}'
    field = _field(tuple(error.get("loc", ())))
    if error.get("type") == "extra_forbidden":  # a misspelt field must not be silently ignored
        name = field.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if not known:  # a body of alternative shapes (a union): the field names the shape it broke
            return f"{field}: unknown field in that form of the request; remove it"
        hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(known)}"
        return f"{field}: unknown field; {hint}"
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{field}: {message}"


def validation_message(errors: Sequence[Mapping[str, Any]], known: Sequence[str] = ()) -> str:
    """``k: Input should be less than or equal to 100; text: Field required``; ``known``: the
    body's field names, which an unknown field's message suggests from."""
    return "; ".join(_one(e, known) for e in errors)


def _body_fields(request: Request) -> list[str]:
    """The field names of the JSON body the request's route takes (none for other routes)."""
    body = getattr(request.scope.get("route"), "body_field", None)
    model = getattr(getattr(body, "field_info", None), "annotation", None)
    return list(getattr(model, "model_fields", {}))


_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
}


def leaf_routes(items: list[Any]) -> Iterator[Any]:
    """Every route of ``items``, included routers walked (FastAPI wraps each in an object of its own)."""
    for route in items:
        inner = getattr(route, "original_router", None)
        yield from leaf_routes(inner.routes) if inner is not None else (route,)


def _allowed_methods(request: Request) -> list[str]:
    """The methods of every route whose path matches the request's (routers included, walked)."""
    methods: set[str] = set()
    for route in leaf_routes(request.app.router.routes):
        pattern = getattr(route, "path_regex", None)
        if pattern is not None and pattern.match(request.url.path):
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return error_response(err.status, err.code, err.message, err.detail, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in err.errors()]
        message = validation_message(errors, _body_fields(request))
        return error_response(422, "invalid_request", message + " (see /docs)", errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = err.detail if isinstance(err.detail, str) else str(err.detail)
        headers = getattr(err, "headers", None)
        if err.status_code == 404 and message == "Not Found":
            message = "no such endpoint; the API is listed at /docs"
        if err.status_code == 400 and message == "There was an error parsing the body":
            # undecodable bytes: the same answer as any other body that is not JSON (422, documented)
            return error_response(
                422,
                "invalid_request",
                'the body is not valid JSON (UTF-8); send e.g. {"text": "a red circle", "k": 10}',
            )
        if err.status_code == 400 and request.headers.get("content-type", "").startswith("multipart/"):
            # Starlette's multipart parser (a missing boundary, malformed parts): a body the client
            # must send differently, answered like any other invalid request (422, documented)
            return error_response(
                422,
                "invalid_request",
                f"the body is not valid multipart/form-data ({message.rstrip('.')}); send the image as "
                "the form field 'file', e.g. curl -F file=@photo.jpg",
            )
        if err.status_code == 405:
            # Starlette names the first matching route's methods only; a path may have several routes
            allowed = _allowed_methods(request)
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
            message = f"{request.method} is not supported here; use {' or '.join(allowed)}"
        return error_response(
            err.status_code, _STATUS_CODES.get(err.status_code, "http_error"), message, headers=headers
        )

    async def _metadata_changed(request: Request, err: Exception) -> JSONResponse:
        # the served metadata.sqlite was rewritten or damaged under its open handle: the file check
        # (service.routes.deps) or the watcher refuses it next
        log.error("metadata unreadable on %s %s: %s", request.method, request.url.path, err)
        return error_response(
            503,
            "artifacts_changed",
            f"the index's metadata could not be read ({err}): a served file changed on disk or is damaged; "
            "GET /readyz says what to do (the server reloads whole artifacts by itself when watching)",
        )

    async def _shards_down(request: Request, err: Exception) -> JSONResponse:
        log.warning("%s %s: %s", request.method, request.url.path, err)
        return error_response(503, "shards_unavailable", str(err), headers={"Retry-After": "1"})

    app.add_exception_handler(ShardsUnavailable, _shards_down)
    app.add_exception_handler(sqlite3.DatabaseError, _metadata_changed)
    app.add_exception_handler(MetadataUnreadable, _metadata_changed)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", f"unexpected {type(err).__name__}; see the server log")
