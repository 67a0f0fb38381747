"""Who may call what: API keys checked on the request line and headers, before any body is read.

* **read** (search, images, info, listing jobs): open, or with ``ICR_API_KEY`` set, the
  ``X-API-Key`` header must carry it (or the admin key);
* **admin** (submitting and cancelling benchmark jobs, reloading artifacts, labelling hits and
  refitting the calibration from the labels, adding, changing and deleting images): with
  ``ICR_ADMIN_KEY`` set, that key; unset, clients on this machine only (a job costs minutes of
  CPU), where the client is the TCP peer, or the address a proxy in ``ICR_TRUSTED_PROXIES`` forwarded
  (:mod:`service.client_address`);
* **open**: the search page and its files, the API docs, liveness and readiness (unless
  ``ICR_HEALTH_NEED_KEY``) and ``/metrics`` (unless ``ICR_METRICS_NEED_KEY``): either setting makes
  those read routes.

Keys are compared in constant time. Being an ASGI middleware, the check runs before routing and
before the body is read, so a client without a key learns nothing from validation errors.
"""

from __future__ import annotations

import hmac
import re
from functools import lru_cache

from starlette.types import ASGIApp, Receive, Scope, Send

from icr.service.client_address import client_of
from icr.service.config import Settings
from icr.service.errors import error_response

_OPEN = re.compile(r"^/($|static/|docs|redoc|openapi\.json$)")
_HEALTH = ("/healthz", "/readyz")
_ADMIN = {
    ("POST", re.compile(r"^/v1/benchmarks/?$")),
    ("DELETE", re.compile(r"^/v1/benchmarks/[^/]+$")),
    ("POST", re.compile(r"^/v1/admin/")),
    ("POST", re.compile(r"^/v1/feedback(/refit)?/?$")),
    ("POST", re.compile(r"^/v1/images(:upload|:delete)?/?$")),
    ("PATCH", re.compile(r"^/v1/images/[^/]+$")),
    ("DELETE", re.compile(r"^/v1/images/[^/]+$")),
}
ADMIN_KEY_IDENTITY = "admin-key"  # who labelled, when the admin key was used (never the key itself)
KEY_HEADER = "X-API-Key"


def access_of(method: str, path: str, settings: Settings) -> str:
    """``open``, ``read`` or ``admin``: what a request to ``path`` needs."""
    return _access(method, path, settings.metrics_need_key, settings.health_need_key)


@lru_cache(maxsize=1024)  # every request asks; the paths in use are few (bounded: any path may come)
def _access(method: str, path: str, metrics_need_key: bool, health_need_key: bool) -> str:
    if any(m == method and p.match(path) for m, p in _ADMIN):
        return "admin"
    if (
        _OPEN.match(path)
        or (path == "/metrics" and not metrics_need_key)
        or (path in _HEALTH and not health_need_key)
    ):
        return "open"
    return "read"


def _same(given: str, key: str | None) -> bool:
    return key is not None and hmac.compare_digest(given.encode(), key.encode())


def _given_key(scope: Scope) -> str | None:
    given = dict(scope["headers"]).get(KEY_HEADER.lower().encode())
    return given.decode("latin-1") if given is not None else None


def admin_identity(scope: Scope, settings: Settings) -> str | None:
    """Who this request is as an admin, by the rule the middleware applies: ``"admin-key"`` when
    ``ICR_ADMIN_KEY`` is set and was sent, the client's address when it is unset and the client is
    on this machine; None when the request has no admin rights. Short and never secret: it is
    stored with each label (who judged) and tells the search page whether it may label."""
    if settings.admin_key is not None:
        given = _given_key(scope)
        return ADMIN_KEY_IDENTITY if given is not None and _same(given, settings.admin_key) else None
    client = client_of(scope, tuple(settings.trusted_proxies))
    return (client.address or "local") if client.is_local else None


class AccessMiddleware:
    """Reads the settings from the app's state at each request (``app.state.settings``)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope, scope["app"].state.settings)
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await error_response(*refusal)(scope, receive, send)

    def _refusal(self, scope: Scope, settings: Settings) -> tuple[int, str, str] | None:
        need = access_of(scope["method"], scope["path"], settings)
        if need == "open" or (need == "read" and settings.api_key is None):  # nothing to check
            return None
        given_text = _given_key(scope)
        admin_ok = given_text is not None and _same(given_text, settings.admin_key)
        if need == "read":
            read_ok = given_text is not None and _same(given_text, settings.api_key)
            if settings.api_key is None or admin_ok or read_ok:
                return None
        elif settings.admin_key is None:
            client = client_of(scope, tuple(settings.trusted_proxies))
            if client.is_local:
                return None
            return (
                403,
                "forbidden",
                f"{_admin_action(scope['path'])} is accepted from this machine only while the server has no "
                f"ICR_ADMIN_KEY, and this request came from {client.address or 'an unknown client'} "
                f"({client.how}); set ICR_ADMIN_KEY on the server and send it in the {KEY_HEADER} header",
            )
        elif admin_ok:
            return None
        setting = "ICR_API_KEY" if need == "read" else "ICR_ADMIN_KEY"
        what = "this endpoint" if need == "read" else _admin_action(scope["path"])
        if given_text is None:
            return (401, "unauthorized", f"{what} needs the {KEY_HEADER} header (the server's {setting})")
        return (403, "forbidden", f"wrong {KEY_HEADER} for {what} (the server's {setting})")


def _admin_action(path: str) -> str:
    """What an admin request does, for its refusal."""
    if path.startswith("/v1/admin/"):
        return f"the admin request {path}"
    if path.startswith("/v1/feedback"):
        return "labelling hits or refitting the calibration from the labels"
    if path.startswith("/v1/images"):
        return "adding, changing or deleting images"
    return "submitting or cancelling benchmark jobs"
