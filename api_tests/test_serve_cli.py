"""`icr serve` refuses artifacts that do not belong together, with one message saying what rebuilds what."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import httpx
import pytest
from server_support import ICR, ROOT


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ICR), "serve", *args, "--port", "9"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_a_checkpoint_from_other_weights_is_refused_with_the_rebuild_command(artifacts, tmp_path) -> None:
    other = tmp_path / "other"
    shutil.copytree(artifacts.checkpoint, other)
    config = (other / "config.json").read_text()
    sha = config.split('"weights_sha256": "')[1][:64]
    (other / "config.json").write_text(config.replace(sha, "0" * 64))
    r = _serve("--index", str(artifacts.images), "--checkpoint", str(other))
    assert r.returncode != 0
    assert "cannot serve these artifacts together" in r.stderr and "icr index build" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_or_wrong_kind_of_index_is_refused(artifacts, tmp_path) -> None:
    r = _serve("--index", str(tmp_path / "nothing"))
    assert r.returncode != 0 and "manifest" in r.stderr and "Traceback" not in r.stderr
    r = _serve("--index", str(artifacts.captions))
    assert r.returncode != 0 and "--caption-index" in r.stderr
    r = _serve()
    assert r.returncode != 0 and "index" in r.stderr and "ICR_" in r.stderr


def test_a_bad_jobs_database_is_one_line_and_exit_status_2(artifacts, tmp_path) -> None:
    not_sqlite = tmp_path / "jobs.sqlite"
    not_sqlite.write_text("these are not the jobs you are looking for\n" * 100)
    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    for path, says in ((not_sqlite, "not a job database"), (blocked / "jobs.sqlite", "writable folder")):
        r = subprocess.run(
            [str(ICR), "serve", "--index", str(artifacts.images), "--port", "9"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
            env={**os.environ, "ICR_JOBS_DB": str(path)},
        )
        assert r.returncode == 2, r.stderr
        assert says in r.stderr and "ICR_JOBS_DB" in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"ICR_MAX_K": "abc"},
            "error: invalid settings: ICR_MAX_K: Input should be a valid integer, unable to parse string "
            "as an integer (got 'abc') (set in the environment, the --config file or the matching option "
            "of `icr serve --help`)",
        ),
        (
            {"ICR_MAX_K": "5000"},
            "error: invalid settings: ICR_MAX_K: Input should be less than or equal to 1000",
        ),
        (
            {"ICR_DATASETS": "notjson"},
            "error: invalid settings: ICR_DATASETS: not valid JSON (Expecting value: line 1 column 1 "
            """(char 0)); e.g. ICR_DATASETS='{"coco": "/data/coco"}'""",
        ),
        (
            {"ICR_CORS_ORIGINS": "https://app.example"},
            "error: invalid settings: ICR_CORS_ORIGINS: not valid JSON",
        ),
        (
            {"ICR_MAX_CONCURRENT_DECODES": "0"},
            "error: invalid settings: ICR_MAX_CONCURRENT_DECODES: Input should",
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_variable(tmp_path, env: dict[str, str], line: str) -> None:
    r = subprocess.run(
        [str(ICR), "serve", "--port", "9"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "ICR_INDEX": str(tmp_path), **env},
    )
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(line), r.stderr


def test_a_failed_load_is_reported_by_readyz_and_retried(artifacts, make_server, tmp_path) -> None:
    """A truncated index.faiss (a copy being replaced): /readyz says why and when it retries; once
    the file is whole again the server comes up without a restart."""
    index = tmp_path / "images"
    shutil.copytree(artifacts.images, index)
    whole = (index / "index.faiss").read_bytes()
    (index / "index.faiss").write_bytes(whole[: len(whole) // 3])
    server = make_server(index=index, ICR_LOAD_RETRY_SECONDS="0.3")
    # started by hand: Server.start() waits for a readiness that cannot come yet
    with open(server.log, "ab") as out:
        server.process = subprocess.Popen(
            server.args, stdout=out, stderr=subprocess.STDOUT, env=server.env, cwd=ROOT
        )
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any("attempt 2" in m for m in seen):
        try:
            r = httpx.get(server.url + "/readyz", timeout=2)
            assert r.status_code == 503, r.text
            seen.append(r.json()["message"])
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    failed = [m for m in seen if "failed to load" in m]
    assert failed and "retrying in" in failed[-1] and "attempt 2" in failed[-1], seen
    (index / "index.faiss").write_bytes(whole)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/readyz", timeout=2).status_code == 200:
            break
        time.sleep(0.2)
    r = httpx.post(server.url + "/v1/search/text", json={"text": "a red circle", "k": 2}, timeout=30)
    assert r.status_code == 200 and len(r.json()["hits"]) == 2
    server.stop()
    assert server.log_text().count("Traceback") == 1  # the first failure only; later ones one line each
