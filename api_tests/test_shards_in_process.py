"""`icr serve --shards DIR` without Ray: the shards searched in the server's own process answer as
the single index; the command refuses what it cannot serve with one line naming the fix."""

from __future__ import annotations

import subprocess

import httpx
from server_support import ICR, Artifacts, Server, server_env

QUERIES = [
    {"text": "a red circle", "k": 10, "min_relevance": 0.05},
    {"text": "two shapes", "k": 5, "offset": 4, "filter": {"is_distractor": True}},
]


def test_shards_in_one_process_answer_as_the_single_index(
    server: Server, artifacts: Artifacts, tmp_path
) -> None:
    from icr.index.shard import shard_index

    shard_index(artifacts.images, tmp_path / "shards", 3)
    sharded = Server(
        ["--shards", str(tmp_path / "shards")],
        server_env(artifacts, tmp_path / "jobs.sqlite", ICR_STATE_DIR=str(tmp_path)),
        tmp_path / "server.log",
    ).start()
    try:
        for body in QUERIES:
            want = httpx.post(server.url + "/v1/search/text", json=body, timeout=60).json()
            got = httpx.post(sharded.url + "/v1/search/text", json=body, timeout=60).json()
            assert [h["id"] for h in got["hits"]] == [h["id"] for h in want["hits"]]
            for key in ("passed", "passed_is_exact", "matched", "expected_relevant"):
                assert got[key] == want[key], key
    finally:
        assert sharded.stop() in (0, -15)  # uvicorn exits by the SIGTERM it handled, not a SIGKILL


def test_what_it_cannot_serve_is_refused_with_the_fix(artifacts: Artifacts, tmp_path) -> None:
    for args, message in (
        (["--shards", str(tmp_path)], "no shard-<s>-of-<S> folders in it"),
        (["--shards", str(tmp_path), "--index", str(artifacts.images)], "not both"),
        (["--index", str(artifacts.images), "--ray"], "--ray serves shards: give --shards DIR"),
    ):
        done = subprocess.run([str(ICR), "serve", *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr
