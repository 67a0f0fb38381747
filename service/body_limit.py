"""Refuse request bodies above the configured size before they are read into memory, and bodies
that do not arrive in time.

The size bound is per route: image uploads may be megabytes (ICR_MAX_UPLOAD_BYTES), every other
body is a small JSON object (ICR_MAX_JSON_BYTES), so no client can make the server parse and
validate megabytes of JSON on its event loop (a 10 MB search body took 1.4 s there, and every other
client waited behind it).

A client that sends its headers and then trickles or stalls holds a worker: the whole body has one
deadline, counted from when the request reached the app, so a client sending a byte now and then
cannot stretch it."""

from __future__ import annotations

import asyncio

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from icr.service.errors import error_response


class BodyLimitMiddleware:
    """413 for a declared Content-Length over the route's limit, or for a chunked body that grows
    past it; 408 for a body not complete ``read_timeout_s`` after the request's headers. Paths in
    ``upload_paths`` take ``upload_max_bytes``, and so do ``bulk_paths`` (batches of embeddings an
    admin writes), every other path ``json_max_bytes``."""

    def __init__(
        self,
        app: ASGIApp,
        json_max_bytes: int,
        upload_max_bytes: int,
        upload_paths: frozenset[str],
        read_timeout_s: float = 30.0,
        bulk_paths: frozenset[str] = frozenset(),
    ):
        self.app = app
        self.upload_paths = upload_paths
        self.bulk_paths = bulk_paths
        self.read_timeout_s = read_timeout_s  # for the whole body
        # (bound, the message for a body over it), built once: every request looks one up
        self.upload_limit = (
            upload_max_bytes,
            (
                f"request body over {upload_max_bytes} bytes; send a smaller image (resize or recompress it) "
                "or raise ICR_MAX_UPLOAD_BYTES on the server"
            ),
        )
        self.bulk_limit = (
            upload_max_bytes,
            f"request body over {upload_max_bytes} bytes (ICR_MAX_UPLOAD_BYTES); send fewer images per "
            "request",
        )
        self.json_limit = (
            json_max_bytes,
            (
                f"request body over {json_max_bytes} bytes (ICR_MAX_JSON_BYTES): a search or a job is a "
                "small JSON object; shorten the text or the filter"
            ),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        max_bytes, too_large = (
            self.upload_limit
            if path in self.upload_paths
            else self.bulk_limit
            if path in self.bulk_paths
            else self.json_limit
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await error_response(413, "payload_too_large", too_large)(scope, receive, send)
            return
        received = 0
        complete = False
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s

        async def limited_receive() -> Message:
            nonlocal received, complete
            if complete:  # after the body the app only waits for a disconnect: no deadline for that
                return await receive()
            try:
                # a deadline on this await, not wait_for's task per message (a body of one message,
                # as a search is, then costs no extra task and loop turn)
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body did not arrive within {self.read_timeout_s:g} s "
                    f"({received} bytes came; ICR_BODY_TIMEOUT_SECONDS); send it at once",
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise HTTPException(413, too_large)
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)
