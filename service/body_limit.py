"""Refuse request bodies above the configured size before they are read into memory, and bodies
that stop arriving (a client that sends its headers and then trickles or stalls holds a worker)."""

from __future__ import annotations

import asyncio

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from icr.service.errors import error_response


class BodyLimitMiddleware:
    """413 for a declared Content-Length over the limit, or for a chunked body that grows past it."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float = 30.0):
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s  # for each chunk of the body

    def _message(self) -> str:
        return (
            f"request body over {self.max_bytes} bytes; send a smaller image (resize or recompress it) "
            "or raise ICR_MAX_UPLOAD_BYTES on the server"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(413, "payload_too_large", self._message())(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            try:
                # a deadline on this await, not wait_for's task per message (a body of one message,
                # as a search is, then costs no extra task and loop turn)
                async with asyncio.timeout(self.read_timeout_s):
                    message = await receive()
            except TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body stopped arriving for {self.read_timeout_s:g} s "
                    "(ICR_BODY_TIMEOUT_SECONDS); send it at once",
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)
