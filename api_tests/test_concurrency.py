"""Concurrent clients: 8 threads x 200 queries, no errors, the same hits and scores bit for bit as
one client alone; latency percentiles reported."""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

CLIENTS = 8
QUERIES_PER_CLIENT = 200
WORDS = ["red", "blue", "green", "yellow", "purple", "orange", "pink", "cyan"]
SHAPES = ["circle", "square", "triangle", "diamond", "star", "cross", "hexagon"]


@pytest.mark.slow
def test_concurrent_clients_get_consistent_answers(server, client: httpx.Client, record_property) -> None:
    texts = [f"a {c} {s}" for c in WORDS for s in SHAPES]

    def answer(response: httpx.Response) -> list[tuple[int, float, float | None]]:
        return [(h["id"], h["score"], h["relevance"]) for h in response.json()["hits"]]

    # Bit for bit: a score that moved by float noise could cross a threshold.
    expected = {t: answer(client.post("/v1/search/text", json={"text": t, "k": 5})) for t in texts}
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def run(worker: int) -> None:
        mine, bad = [], []
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(QUERIES_PER_CLIENT):
                text = texts[(worker * 31 + i) % len(texts)]
                params = {"text": text, "k": 5}
                if i % 3 == 1:
                    params["min_relevance"] = 0.1
                t0 = time.perf_counter()
                r = c.post("/v1/search/text", json=params)
                mine.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    bad.append(f"{r.status_code} {r.text[:200]}")
                elif "min_relevance" not in params:
                    if answer(r) != expected[text]:
                        bad.append(f"{text!r} under load: {answer(r)} != {expected[text]}")
        with lock:
            latencies.extend(mine)
            failures.extend(bad)

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(w,)) for w in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    assert not failures, failures[:5]
    assert len(latencies) == CLIENTS * QUERIES_PER_CLIENT
    q = statistics.quantiles(latencies, n=100)
    report = {
        "clients": CLIENTS,
        "queries": len(latencies),
        "qps": round(len(latencies) / wall, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
    }
    record_property("concurrency", json.dumps(report))
    print(f"\nconcurrency: {report}")  # noqa: T201 (the measured figures, shown with -s)
