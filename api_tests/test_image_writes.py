"""A living index against real `icr serve` processes: images added (by embedding and by upload),
patched, replaced by external id and deleted are searched, filtered, counted and served at once,
survive a restart, and reach a second server on the same state directory; bad writes are 4xx
naming the fix and change nothing."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import time
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from server_support import ICR, Artifacts

from icr.index.build import build_photo_index

N_PHOTOS = 24
_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def photos(artifacts: Artifacts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A photo index with fields album (text) and year (integers)."""
    root = tmp_path_factory.mktemp("living")
    folder = root / "my-photos"
    folder.mkdir()
    rows = []
    for i, source in enumerate(sorted(artifacts.data.rglob("synth_test_*.png"))[:N_PHOTOS]):
        shutil.copy(source, folder / f"{i:02d}.png")
        rows.append({"file": f"{i:02d}.png", "album": ["home", "trip"][i % 2], "year": 2015 + i % 5})
    with open(root / "meta.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["file", "album", "year"])
        writer.writeheader()
        writer.writerows(rows)
    index = root / "index"
    build_photo_index(
        artifacts.checkpoint, images=folder, metadata=root / "meta.csv", out=index, gpu="off", progress=False
    )
    return {"index": index, "rows": rows, "folder": folder}


def _unit(rng: np.random.Generator, dim: int) -> list[float]:
    v = rng.standard_normal(dim)
    return [float(x) for x in v / np.linalg.norm(v)]


def _matched(c: httpx.Client, spec: dict[str, Any]) -> int:
    r = c.post("/v1/search/text", json={"text": "a shape", "k": 1, "filter": spec})
    assert r.status_code == 200, r.text
    return int(r.json()["matched"])


def _nearest(c: httpx.Client, vector: list[float], k: int = 5) -> list[dict[str, Any]]:
    r = c.post("/v1/search/vector", json={"vector": vector, "k": k})
    assert r.status_code == 200, r.text
    return list(r.json()["hits"])


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    return str(r.json()["message"])


def test_writes_are_searched_filtered_served_and_kept(make_server, photos, tmp_path) -> None:
    state = tmp_path / "state"
    server = make_server(index=photos["index"], ICR_STATE_DIR=str(state)).start()
    rng = np.random.default_rng(0)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        info = c.get("/v1/info").json()["index"]
        dim, trips = info["dim"], sum(r["album"] == "trip" for r in photos["rows"])
        assert info["images"] == N_PHOTOS and info["writes"]["seq"] == 0
        vectors = [_unit(rng, dim) for _ in range(3)]
        body = {
            "images": [
                {"vector": vectors[0], "external_id": "e1", "fields": {"album": "new", "year": 2030}},
                {"vector": vectors[1], "external_id": "e2", "fields": {"album": "new", "year": 2030}},
                {"vector": vectors[2], "source": "s3://mine/x.jpg", "fields": {"album": "new", "year": 2031}},
            ]
        }
        r = c.post("/v1/images", json=body)
        assert r.status_code == 200, r.text
        written = r.json()["written"]
        ids = [w["id"] for w in written]
        assert ids == [N_PHOTOS, N_PHOTOS + 1, N_PHOTOS + 2] and r.json()["images"] == N_PHOTOS + 3
        for vector, image_id in zip(vectors, ids, strict=True):
            top = _nearest(c, vector)[0]
            assert top["id"] == image_id and top["score"] == pytest.approx(1.0, abs=1e-5)
        assert _matched(c, {"album": "new"}) == 3 and _matched(c, {"year": 2030}) == 2
        meta = c.get(f"/v1/images/{ids[2]}/metadata").json()
        assert meta["source"] == "s3://mine/x.jpg" and meta["image_url"] is None  # no pixels: never opened
        assert _error(c.get(f"/v1/images/{ids[2]}"), 404)

        # patch: filters see it at once
        r = c.patch(f"/v1/images/{ids[0]}", json={"fields": {"album": "trip", "year": 2029}})
        assert r.status_code == 200 and r.json()["fields"] == {"album": "trip", "year": 2029}
        assert _matched(c, {"album": "new"}) == 2 and _matched(c, {"album": "trip"}) == trips + 1

        # the same external id again replaces its image
        replacement = _unit(rng, dim)
        r = c.post("/v1/images", json={"images": [{"vector": replacement, "external_id": "e2"}]})
        [w] = r.json()["written"]
        assert w["replaced"] == ids[1] and w["id"] == N_PHOTOS + 3
        assert _error(c.get(f"/v1/images/{ids[1]}/metadata"), 404)
        assert ids[1] not in [h["id"] for h in _nearest(c, vectors[1], k=N_PHOTOS + 10)]

        # delete a photo of the build, then by filter
        photo0 = c.get("/v1/images/0").content
        assert c.delete("/v1/images/0").json()["deleted"] == [0]
        assert _error(c.get("/v1/images/0"), 404) and _error(c.delete("/v1/images/0"), 404)
        assert _matched(c, {"album": "home"}) == N_PHOTOS - trips - 1
        r = c.post("/v1/images:delete", json={"filter": {"year": 2031}})
        assert r.json()["deleted"] == [ids[2]]
        everything = c.post("/v1/search/text", json={"text": "a shape", "k": 100}).json()
        assert everything["passed"] == everything["searched"] == N_PHOTOS + 4 - 3  # exact: all retrieved

        # an upload: embedded by the server, its pixels kept and served upright
        sideways = Image.open(io.BytesIO(photo0)).convert("RGB").rotate(90, expand=True)
        exif = Image.Exif()
        exif[0x0112] = 6
        jpeg = io.BytesIO()
        sideways.save(jpeg, format="JPEG", quality=95, subsampling=0, exif=exif)
        r = c.post(
            "/v1/images:upload",
            files={"file": ("IMG_1.jpg", jpeg.getvalue(), "image/jpeg")},
            data={"external_id": "upload-1", "fields": '{"album": "home", "year": 2024}'},
        )
        assert r.status_code == 200, r.text
        uploaded = r.json()["written"][0]["id"]
        served = np.asarray(Image.open(io.BytesIO(c.get(f"/v1/images/{uploaded}").content)), float)
        original = np.asarray(Image.open(io.BytesIO(photo0)).convert("RGB"), float)
        assert served.shape == original.shape and np.abs(served - original).mean() < 8
        similar = c.post("/v1/search/similar", json={"image_id": uploaded, "k": 3, "include_self": True})
        assert similar.status_code == 200, similar.text
        assert similar.json()["hits"][0]["id"] == uploaded
        before = {
            "info": c.get("/v1/info").json()["index"]["writes"],
            "hits": [h["id"] for h in _nearest(c, replacement, k=10)],
        }

    server.stop()
    again = make_server(index=photos["index"], ICR_STATE_DIR=str(state)).start()  # a restart: replayed
    with httpx.Client(base_url=again.url, timeout=60) as c:
        assert c.get("/v1/info").json()["index"]["writes"] == before["info"]
        assert [h["id"] for h in _nearest(c, replacement, k=10)] == before["hits"]
        assert _error(c.get("/v1/images/0"), 404)
        assert c.get(f"/v1/images/{uploaded}").status_code == 200
        # a snapshot: a folder that another server starts from, holding nothing written after it
        r = c.post("/v1/admin/snapshot", json={"name": "kept"})
        assert r.status_code == 200, r.text
        snap = r.json()
        assert snap["folder"] == "snapshots/kept" and snap["seq"] == before["info"]["seq"]
        assert snap["uploads"] == 1 and snap["files_linked"] >= 3 and snap["files_copied"] == 0
        assert _error(c.post("/v1/admin/snapshot", json={"name": "kept"}), 409)
        later = _unit(rng, dim)
        [late] = c.post("/v1/images", json={"images": [{"vector": later}]}).json()["written"]
    again.stop()
    restored = make_server(index=state / "snapshots" / "kept", ICR_STATE_DIR=str(tmp_path / "elsewhere"))
    restored.start()
    with httpx.Client(base_url=restored.url, timeout=60) as c:
        info = c.get("/v1/info").json()["index"]
        assert info["images"] == snap["images"] and info["writes"]["seq"] == snap["seq"]
        assert [h["id"] for h in _nearest(c, replacement, k=10)] == before["hits"]
        assert late["id"] not in [h["id"] for h in _nearest(c, later, k=N_PHOTOS + 10)]
        assert _error(c.get("/v1/images/0"), 404)
        assert c.get(f"/v1/images/{uploaded}").status_code == 200  # the upload travelled with it
    restored.stop()
    assert "Traceback" not in server.log_text() + again.log_text() + restored.log_text()


def test_two_servers_on_one_state_directory_see_each_others_writes(make_server, photos, tmp_path) -> None:
    state = {"ICR_STATE_DIR": str(tmp_path / "state"), "ICR_WRITES_POLL_SECONDS": "0.1"}
    first = make_server(index=photos["index"], **state).start()
    second = make_server(index=photos["index"], **state).start()
    rng = np.random.default_rng(1)
    with (
        httpx.Client(base_url=first.url, timeout=60) as a,
        httpx.Client(base_url=second.url, timeout=60) as b,
    ):
        vector = _unit(rng, a.get("/v1/info").json()["index"]["dim"])
        [w] = a.post("/v1/images", json={"images": [{"vector": vector}]}).json()["written"]
        deadline = time.monotonic() + 10
        while _nearest(b, vector, k=1)[0]["id"] != w["id"]:
            assert time.monotonic() < deadline, "the second server never applied the first's write"
            time.sleep(0.05)
        assert b.delete(f"/v1/images/{w['id']}").status_code == 200
        while _nearest(a, vector, k=1)[0]["id"] == w["id"]:
            assert time.monotonic() < deadline, "the first server never applied the second's delete"
            time.sleep(0.05)
        assert a.get("/v1/info").json()["index"]["writes"] == b.get("/v1/info").json()["index"]["writes"]


def test_bad_writes_are_refused_with_the_fix_and_change_nothing(make_server, photos, tmp_path) -> None:
    server = make_server(index=photos["index"], ICR_STATE_DIR=str(tmp_path / "state")).start()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        dim = c.get("/v1/info").json()["index"]["dim"]
        ok = [0.0] * dim
        ok[0] = 1.0
        for body, message in (
            (
                {"images": [{"vector": [1.0, 0.0]}]},
                f"images[0].vector: 2 values; this index's vectors have {dim}",
            ),
            (
                {"images": [{"vector": ok, "fields": {"colour": "red"}}]},
                "images[0].fields.colour: not a field",
            ),
            (
                {"images": [{"vector": ok, "fields": {"year": "2024"}}]},
                "a string, where the field holds integer",
            ),
            ({"images": [{"vector": ok}, {"vector": [0.0] * dim}]}, "images[1].vector: every value is 0"),
            ({"images": []}, "images"),
        ):
            assert message in _error(c.post("/v1/images", json=body), 422)
        assert "not a field of this index" in _error(c.patch("/v1/images/1", json={"fields": {"x": 1}}), 422)
        assert "no image 999" in _error(c.patch("/v1/images/999", json={"fields": {"year": 1}}), 404)
        assert _error(c.delete(f"/v1/images/{2**70}"), 404)
        both = c.post("/v1/images:delete", json={"ids": [1], "filter": {"year": 1}})  # ids or a filter
        assert "DeleteByIds.filter: unknown field in that form of the request" in _error(both, 422)
        upload = c.post("/v1/images:upload", files={"file": ("x.png", b"not an image", "image/png")})
        assert upload.status_code in (415, 422), upload.text
        assert c.get("/v1/info").json()["index"]["writes"]["seq"] == 0  # nothing was written
    locked = make_server(
        index=photos["index"], ICR_ADMIN_KEY="admin", ICR_STATE_DIR=str(tmp_path / "s2")
    ).start()
    with httpx.Client(base_url=locked.url, timeout=60) as c:
        assert c.post("/v1/images", json={"images": [{"vector": ok}]}).status_code in (401, 403)
        assert c.delete("/v1/images/1").status_code in (401, 403)
    read_only = make_server(index=photos["index"], ICR_WRITES="false").start()
    with httpx.Client(base_url=read_only.url, timeout=60) as c:
        assert "ICR_WRITES" in _error(c.post("/v1/images", json={"images": [{"vector": ok}]}), 409)


def test_the_client_writes(make_server, photos, tmp_path) -> None:
    from icr.client import ApiError, Client

    index = tmp_path / "index"
    shutil.copytree(photos["index"], index)  # it compacts it: not the module's folder
    server = make_server(index=index, ICR_STATE_DIR=str(tmp_path / "state")).start()
    with Client(server.url) as icr:
        dim = icr.info()["index"]["dim"]
        vector = np.random.default_rng(2).standard_normal(dim)
        added = icr.add_images([{"vector": vector, "external_id": "a", "fields": {"album": "trip"}}])
        [new] = added.written
        assert added.images == N_PHOTOS + 1 and icr.search_vector(vector, k=1).hits[0].id == new.id
        assert icr.patch_image(new.id, {"year": 2020, "album": None}).fields == {"year": 2020}
        photo = photos["folder"] / "03.png"
        uploaded = icr.upload_image(photo, external_id="b", fields={"album": "home"}).written[0].id
        assert icr.image_metadata(uploaded).image_url == f"/v1/images/{uploaded}"
        gone = icr.delete_images([new.id, uploaded, 10**6])
        assert sorted(gone.deleted) == sorted([new.id, uploaded]) and gone.images == N_PHOTOS
        assert icr.delete_images(filter={"album": "trip"}).images == N_PHOTOS - N_PHOTOS // 2
        with pytest.raises(ApiError) as err:
            icr.patch_image(new.id, {"year": 1})
        assert err.value.status == 404
        compacted = icr.compact()  # the trip album's photos dropped; the two adds were deleted again
        assert (compacted.removed, compacted.added, compacted.holes) == (N_PHOTOS // 2, 0, N_PHOTOS // 2 + 2)
        snap = icr.snapshot()  # named by the index folder, the log's position and the time
        assert snap.folder.startswith("snapshots/index-seq") and snap.images == N_PHOTOS - N_PHOTOS // 2
        assert (tmp_path / "state" / snap.folder / "snapshot.json").is_file() and snap.uploads == 1


def _icr(*args: str) -> str:
    done = subprocess.run([str(ICR), *args], capture_output=True, text=True, timeout=300, env=_ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_icr_index_add_and_remove_reach_a_running_server(make_server, photos, artifacts, tmp_path) -> None:
    """Bulk writes from the command line go through the server's write log: the running server applies
    them, adding the same folder again replaces rather than duplicates, and a filter removes."""
    state = tmp_path / "state"
    server = make_server(
        index=photos["index"], ICR_STATE_DIR=str(state), ICR_WRITES_POLL_SECONDS="0.1"
    ).start()
    new = tmp_path / "new-photos"
    new.mkdir()
    sources = sorted(artifacts.data.rglob("synth_test_*.png"))[N_PHOTOS : N_PHOTOS + 6]
    with open(new / "meta.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["file", "album", "year"])
        writer.writeheader()
        for i, source in enumerate(sources):
            shutil.copy(source, new / f"n{i}.png")
            writer.writerow({"file": f"n{i}.png", "album": "new", "year": 2040 + i % 2})
    emb = tmp_path / "new-emb"
    _icr("embed", "-m", str(artifacts.checkpoint), "--images", str(new), "--metadata", str(new / "meta.csv"),
         "--out", str(emb), "--quiet")  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for round_ in range(2):  # the second time: the same six images replaced, none added
            printed = _icr(
                "index", "add", str(photos["index"]), "--embeddings", str(emb), "--state-dir", str(state),
                "--no-progress",
            )  # fmt: skip
            assert "added     6" in printed and f"replaced  {6 * round_}" in printed, printed
            _wait(
                lambda: (
                    _matched(c, {"album": "new"}) == 6
                    and c.get("/v1/info").json()["index"]["images"] == N_PHOTOS + 6
                )
            )
        _icr("index", "remove", str(photos["index"]), "--filter", '{"year": 2041}', "--state-dir", str(state))
        _wait(lambda: _matched(c, {"album": "new"}) == 3)
        hit = c.post("/v1/search/text", json={"text": "a shape", "k": 50, "filter": {"album": "new"}}).json()[
            "hits"
        ][0]
        assert hit["metadata"]["fields"]["year"] == 2040 and hit["metadata"]["source"].endswith(".png")


def _wait(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the server never applied the command line's writes"
        time.sleep(0.05)


def test_kill_9_mid_writes_loses_nothing_acknowledged_and_applies_nothing_twice(
    make_server, photos, tmp_path
) -> None:
    """20 times: 8 clients add images (each request a new external id) while the server is killed
    with SIGKILL at a random moment; every acknowledged image is there after a restart, once."""
    import sqlite3
    from concurrent.futures import ThreadPoolExecutor

    state = tmp_path / "state"
    rng = np.random.default_rng(3)
    acked: dict[str, tuple[int, list[float]]] = {}  # external id -> (id, vector)
    sent = 0
    server = make_server(index=photos["index"], ICR_STATE_DIR=str(state)).start()
    dim = httpx.get(server.url + "/v1/info").json()["index"]["dim"]
    for round_ in range(20):
        vectors = {f"r{round_}-{k}": _unit(rng, dim) for k in range(80)}
        sent += len(vectors)

        def add(name: str, url: str = server.url, vectors: dict[str, list[float]] = vectors) -> None:
            try:
                r = httpx.post(
                    url + "/v1/images", json={"images": [{"vector": vectors[name], "external_id": name}]}
                )
            except httpx.TransportError:  # killed before it answered: not acknowledged
                return
            if r.status_code == 200:
                acked[name] = (r.json()["written"][0]["id"], vectors[name])

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(add, name) for name in vectors]
            time.sleep(float(rng.uniform(0.05, 0.6)))
            assert server.process is not None
            server.process.kill()  # SIGKILL: no shutdown, no flush
            server.process.wait()
            for f in futures:
                f.result()
        server = make_server(index=photos["index"], ICR_STATE_DIR=str(state)).start()
    assert len(acked) >= 100 and sent - len(acked) >= 20, (len(acked), sent)  # killed mid-stream, often
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for name, (image_id, vector) in acked.items():
            meta = c.get(f"/v1/images/{image_id}/metadata")
            assert meta.status_code == 200 and meta.json()["source"] == name, (name, meta.text)
            top, second = _nearest(c, vector, k=2)
            assert top["id"] == image_id and second["score"] < 0.999  # there once, not twice
        added = c.get("/v1/info").json()["index"]["writes"]["added"]
    with sqlite3.connect(state / "writes.sqlite") as db:
        per_name = db.execute(
            "SELECT external_id, COUNT(*) FROM writes WHERE op = 'add' GROUP BY external_id"
        ).fetchall()
    assert all(n == 1 for _, n in per_name) and added == len(per_name) >= len(acked)


def test_deleting_a_quarter_of_the_index_says_its_calibration_is_due(
    make_server, artifacts, tmp_path
) -> None:
    """The calibration was fitted on the build; past the measured bound (service/quality.py) every
    calibrated answer says it may over-promise and how to refit, and /v1/info says so too."""
    from icr.service.quality import RECALIBRATE_DELETED

    server = make_server(index=artifacts.images, ICR_STATE_DIR=str(tmp_path / "state")).start()
    query = {"text": "a red circle", "k": 5, "min_relevance": 0.5}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        info = c.get("/v1/info").json()["index"]
        assert info["writes"]["calibration_due"] is False
        before = c.post("/v1/search/text", json=query).json()["quality"]["warnings"]
        assert not any("changed since its calibration" in w for w in before)
        below = int(RECALIBRATE_DELETED * info["ntotal"]) - 1  # just under the bound: nothing said
        for start in range(0, below, 1000):  # a request deletes at most 1,000 ids
            ids = list(range(start, min(start + 1000, below)))
            assert c.post("/v1/images:delete", json={"ids": ids}).status_code == 200
        assert c.get("/v1/info").json()["index"]["writes"]["calibration_due"] is False
        assert c.post("/v1/images:delete", json={"ids": [below, below + 1]}).status_code == 200
        assert c.get("/v1/info").json()["index"]["writes"]["calibration_due"] is True
        warnings = c.post("/v1/search/text", json=query).json()["quality"]["warnings"]
        [due] = [w for w in warnings if "changed since its calibration" in w]
        assert f"{below + 2:,} deleted, of {info['ntotal']:,}" in due and "POST /v1/feedback/refit" in due


def test_live_honesty_judges_the_served_map_as_the_calibration_did(artifacts, tmp_path) -> None:
    """bench/live_honesty.py: on the index as built it reproduces the calibration's own held-out
    evaluation figure for figure (the oracle), then judges the index after adds and deletes."""
    import json

    from bench.live_honesty import run

    folder = tmp_path / "images"
    shutil.copytree(artifacts.images, folder)
    out = run(folder, lambda _m: None, fraction=0.2)
    evaluation = json.loads((folder / "calibration.json").read_text())["evaluation"]["maps"]["per_query"]
    as_built = out["as_built"]["per_query"]
    reported = {k: v for k, v in as_built["threshold"].items() if k != "reliability"}  # the file drops it
    assert _rounded(reported) == _rounded(evaluation["pooled"])
    assert _rounded(as_built["queries"]) == _rounded(evaluation["queries"]["pooled"])
    n = out["images"]
    assert out["added"]["images"] == n + out["added"]["images_added"] == n + round(0.2 * n)
    assert out["deleted"]["images"] == n - out["deleted"]["images_deleted"] == n - round(0.2 * n)
    for case in ("added", "deleted"):
        pooled = out[case]["per_query"]["threshold"]
        assert pooled["queries"] == out["queries"] and 0 <= pooled["ece"] <= 1


def _rounded(value: Any) -> Any:
    """A report with its floats rounded (a JSON round trip and float32 sums differ in the last digits)."""
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return round(value, 9) if isinstance(value, float) else value


def test_compaction_under_load_fails_no_request_and_keeps_every_id(make_server, photos, tmp_path) -> None:
    """POST /v1/admin/compact while 4 clients search and one adds images: no request fails, ids and
    metadata are kept, the writes made meanwhile are served, a second server on the same folder and
    state directory switches to the new folder by itself, and a restart serves the same."""
    import threading

    index = tmp_path / "index"
    shutil.copytree(photos["index"], index)  # compaction replaces the folder: not the module's
    env = {
        "ICR_STATE_DIR": str(tmp_path / "state"),
        "ICR_WRITES_POLL_SECONDS": "0.1",
        "ICR_WATCH_SECONDS": "0.5",
    }
    first = make_server(index=index, **env).start()
    second = make_server(index=index, **env).start()
    rng = np.random.default_rng(7)
    failures: list[str] = []
    stop = threading.Event()
    with httpx.Client(base_url=first.url, timeout=60) as c:
        dim = c.get("/v1/info").json()["index"]["dim"]
        vectors = [_unit(rng, dim) for _ in range(10)]
        written = c.post("/v1/images", json={"images": [{"vector": v} for v in vectors]}).json()["written"]
        added = [w["id"] for w in written]
        assert c.post("/v1/images:delete", json={"ids": [0, 1, 2, 3, 4]}).json()["deleted"] == [0, 1, 2, 3, 4]
        assert c.patch("/v1/images/5", json={"fields": {"album": "moved"}}).status_code == 200

        def load(url: str, writer: bool) -> None:
            with httpx.Client(base_url=url, timeout=60) as client:
                while not stop.is_set():
                    if writer:
                        r = client.post("/v1/images", json={"images": [{"vector": _unit(rng, dim)}]})
                    else:
                        r = client.post(
                            "/v1/search/text", json={"text": "a shape", "k": 5, "filter": {"album": "trip"}}
                        )
                    if r.status_code != 200:
                        failures.append(f"{r.status_code} {r.text[:200]}")

        threads = [threading.Thread(target=load, args=(first.url, False)) for _ in range(3)]
        threads += [
            threading.Thread(target=load, args=(second.url, False)),
            threading.Thread(target=load, args=(first.url, True)),
        ]
        for t in threads:
            t.start()
        time.sleep(0.5)
        r = c.post("/v1/admin/compact")
        time.sleep(1.0)  # load on the new folder too
        stop.set()
        for t in threads:
            t.join()
        assert r.status_code == 200, r.text
        report = r.json()
        assert not failures, failures[:3]
        assert report["removed"] == 5 and report["added"] >= 10 and report["holes"] == 5
        assert report["retrained"] is False and report["vectors"] == N_PHOTOS - 5 + report["added"]
        assert report["images"] >= report["vectors"]  # and the writer's adds after the compaction's write
        manifest = json.loads((index / "manifest.json").read_text())
        assert manifest["base_seq"] == report["seq"] and manifest["holes"] == 5
        info = c.get("/v1/info").json()["index"]
        for vector, image_id in zip(vectors, added, strict=True):
            assert _nearest(c, vector, k=1)[0]["id"] == image_id
        assert _error(c.get("/v1/images/0/metadata"), 404)
        assert c.get("/v1/images/5/metadata").json()["fields"]["album"] == "moved"
        [late] = c.post("/v1/images", json={"images": [{"vector": vectors[0]}]}).json()["written"]
        assert late["id"] > max(added) and c.delete(f"/v1/images/{late['id']}").status_code == 200
    with httpx.Client(base_url=second.url, timeout=60) as b:
        deadline = time.monotonic() + 20
        while b.get("/v1/info").json()["index"].get("ntotal") != manifest["ntotal"]:
            assert time.monotonic() < deadline, "the second server never switched to the compacted folder"
            time.sleep(0.2)
        assert [_nearest(b, v, k=1)[0]["id"] for v in vectors] == added
    first.stop()
    again = make_server(index=index, **env).start()
    with httpx.Client(base_url=again.url, timeout=60) as c:
        assert c.get("/v1/info").json()["index"]["images"] == info["images"]
        assert [_nearest(c, v, k=1)[0]["id"] for v in vectors] == added
    again.stop()
    # from the command line, offline: the late image's add and delete folded in as one more hole
    printed = _icr("index", "compact", str(index), "--state-dir", env["ICR_STATE_DIR"], "--no-progress")
    assert "retrained" in printed and json.loads((index / "manifest.json").read_text())["holes"] == 6
    assert "Traceback" not in first.log_text() + second.log_text() + again.log_text()
