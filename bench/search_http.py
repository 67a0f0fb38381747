"""Search through HTTP: a real ``icr serve`` process, clients on keep-alive connections.

For each index (the ANN one the build chose, and the exact Flat twin) and each client count
(1, 4, 16): every client sends ``POST /v1/search/text`` (k 10, the service's default depth and a
score threshold) back to back for a fixed number of requests; reported are per-request p50/p99
and the aggregate queries per second. Clients and server share this machine's cores, as they
would on a one-box deployment; the client side is a thread per client doing only socket I/O and
JSON. The server's ``/v1/info`` tells how many FAISS calls answered the queries, so the report
shows how far concurrent exact searches were micro-batched.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.stats import latency

CLIENTS = (1, 4, 16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``icr serve`` on a free port, started and stopped around a ``with`` block."""

    def __init__(
        self,
        index: Path,
        checkpoint: Path,
        log_path: Path,
        env: dict[str, str] | None = None,
        serve_args: list[str] | None = None,
    ):
        """``serve_args``: what to serve instead of ``--index index`` (e.g. ``--shards DIR --ray``)."""
        self.port = _free_port()
        self.env = env or {}
        self.args = [
            sys.executable,
            "-m",
            "icr.cli",
            "serve",
            *(serve_args or ["--index", str(index)]),
            "--checkpoint",
            str(checkpoint),
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        env = {**os.environ, "ICR_JOBS_DB": str(self.log_path.with_suffix(".jobs.sqlite")), **self.env}
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        ready = 0  # in a row: each check is a new connection, so with workers any of them answers
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"icr serve exited with {self.process.returncode}; see {self.log_path}")
            try:
                ready = ready + 1 if self.get("/readyz")[0] == 200 else 0
                if ready == 10:
                    return self
            except (OSError, ValueError):  # not listening yet, or a proxy's plain-text 404 meanwhile
                ready = 0
            time.sleep(0.05 if ready else 0.2)
        raise TimeoutError(f"icr serve not ready after 300 s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()

    def get(self, path: str) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            conn.close()


def _client(
    port: int, texts: list[str], out: list[float], errors: list[str], start: threading.Barrier
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json"}
    start.wait()
    for text in texts:
        body = json.dumps({"text": text, "k": 10, "min_score": 0.5})
        t0 = time.perf_counter()
        conn.request("POST", "/v1/search/text", body=body, headers=headers)
        response = conn.getresponse()
        payload = response.read()
        out.append(time.perf_counter() - t0)
        if response.status != 200:
            errors.append(f"{response.status}: {payload[:200]!r}")
    conn.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its children (workers; Linux /proc; 0.0
    where it cannot be read)."""
    total = 0.0
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    for p in [pid, *map(int, children)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def load(server: Server, captions: list[str], clients: int, per_client: int) -> dict[str, Any]:
    """``clients`` concurrent clients, ``per_client`` requests each: latency and throughput."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors: list[str] = []
    start = threading.Barrier(clients + 1)
    threads = [
        threading.Thread(
            target=_client,
            args=(
                server.port,
                [captions[(c * 7919 + i) % len(captions)] for i in range(per_client)],
                latencies[c],
                errors,
                start,
            ),
        )
        for c in range(clients)
    ]
    _, before = server.get("/v1/info")
    assert server.process is not None
    for t in threads:
        t.start()
    start.wait()
    t0, cpu0 = time.perf_counter(), cpu_seconds(server.process.pid)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(server.process.pid) - cpu0
    _, after = server.get("/v1/info")
    # a sharded server's shards batch in their replicas (no count here); with workers, /v1/info is
    # one worker's
    counts = [x["micro_batch"]["searches"].get("image", {"calls": 0, "queries": 0}) for x in (before, after)]
    calls = {key: counts[1][key] - counts[0][key] for key in ("calls", "queries")}
    done = sum(len(x) for x in latencies)
    return {
        "clients": clients,
        "requests": done,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "queries_per_s": done / wall,
        # the server process's (and its workers') CPU: cores busy, and CPU per query (a Ray
        # server's work is in Ray's processes, not counted)
        "server_cores": cpu / wall,
        "server_cpu_ms_per_query": cpu / done * 1000 if done else None,
        "latency": latency([s for x in latencies for s in x]),
        "faiss_calls": calls["calls"],
        "mean_batch": calls["queries"] / calls["calls"] if calls["calls"] else None,
    }


def run(
    checkpoint: Path,
    indices: dict[str, Path],
    captions: list[str],
    requests: dict[str, int],
    workdir: Path,
    log,
) -> dict[str, Any]:
    """For each named index: single-client warm-up, then 1/4/16 clients.

    ``requests[name]`` is the number of requests per client (exact search is slower)."""
    out: dict[str, Any] = {}
    for name, index in indices.items():
        log(f"http: {name} index {index}")
        with Server(index, checkpoint, workdir / f"serve-{name}.log") as server:
            load(server, captions, 1, 10)  # warm-up: first requests pay lazy initialisation
            out[name] = {str(c): load(server, captions, c, requests[name]) for c in CLIENTS}
    return out
