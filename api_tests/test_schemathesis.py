"""The OpenAPI schema tells the truth: Schemathesis fuzzes a real `icr serve` from its own
/openapi.json (every check: no 5xx, documented status codes and bodies, schema-valid requests
accepted, schema-invalid ones refused; stateful phase included). Settings: schemathesis.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_schemathesis_finds_nothing(make_server) -> None:
    server = make_server(ICR_MAX_QUEUED_JOBS="2").start()
    st = Path(sys.executable).with_name("st")
    command = [str(st) if st.exists() else shutil.which("st") or "st", "run", f"{server.url}/openapi.json",
               "--seed", "1", "--generation-database", "none", "--no-color"]
    r = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    tail = r.stdout[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and "failures" not in tail.split("SUMMARY")[-1], tail
    assert "Traceback" not in server.log_text()
