"""The OpenAPI schema tells the truth: Schemathesis fuzzes a real `icr serve` from its own
/openapi.json (every check: no 5xx, documented status codes and bodies, schema-valid requests
accepted, schema-invalid ones refused; stateful phase included). Settings: schemathesis.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_support import ROOT


@pytest.mark.slow
@pytest.mark.parametrize("keys", [False, True], ids=["open", "with-keys"])
def test_schemathesis_finds_nothing(make_server, keys: bool) -> None:
    """With keys, Schemathesis sends the admin key and also checks that leaving it out is refused."""
    env = {"ICR_API_KEY": "reader", "ICR_ADMIN_KEY": "admin"} if keys else {}
    server = make_server(ICR_MAX_QUEUED_JOBS="2", **env).start()
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
    assert "Traceback" not in server.log_text()
    # not vacuous: searches were answered (with keys: the header was sent and accepted)
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    answered = [
        line
        for line in metrics.splitlines()
        if line.startswith("icr_http_requests_total{")
        and '"/v1/search/text"' in line
        and 'status="200"' in line
    ]
    assert answered and float(answered[0].split()[-1]) > 0, answered
