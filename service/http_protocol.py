"""The HTTP/1.1 protocol `icr serve` runs: uvicorn's httptools protocol with a bound on header size,
a deadline for headers and a bound on each client's connections.

What uvicorn bounds, and what it does not (uvicorn 0.54, measured with raw sockets):

* header *size*: only its h11 implementation (``h11_max_incomplete_event_size``). Its httptools
  protocol (httptools is a dependency of this package) buffers headers without limit: 50 MB of
  header lines grew a server by 56 MB and got no answer. h11 costs more per request (0.1-0.35 ms
  of a search's 3 ms on 2 busy cores), so :func:`bounded_protocol` keeps httptools and
  counts the header bytes itself (431 beyond :data:`MAX_HEADER_BYTES`).
* header *time*: nothing. Its keep-alive timer runs only between requests and stops at a
  connection's first byte, so a client that trickles a header line (or never finishes the blank
  line) holds its connection for ever. The protocol here adds that deadline.
* connections: ``limit_concurrency`` (ICR_MAX_CONNECTIONS) answers 503 to requests beyond it, so
  many idle or slow connections cost bounded memory; but it counts every client's connections
  together, so one client holding them all (idle, or trickling within the deadlines) crowds every
  other client out. Nothing in uvicorn counts per client, so the protocol here does: a connection
  from a peer address that already holds ICR_MAX_CONNECTIONS_PER_CLIENT is answered 429 and closed
  before any of it is parsed or reaches the app. The peer is the TCP peer: behind a reverse proxy
  that is the proxy, so there the bound must cover the proxy's upstream connections (or be 0, off)
  and the proxy bounds each client.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEADER_BYTES = 16 << 10  # request line and headers: 431 beyond
KEEP_ALIVE_SECONDS = 5  # an idle kept-alive connection is closed after this (uvicorn's default)
# A refused connection is read (and discarded) this long at most before it is closed: a staged
# close (RFC 9112 section 9.6), as closing a socket with a client's request unread sends a reset,
# which can discard the refusal before the client reads it. A client that reads it and closes ends
# it sooner.
REFUSED_LINGER_SECONDS = 2.0


def _response(status: bytes, text: bytes, extra_headers: bytes = b"") -> bytes:
    head = b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n" % status
    return head + extra_headers + b"content-length: %d\r\n\r\n" % len(text) + text


def _too_many_connections_response(host: str, bound: int) -> bytes:
    # 429, not 503: the server is up and serving other clients, and this client can fix it (use the
    # connections it holds, or close some). A 5xx would read as the server failing: load balancers
    # eject a backend for them (passive health checks, nginx's proxy_next_upstream, outlier
    # detection), so one greedy client could take a healthy server out of a pool, and error-rate
    # alerts would fire for what is one client's behaviour. Retrying clients honour Retry-After on
    # 429 as on 503 (urllib3's Retry does for both). Its value: by then the client's idle kept-alive
    # connections have been closed (KEEP_ALIVE_SECONDS).
    text = (
        f"this client ({host}) already holds {bound} open connections, the most one client may "
        f"(ICR_MAX_CONNECTIONS_PER_CLIENT); reuse or close them, or retry after {KEEP_ALIVE_SECONDS} s"
    )
    return _response(b"429 Too Many Requests", text.encode(), b"retry-after: %d\r\n" % KEEP_ALIVE_SECONDS)


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
    did, as an idle keep-alive connection is), answering 431 once the request line and headers
    pass MAX_HEADER_BYTES, and answering 429 to a connection from a peer address that already
    holds ``max_connections_per_client`` (0: no bound)."""

    header_timeout_s = 10.0  # set per server by bounded_protocol
    max_connections_per_client = 0  # set per server by bounded_protocol
    # Open connections by peer address, shared by one server's connections (each server gets a
    # subclass, and so a dict, of its own). Only the event loop's thread touches it: no lock. An
    # address is dropped at zero, so the dict holds no more entries than there are connections.
    open_by_client: ClassVar[dict[str, int]] = {}
    _warned_clients: ClassVar[set[str]] = set()  # refused since they last dropped below the bound
    _counted_as: str | None = None  # the address this connection is counted under, until released
    _refused = False
    _linger: asyncio.TimerHandle | None = None  # closes a refused connection
    _awaiting_headers = True  # the next bytes belong to a request line or headers
    _header_bytes = 0  # received while awaiting headers
    _header_tail = b""  # the last bytes counted: the blank line may be split across reads
    _headers_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # no peer address (a peer that reset before this ran, a unix socket): nothing to count under
        host = self.client[0] if self.client else None
        if self.max_connections_per_client and host is not None:
            held = self.open_by_client.get(host, 0)
            if held >= self.max_connections_per_client:
                self._refuse(host)
                return
            # counted last, so that nothing raising above leaves a count behind; connection_lost
            # (or a WebSocket hand-over) gives it back
            self.open_by_client[host] = held + 1
            self._counted_as = host
        self._start_waiting()

    def data_received(self, data: bytes) -> None:
        if self._refused:  # read only so that closing sends no reset over the refusal
            return
        # Counted before httptools sees the bytes, up to the blank line that ends the headers: a read
        # that holds a whole request with 200 KB of headers was let through when whole reads were
        # counted after parsing (httptools reports no offsets, so the end is found here). A read that
        # ends one request and begins a pipelined next counts only the first one's headers.
        if self._awaiting_headers:
            seen = self._header_tail + data
            end = seen.find(b"\r\n\r\n")
            self._header_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._header_tail))
            self._header_tail = seen[-3:]
            if self._header_bytes > MAX_HEADER_BYTES:
                if not self.transport.is_closing():
                    self.logger.warning("Request line and headers over %d bytes: 431.", MAX_HEADER_BYTES)
                    self.transport.write(_TOO_LARGE_RESPONSE)
                    self.transport.close()
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._header_bytes = 0
        self._header_tail = b""
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

    def handle_websocket_upgrade(self) -> None:
        # the connection is handed to uvicorn's WebSocket protocol, whose connection_lost is the
        # one called at its end: give the count back here, or it would never be
        self._release()
        super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()  # first: whatever uvicorn's own clean-up does, the count is given back
        self._stop_waiting()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def _refuse(self, host: str) -> None:
        """Answer 429 without parsing anything, then close once the client has read it and closed
        (its end of file closes the transport: uvicorn's eof_received keeps nothing open) or after
        REFUSED_LINGER_SECONDS."""
        self._refused = True
        # out of uvicorn's own count too, so refused connections cannot crowd ICR_MAX_CONNECTIONS
        self.connections.discard(self)
        if host not in self._warned_clients:  # once per episode, so a client hammering cannot flood the log
            self._warned_clients.add(host)
            self.logger.warning(
                "%s holds %d connections (ICR_MAX_CONNECTIONS_PER_CLIENT): refusing more with 429.",
                host,
                self.max_connections_per_client,
            )
        self.transport.write(_too_many_connections_response(host, self.max_connections_per_client))
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client sees the end of the answer at once
        self._linger = self.loop.call_later(REFUSED_LINGER_SECONDS, self.transport.close)

    def _release(self) -> None:
        host, self._counted_as = self._counted_as, None  # at most once per connection
        if host is None:
            return
        held = self.open_by_client.get(host, 0) - 1
        if held > 0:
            self.open_by_client[host] = held
        else:
            self.open_by_client.pop(host, None)
        if held < self.max_connections_per_client:
            self._warned_clients.discard(host)

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


def bounded_protocol(header_timeout_s: float, max_connections_per_client: int = 0) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.run(http=...)`` with this server's header deadline and
    per-client connection bound (0: none), and a connection count of its own."""
    return type(
        "BoundedHttpTools",
        (BoundedHttpTools,),
        {
            "header_timeout_s": header_timeout_s,
            "max_connections_per_client": max_connections_per_client,
            "open_by_client": {},
            "_warned_clients": set(),
        },
    )
