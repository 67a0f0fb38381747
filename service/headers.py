"""Security headers on every response; a strict Content-Security-Policy on the search page."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_EVERYWHERE = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer")]
# The page loads only its own script, styles and images (uploads are previewed from blob: URLs);
# the API docs at /docs load Swagger UI from a CDN and are left out.
_PAGE = [
    (
        b"content-security-policy",
        b"default-src 'self'; img-src 'self' blob: data:; object-src 'none'; "
        b"base-uri 'none'; frame-ancestors 'none'",
    ),
    (b"x-frame-options", b"DENY"),
]


class SecurityHeadersMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        page = scope["path"] == "/" or scope["path"].startswith("/static/")
        extra = _EVERYWHERE + (_PAGE if page else [])

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                message["headers"] = headers + [h for h in extra if h[0] not in names]
            await send(message)

        await self.app(scope, receive, with_headers)
