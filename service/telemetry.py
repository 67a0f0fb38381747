"""Prometheus metrics: request counts and latency per route, search latency per stage.

Each app owns its registry (no module-level collectors), so several apps in one process (tests)
do not collide. Routes are labelled by their template (``/v1/images/{image_id}``), never the raw
path, to keep the label set bounded.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from icr.service.errors import leaf_routes

# Milliseconds to seconds: search stages take 0.1-100 ms, benchmark submissions a few ms.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Telemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "icr_http_requests",
            "HTTP requests by route, method and status.",
            ("route", "method", "status"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "icr_http_request_duration_seconds",
            "HTTP request latency by route.",
            ("route", "method"),
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.stages = Histogram(
            "icr_search_stage_duration_seconds",
            "Search latency by endpoint and stage (encode, search, filter, metadata).",
            ("endpoint", "stage"),
            buckets=BUCKETS,
            registry=self.registry,
        )
        # The labelled children, looked up once: ``labels()`` checks and locks on every call, which
        # cost as much as the rest of the middleware per request. The label sets are bounded (route
        # templates, methods, statuses, stages), so these dicts are too.
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children.setdefault(key, metric.labels(*labels))
        return child

    def observe_stages(self, endpoint: str, timings_ms: dict[str, float]) -> None:
        for stage, ms in timings_ms.items():
            if stage != "total_ms":
                self._child(self.stages, endpoint, stage.removesuffix("_ms")).observe(ms / 1000.0)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self._child(self.requests, route, method, str(status)).inc()
        self._child(self.latency, route, method).observe(seconds)


def _template(scope: Scope) -> str:
    """The route template of a request answered before routing (a 401, 403 or 413 from a middleware),
    so refusals are counted under the route they were for; ``unmatched`` for no route."""
    for route in leaf_routes(scope["app"].router.routes):
        match, _ = route.matches(scope)
        if match != Match.NONE:
            return str(getattr(route, "path", "unmatched"))
    return "unmatched"


class MetricsMiddleware:
    """Counts and times every HTTP request (pure ASGI: sees the final status, even of errors)."""

    def __init__(self, app: ASGIApp, telemetry: Telemetry):
        self.app = app
        self.telemetry = telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            label = getattr(scope.get("route"), "path", None) or _template(scope)
            self.telemetry.observe_request(label, scope["method"], status, time.perf_counter() - start)
