"""Clients that send slowly, never finish, or hold connections open get bounded answers (raw sockets
against a real server; service/http_protocol.py and service/body_limit.py say what bounds what)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

HEADERS = b"POST /v1/search/text HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def slow_server(make_server):
    return make_server(
        ICR_HEADER_TIMEOUT_SECONDS="2", ICR_BODY_TIMEOUT_SECONDS="3", ICR_MAX_CONNECTIONS="8"
    ).start()


def _trickle(s: socket.socket, byte: bytes, every_s: float, give_up_s: float) -> tuple[bytes, float]:
    """Send ``byte`` every ``every_s`` until the server answers (or closes); the answer and how
    long after the first byte it came (``give_up_s`` when it never did)."""
    t0 = time.monotonic()
    answer = b""
    s.settimeout(every_s)
    while time.monotonic() - t0 < give_up_s:
        try:
            s.sendall(byte)
        except OSError:  # closed by the server after its answer
            pass
        try:
            chunk = s.recv(4096)
        except TimeoutError:
            continue
        if not chunk:
            break
        answer += chunk
        head, blank, body = answer.partition(b"\r\n\r\n")
        if blank and len(body) >= _content_length(head):
            break
    return answer, time.monotonic() - t0


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_a_body_sent_a_byte_every_two_seconds_gets_408_at_one_deadline(slow_server) -> None:
    """ICR_BODY_TIMEOUT_SECONDS=3 bounds the whole body: a byte every 2 s (each within 3 s of the
    last, which a per-read timeout let hold a worker for ever) gets 408 about 3 s after the headers."""
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=15) as s:
        s.sendall(HEADERS + b"Content-Length: 100\r\n\r\n")
        answer, waited = _trickle(s, b" ", every_s=2.0, give_up_s=15)
    print(f"\n408 after {waited:.1f} s")  # noqa: T201 (the measured time, shown with -s)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"did not arrive within 3 s" in answer and b"ICR_BODY_TIMEOUT_SECONDS" in answer
    assert 2.5 < waited < 6


def test_headers_that_never_finish_are_dropped_at_the_header_deadline(slow_server) -> None:
    """ICR_HEADER_TIMEOUT_SECONDS=2: a header line trickled a byte every 0.5 s (uvicorn alone holds
    it for ever) gets 408 and a closed connection about 2 s after connecting; a connection that
    sends nothing is closed silently."""
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=15) as s:
        s.sendall(HEADERS + b"X-Slow: ")
        answer, waited = _trickle(s, b"a", every_s=0.5, give_up_s=12)
    print(f"\nheaders dropped after {waited:.1f} s")  # noqa: T201 (shown with -s)
    assert answer.startswith(b"HTTP/1.1 408") and b"ICR_HEADER_TIMEOUT_SECONDS" in answer, answer
    assert waited < 5
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=15) as s:
        t0 = time.monotonic()
        assert s.recv(4096) == b""  # closed, no answer to a request never begun
        assert time.monotonic() - t0 < 5


def test_headers_that_grow_without_end_get_431(slow_server) -> None:
    """Past 16 KiB of request line and headers the server answers 431 and closes, instead of
    buffering them (uvicorn's httptools protocol alone took 50 MB of header lines unanswered)."""
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=10) as s:
        # 20 KiB and no end of the headers, then nothing more: the server reads it all before it
        # answers, so its close is not a reset that would discard the answer
        s.sendall(HEADERS + b"X-Big: " + b"a" * (20 << 10))
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431"), answer


def test_connections_beyond_the_limit_get_503(slow_server) -> None:
    """ICR_MAX_CONNECTIONS=8: with eight connections open and idle, a request gets 503 at once
    (memory stays bounded); once they are gone it is served."""
    idle = [socket.create_connection(("127.0.0.1", slow_server.port), timeout=15) for _ in range(8)]
    try:
        time.sleep(0.2)  # accepted
        r = httpx.get(slow_server.url + "/healthz", timeout=10)
        assert r.status_code == 503, r.text
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(slow_server.url + "/healthz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _answer(s: socket.socket) -> bytes:
    """Everything the server sends until it closes."""
    answer = b""
    while chunk := s.recv(4096):
        answer += chunk
    return answer


def _served(port: int) -> bool:
    """Whether a new connection gets /healthz answered 200 (not the per-client 429)."""
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        return c.get("/healthz").status_code == 200


def _until(condition, within_s: float = 5.0) -> float:
    """Poll ``condition`` (a connection's end reaches the server's event loop a moment after the
    client closes); how long it took."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < within_s, "the server did not give the connection back"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_one_client_beyond_its_connection_bound_gets_429_and_its_count_is_given_back(make_server) -> None:
    """ICR_MAX_CONNECTIONS_PER_CLIENT=3: with three idle connections open, a fourth from the same
    address gets 429 with Retry-After at once, naming the setting, without reaching the app (the
    global limit is far off); refused connections hold nothing, and closing any one of the three,
    however it ends, lets the next in."""
    server = make_server(ICR_MAX_CONNECTIONS_PER_CLIENT="3")
    server.start()
    port = server.port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    try:
        _until(lambda: not _served(port))  # all three counted (accepted on the server's loop)
        # a client that sends nothing is told at once; clients that send a request first (httpx,
        # below) read the same answer though the server never parses it
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            answer = _answer(s)
        head, _, text = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429 Too Many Requests"), answer
        assert b"\r\nretry-after: 5\r\n" in head.lower() and b"connection: close" in head.lower()
        assert b"ICR_MAX_CONNECTIONS_PER_CLIENT" in text and b"127.0.0.1" in text
        for _ in range(20):  # refusals count nothing: else the three below could not get in
            r = httpx.get(server.url + "/v1/info", timeout=10)
            assert r.status_code == 429 and r.headers["retry-after"] == "5", r.text
        idle.pop().close()  # a client's own close gives its slot back
        waited = _until(lambda: _served(port))
        print(f"\nslot given back after {waited:.2f} s")  # noqa: T201 (shown with -s)
        # connections the server ends give theirs back too: a 431 (the server closes), a
        # WebSocket upgrade (handed to another protocol, so not this one's connection_lost)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(HEADERS + b"X-Big: " + b"a" * (20 << 10))
            assert _answer(s).startswith(b"HTTP/1.1 431")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
            )
            assert _answer(s).startswith(b"HTTP/1.1 403")  # handed over, and refused: no such route
    finally:
        for s in idle:
            s.close()
    # every count back to zero: three connections held at once are served, a fourth is refused
    _until(lambda: _served(port))
    clients = [httpx.Client(base_url=server.url, timeout=10) for _ in range(3)]
    try:
        assert [c.get("/healthz").status_code for c in clients] == [200] * 3  # each keeps its connection
        assert httpx.get(server.url + "/healthz", timeout=10).status_code == 429
    finally:
        for c in clients:
            c.close()
    _until(lambda: _served(port))
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'route="/v1/info"' not in metrics  # the 20 refused requests for it never reached the app
    assert "Traceback" not in server.log_text()
