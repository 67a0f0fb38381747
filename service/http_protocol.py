"""The HTTP/1.1 protocol `icr serve` runs: uvicorn's httptools protocol with a bound on header size
and a deadline for headers.

What uvicorn bounds, and what it does not (uvicorn 0.54, measured with raw sockets):

* header *size*: only its h11 implementation (``h11_max_incomplete_event_size``). Its httptools
  protocol (httptools is a dependency of this package) buffers headers without limit: 50 MB of
  header lines grew a server by 56 MB and got no answer. h11 costs more per request (0.1-0.35 ms
  of a search's 3 ms on 2 busy cores), so :func:`header_deadline_protocol` keeps httptools and
  counts the header bytes itself (431 beyond :data:`MAX_HEADER_BYTES`).
* header *time*: nothing. Its keep-alive timer runs only between requests and stops at a
  connection's first byte, so a client that trickles a header line (or never finishes the blank
  line) holds its connection for ever. The protocol here adds that deadline.
* connections: ``limit_concurrency`` (ICR_MAX_CONNECTIONS) answers 503 to requests beyond it, so
  many idle or slow connections cost bounded memory, though they can still crowd others out until
  their deadlines pass; a reverse proxy in front (nginx, a cloud load balancer) also bounds them
  per client, which a server exposed beyond localhost should have anyway.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEADER_BYTES = 16 << 10  # request line and headers: 431 beyond
KEEP_ALIVE_SECONDS = 5  # an idle kept-alive connection is closed after this (uvicorn's default)


def _response(status: bytes, text: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        b"content-length: " + str(len(text)).encode() + b"\r\n\r\n" + text
    )


_TIMEOUT_RESPONSE = _response(
    b"408 Request Timeout", b"the request headers did not arrive in time (ICR_HEADER_TIMEOUT_SECONDS)"
)
_TOO_LARGE_RESPONSE = _response(
    b"431 Request Header Fields Too Large",
    b"the request line and headers are over %d bytes" % MAX_HEADER_BYTES,
)


class BoundedHttpTools(HttpToolsProtocol):
    """httptools, closing a connection whose request headers are not complete ``header_timeout_s``
    after it opened or after the previous response (408 if part of a request came, silently if none
    did, as an idle keep-alive connection is), and answering 431 once the request line and headers
    pass MAX_HEADER_BYTES."""

    header_timeout_s = 10.0  # set per server by header_deadline_protocol
    _awaiting_headers = True  # the next bytes belong to a request line or headers
    _header_bytes = 0  # received while awaiting headers
    _headers_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_waiting()

    def data_received(self, data: bytes) -> None:
        # httptools reports no offsets, so whole reads are counted, and only those that begin
        # while headers are awaited: no false 431, and a read that ends one request and begins
        # a pipelined next goes uncounted (the bound grows by at most one read, 256 KiB)
        if self._awaiting_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if (
            self._awaiting_headers
            and self._header_bytes > MAX_HEADER_BYTES
            and not self.transport.is_closing()  # not after its own 400 for a malformed request
        ):
            self.logger.warning("Request line and headers over %d bytes: 431.", MAX_HEADER_BYTES)
            self.transport.write(_TOO_LARGE_RESPONSE)
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._header_bytes = 0
        self._stop_waiting()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._awaiting_headers = True
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # unless a pipelined request was started; from here the deadline also bounds the rest
        # of a body answered before it ended (413). uvicorn's keep-alive timer (5 s) closes a
        # connection that sends nothing at all sooner
        if self.cycle.response_complete:
            self._start_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _start_waiting(self) -> None:
        self._stop_waiting()
        self._headers_due = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _stop_waiting(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _headers_late(self) -> None:
        self._headers_due = None
        if self.transport.is_closing():
            return
        if self._header_bytes > 0:  # part of a request came: say why it is dropped
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def header_deadline_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.run(http=...)`` with this server's header deadline."""
    return type("BoundedHttpTools", (BoundedHttpTools,), {"header_timeout_s": header_timeout_s})
