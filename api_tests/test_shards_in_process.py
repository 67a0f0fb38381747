"""`icr serve --shards DIR` without Ray: the shards searched in the server's own process answer as
the single index; writes go to the owning shard and survive a restart; the command refuses what it
cannot serve with one line naming the fix."""

from __future__ import annotations

import subprocess

import httpx
import numpy as np
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


def test_writes_reach_the_owning_shard_and_survive_a_restart(artifacts: Artifacts, tmp_path) -> None:
    """An image added by embedding and one uploaded (the last shard's), a built image of the first
    shard deleted by id and the distractors of every shard by filter: searches, image routes and
    counts say so at once, and again after the server restarts on the same state directory."""
    from icr.index.shard import shard_index

    shard_index(artifacts.images, tmp_path / "shards", 3)
    env = server_env(artifacts, tmp_path / "jobs.sqlite", ICR_STATE_DIR=str(tmp_path / "state"))

    def start() -> Server:
        return Server(["--shards", str(tmp_path / "shards")], env, tmp_path / "server.log").start()

    sharded = start()
    try:
        info = httpx.get(sharded.url + "/v1/info").json()["index"]
        n, dim, before = info["ntotal"], info["dim"], info["images"]
        vector = np.random.default_rng(0).standard_normal(dim)
        vector = (vector / np.linalg.norm(vector)).tolist()
        added = httpx.post(sharded.url + "/v1/images", json={"images": [{"vector": vector}]}, timeout=60)
        assert added.status_code == 200, added.text
        assert added.json()["written"][0]["id"] == n and added.json()["images"] == before + 1
        photo = sorted(artifacts.data.rglob("synth_test_*.png"))[0]
        uploaded = httpx.post(
            sharded.url + "/v1/images:upload", files={"file": ("p.png", photo.read_bytes(), "image/png")}
        )
        assert uploaded.status_code == 200 and uploaded.json()["written"][0]["id"] == n + 1, uploaded.text
        assert httpx.get(sharded.url + f"/v1/images/{n + 1}").status_code == 200  # its pixels, kept
        gone = httpx.delete(sharded.url + "/v1/images/0")
        assert gone.status_code == 200 and gone.json()["deleted"] == [0]
        by_filter = httpx.post(sharded.url + "/v1/images:delete", json={"filter": {"is_distractor": True}})
        distractors = by_filter.json()["deleted"]
        assert by_filter.status_code == 200 and len(distractors) == info["distractor_count"]
        after = by_filter.json()["images"]
        assert after == before + 2 - 1 - len(distractors)

        def check(url: str) -> None:
            top = httpx.post(url + "/v1/search/vector", json={"vector": vector, "k": 1}, timeout=60).json()
            assert top["hits"][0]["id"] == n
            hits = httpx.post(url + "/v1/search/text", json={"text": "a red circle", "k": 100}).json()
            ids = {h["id"] for h in hits["hits"]}
            assert hits["passed"] == after and 0 not in ids and not ids & set(distractors)
            assert httpx.get(url + "/v1/images/0/metadata").status_code == 404
            assert httpx.get(url + "/v1/info").json()["index"]["images"] == after

        check(sharded.url)
    finally:
        assert sharded.stop() in (0, -15)
    again = start()
    try:
        check(again.url)  # nothing acknowledged was lost
    finally:
        assert again.stop() in (0, -15)


def test_what_it_cannot_serve_is_refused_with_the_fix(artifacts: Artifacts, tmp_path) -> None:
    from icr.index.shard import shard_index

    shards = tmp_path / "shards"
    shard_index(artifacts.images, shards, 2)
    for args, message in (
        (["--shards", str(artifacts.images)], "no shard-<s>-of-<S> folders in it"),
        (["--shards", str(tmp_path), "--index", str(artifacts.images)], "not both"),
        (["--index", str(artifacts.images), "--ray"], "--ray serves shards: give --shards DIR"),
        (["--shards", str(shards), "--ray", "--workers", "2"], "scales with --ray --replicas"),
    ):
        done = subprocess.run([str(ICR), "serve", *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr
