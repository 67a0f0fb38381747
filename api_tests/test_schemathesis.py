"""The OpenAPI schema tells the truth: Schemathesis fuzzes a real `icr serve` from its own
/openapi.json (every check: no 5xx, documented status codes and bodies, schema-valid requests
accepted, schema-invalid ones refused; stateful phase included). Settings: schemathesis.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_support import ROOT


def _requests(metrics: str, method: str, route: str, status: int) -> float:
    """How many ``method route`` requests got ``status``, by icr_http_requests_total."""
    prefix = f'icr_http_requests_total{{method="{method}",route="{route}",status="{status}"}} '
    return sum(float(line[len(prefix) :]) for line in metrics.splitlines() if line.startswith(prefix))


@pytest.mark.slow
@pytest.mark.parametrize("keys", [False, True], ids=["open", "with-keys"])
def test_schemathesis_finds_nothing(make_server, artifacts, tmp_path: Path, keys: bool) -> None:
    """With keys, Schemathesis sends the admin key and also checks that leaving it out is refused.
    The server has the synthetic dataset (conftest's server_env), so schema-valid submissions are
    accepted until the queue of 2 is full (then 429), and the stateful phase follows the 202's links
    to real jobs; few distractors, so the jobs it submits finish in seconds."""
    env = {"ICR_API_KEY": "reader", "ICR_ADMIN_KEY": "admin"} if keys else {}
    # a copy of the index: the labels it posts can be refitted, which replaces calibration.json
    index = tmp_path / "images"
    shutil.copytree(artifacts.images, index)
    server = make_server(
        index=index, ICR_MAX_QUEUED_JOBS="2", ICR_MAX_BENCHMARK_DISTRACTORS="100", **env
    ).start()
    st = Path(sys.executable).with_name("st")
    command = [
        str(st) if st.exists() else shutil.which("st") or "st",
        "run",
        f"{server.url}/openapi.json",
        "--seed",
        "1",
        "--generation-database",
        "none",
        "--no-color",
    ]
    if keys:
        command += ["--header", "X-API-Key: admin"]
    r = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    tail = r.stdout[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and "failures" not in tail.split("SUMMARY")[-1], tail
    headers = {"X-API-Key": "admin"} if keys else {}
    with httpx.Client(base_url=server.url, headers=headers, timeout=10) as c:
        # not vacuous: searches were answered (with keys: the header was sent and accepted), jobs were
        # accepted, refused when the queue was full, and read and cancelled by the ids the 202s gave
        metrics = c.get("/metrics").text
        for method, route, status in (
            ("POST", "/v1/search/text", 200),
            ("POST", "/v1/benchmarks", 202),
            ("POST", "/v1/benchmarks", 429),
            ("GET", "/v1/benchmarks/{job_id}", 200),
            ("DELETE", "/v1/benchmarks/{job_id}", 200),
            ("GET", "/v1/feedback/labels", 200),
            ("GET", "/v1/feedback/labels", 422),
        ):
            assert _requests(metrics, method, route, status) > 0, (method, route, status, tail)
        # whatever the fuzzer submitted, the runner drains the queue
        deadline = time.monotonic() + 120
        while True:
            jobs = c.get("/v1/benchmarks", params={"limit": 500}).json()["jobs"]
            if all(job["status"] not in ("queued", "running") for job in jobs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    # the submission refuses what cannot run (a 1k or 5k protocol on a split of 40 or 160 images is a
    # 422), so every job it accepted ends well or was cancelled, and no worker failed
    assert jobs and all(job["status"] in ("succeeded", "cancelled") for job in jobs), jobs
    server.stop()
    assert "Traceback" not in server.log_text()
