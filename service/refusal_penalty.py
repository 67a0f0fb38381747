"""A client that keeps sending requests the server refuses is slowed down, so it cannot stall others.

Bounding the body (``service.body_limit``) made one bad request cheap, but a client looping cheap
refused requests still takes the event loop from everyone: two clients posting over-long search
bodies in a loop got 1,260 answers/s and raised a third client's median search from 5 ms to 54 ms
on a 2-core machine. Each client (``service.client_address``) has a token bucket of refusals
(every 4xx except 429): ``rate`` per second, up to ``burst`` at once. A refusal beyond it is
answered after :data:`PENALTY_SECONDS`. Waiting costs the server a timer, not CPU, so a looping
client sends about one request per second per connection instead of a thousand, and a client that
makes an occasional mistake never notices. 2xx answers, 429 (already a request to slow down) and
5xx (the server's fault) cost nothing.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from icr.service.client_address import client_of

PENALTY_SECONDS = 1.0
_MAX_CLIENTS = 10_000  # buckets kept; beyond, all are dropped (a client then starts with a full bucket)


class RefusalPenaltyMiddleware:
    """Delays a client's refusals beyond ``rate`` per second (``burst`` at once); ``rate`` 0: off.
    Reads the trusted proxies from ``app.state.settings`` at each request."""

    def __init__(self, app: ASGIApp, rate: float, burst: float) -> None:
        self.app = app
        self.rate = rate
        self.burst = burst
        self.buckets: dict[str | None, tuple[float, float]] = {}  # client -> (tokens, when counted)

    def _overdrawn(self, client: str | None) -> bool:
        """Take one refusal from the client's bucket; True when it had none left."""
        now = time.monotonic()
        tokens, then = self.buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if len(self.buckets) >= _MAX_CLIENTS and client not in self.buckets:
            self.buckets.clear()
        self.buckets[client] = (max(tokens - 1.0, 0.0), now)
        return tokens < 1.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.rate <= 0:
            await self.app(scope, receive, send)
            return

        async def penalised_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                if 400 <= status < 500 and status != 429:
                    proxies = tuple(scope["app"].state.settings.trusted_proxies)
                    if self._overdrawn(client_of(scope, proxies).address):
                        await asyncio.sleep(PENALTY_SECONDS)
            await send(message)

        await self.app(scope, receive, penalised_send)
