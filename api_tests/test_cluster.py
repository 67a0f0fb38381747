"""`icr serve --shards DIR --ray` on a real local Ray cluster (a head and one more node on this
machine): the session's index cut into 2 and 4 shards, each a Ray Serve application, behind the
coordinator's HTTP API. Its answers equal the single server's on the same index (hits, scores,
relevance, thresholds, filters, pages, image routes); a shard replica killed under load fails no
request (another replica answers, Serve starts a new one); a shard with no replica at all gives
partial answers that name it (passed_is_exact false), or 503 (ICR_SHARD_FAILURE=unavailable),
never a silent drop. (`icr serve --shards DIR` without Ray: api_tests/test_shards_in_process.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from server_support import Artifacts, Server, server_env

ray = pytest.importorskip("ray", reason="the cluster tests need the [distributed] extra (ray[serve])")
serve = pytest.importorskip("ray.serve")

QUERIES: list[dict[str, Any]] = [
    {"text": "a red circle", "k": 10},
    {"text": "two shapes", "k": 7, "offset": 3},
    {"text": "a blue square", "k": 20, "min_relevance": 0.2},
    {"text": "a small green triangle", "k": 20, "min_score": 0.1},
    {"text": "a red circle", "k": 10, "filter": {"is_distractor": True}, "min_relevance": 0.05},
]
REPLICAS = 2
FAILURE = {2: "partial", 4: "unavailable"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    local = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    local.add_node(num_cpus=1)  # a second node: replicas spread over both
    local.wait_for_nodes()
    ray.init(address=local.address, log_to_driver=False)  # this test drives it too (kills replicas)
    yield local
    ray.shutdown()
    local.shutdown()


@pytest.fixture(scope="module", params=[2, 4])
def sharded(request, cluster, artifacts: Artifacts, tmp_path_factory) -> Iterator[Server]:
    from icr.index.shard import shard_index

    folder = tmp_path_factory.mktemp(f"cluster{request.param}")
    shard_index(artifacts.images, folder / "shards", request.param)
    server = Server(
        [
            "--shards",
            str(folder / "shards"),
            "--ray",
            "--address",
            cluster.address,
            "--replicas",
            str(REPLICAS),
            "--caption-index",
            str(artifacts.captions),
        ],
        server_env(
            artifacts,
            folder / "jobs.sqlite",
            ICR_STATE_DIR=str(folder),
            ICR_SHARD_TIMEOUT_SECONDS="5",
            ICR_WATCH_SECONDS="0",
            # both policies for a shard with no replica: partial answers (2 shards), 503 (4 shards)
            ICR_SHARD_FAILURE=FAILURE[request.param],
        ),
        folder / "server.log",
    )
    server.shards = folder / "shards"  # type: ignore[attr-defined]
    server.state = folder  # type: ignore[attr-defined]
    server.failure = FAILURE[request.param]  # type: ignore[attr-defined]
    yield server.start(timeout=240)
    assert server.stop(timeout=90) == 0, server.log_text()  # removed its applications and exited


def _search(url: str, body: dict[str, Any], path: str = "/v1/search/text") -> dict[str, Any]:
    response = httpx.post(url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def _same(want: dict[str, Any], got: dict[str, Any]) -> None:
    for key in ("passed", "passed_is_exact", "searched", "matched", "calibration", "expected_relevant"):
        assert (
            got[key] == pytest.approx(want[key], abs=1e-6)
            if isinstance(want[key], float)
            else got[key] == want[key]
        )
    assert len(got["hits"]) == len(want["hits"])
    for w, g in zip(want["hits"], got["hits"], strict=True):
        assert g["score"] == pytest.approx(w["score"], abs=1e-6)
        assert g["id"] == w["id"] or g["score"] == pytest.approx(w["score"], abs=1e-7)  # a tie's order
        if w.get("relevance") is not None:
            assert g["relevance"] == pytest.approx(w["relevance"], abs=1e-6)
    assert got["quality"]["warnings"] == want["quality"]["warnings"]


def test_the_sharded_server_answers_as_the_single_one(server: Server, sharded: Server) -> None:
    for body in QUERIES:
        _same(_search(server.url, body), _search(sharded.url, body))
    hit = _search(server.url, {"text": "a red circle", "k": 1})["hits"][0]["id"]
    for path in (f"/v1/images/{hit}/metadata", f"/v1/images/{hit}?size=thumb"):
        want, got = httpx.get(server.url + path), httpx.get(sharded.url + path)
        assert got.status_code == want.status_code == 200 and got.content == want.content
    similar = {"image_id": hit, "k": 10, "filter": {"is_distractor": False}}
    _same(
        _search(server.url, similar, "/v1/search/similar"),
        _search(sharded.url, similar, "/v1/search/similar"),
    )
    missing = httpx.get(sharded.url + "/v1/images/999999/metadata")
    assert missing.status_code == 404
    info = httpx.get(sharded.url + "/v1/info").json()
    assert info["index"]["images"] == httpx.get(server.url + "/v1/info").json()["index"]["images"]


def _serve() -> Any:
    """Ray Serve's API for this driver, connected to the Serve running now (a server that stopped
    shut down the Serve it started, so a cached controller handle may be of a dead one)."""
    from ray.serve.context import _set_global_client

    _set_global_client(None)
    return serve


def _replicas(app: str) -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#")
    ]


def _running(app: str, replicas: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = _serve().status().applications.get(app)
        if status is not None and str(status.status).endswith("RUNNING"):
            counts = [d.replica_states.get("RUNNING", 0) for d in status.deployments.values()]
            if counts and min(counts) >= replicas:
                return
        time.sleep(0.5)
    raise AssertionError(f"{app} not back to {replicas} running replicas in {timeout} s: {_serve().status()}")


def test_a_replica_killed_under_load_fails_no_request(sharded: Server) -> None:
    replicas = _replicas("icr-shard-0")
    assert len(replicas) == REPLICAS
    answers: list[dict[str, Any]] = []
    failures: list[str] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=sharded.url, timeout=60) as client:
            while not stop.is_set():
                r = client.post("/v1/search/text", json={"text": "a red circle", "k": 5})
                (answers.append(r.json()) if r.status_code == 200 else failures.append(r.text))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join()
    assert not failures and len(answers) > 20
    assert all(
        a["passed_is_exact"] and not any("partial" in w for w in a["quality"]["warnings"]) for a in answers
    )
    _running("icr-shard-0", REPLICAS)  # Serve replaced the killed replica
    assert replicas[0] not in _replicas("icr-shard-0")


def _all_hits(url: str, text: str) -> list[int]:
    """Every hit of an unthresholded search, page by page."""
    first = _search(url, {"text": text, "k": 100})
    ids = [h["id"] for h in first["hits"]]
    while len(ids) < first["passed"]:
        ids += [h["id"] for h in _search(url, {"text": text, "k": 100, "offset": len(ids)})["hits"]]
    return ids


def test_a_shard_with_no_replica_is_named_in_a_partial_answer_or_a_503(sharded: Server) -> None:
    from icr.index.manifest import Manifest
    from icr.service.ray_serving import ShardDeployment, shard_app_name
    from icr.service.shard_replica import shard_state_dir

    folders = sorted(sharded.shards.glob("shard-*"), key=lambda p: int(p.name.split("-")[1]))  # type: ignore[attr-defined]
    down = folders[-1]
    lo, hi = Manifest.read(down / "manifest.json").extra["shard"]["ids"]
    everything = _all_hits(sharded.url, "a red circle")
    _serve().delete(shard_app_name(len(folders) - 1))  # no replica of the last shard anywhere
    try:
        if sharded.failure == "unavailable":  # type: ignore[attr-defined]
            refused = httpx.post(sharded.url + "/v1/search/text", json={"text": "a red circle"}, timeout=60)
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert refused.json()["error"] == "shards_unavailable" and down.name in refused.json()["message"]
        else:
            partial = _search(sharded.url, {"text": "a red circle", "k": 100})
            assert not partial["passed_is_exact"] and partial["passed"] == len(everything) - (hi - lo)
            assert any("partial results" in w and down.name in w for w in partial["quality"]["warnings"])
            others = [i for i in everything if not lo <= i < hi]  # the answering shards' images, in order
            assert [h["id"] for h in partial["hits"]] == others[:100]
    finally:
        _serve().run(
            ShardDeployment.options(num_replicas=REPLICAS).bind(
                str(down.resolve()),
                "off",
                1,
                64,
                False,
                str(shard_state_dir(sharded.state, down.resolve())),  # type: ignore[attr-defined]
            ),
            name=shard_app_name(len(folders) - 1),
            route_prefix=None,
        )
    assert _all_hits(sharded.url, "a red circle") == everything  # whole again


def test_writes_reach_the_owning_shard_and_every_replica_of_it(sharded: Server) -> None:
    """An image added through the coordinator (to the last shard) and a built image of the first
    shard deleted: every later search, whichever replica of each shard answers it, says so."""
    info = httpx.get(sharded.url + "/v1/info").json()["index"]
    n, before = info["ntotal"], info["images"]
    vector = np.random.default_rng(1).standard_normal(info["dim"])
    vector = (vector / np.linalg.norm(vector)).tolist()
    added = httpx.post(sharded.url + "/v1/images", json={"images": [{"vector": vector}]}, timeout=60)
    assert added.status_code == 200 and added.json()["images"] == before + 1, added.text
    new = added.json()["written"][0]["id"]
    assert new >= n  # past the whole index's ids: the last shard's
    first = _search(sharded.url, {"text": "a red circle", "k": 100})["hits"]
    victim = min(h["id"] for h in first)  # a built image, the first shard's when it holds a hit
    gone = httpx.delete(sharded.url + f"/v1/images/{victim}", timeout=60)
    assert gone.status_code == 200 and gone.json()["deleted"] == [victim], gone.text
    for _ in range(8):  # searches spread over both replicas of every shard
        top = _search(sharded.url, {"vector": vector, "k": 1}, "/v1/search/vector")["hits"][0]
        assert top["id"] == new and top["score"] == pytest.approx(1.0, abs=1e-5)
        assert victim not in [
            h["id"] for h in _search(sharded.url, {"text": "a red circle", "k": 100})["hits"]
        ]
    assert httpx.get(sharded.url + f"/v1/images/{victim}/metadata").status_code == 404
    assert httpx.get(sharded.url + f"/v1/images/{new}/metadata").status_code == 200
    assert httpx.get(sharded.url + "/v1/info").json()["index"]["images"] == before
