"""POST /v1/admin/reload swaps in a rebuilt index folder while clients search: no request fails; a
broken replacement is refused and the served artifacts stay. The watcher does the same by itself,
and refuses to answer from a file rewritten in place until it is whole again."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import httpx

from icr.index.calibration import CALIBRATION_FILE


def test_reload_swaps_a_rebuilt_index_under_load(artifacts, make_server, tmp_path) -> None:
    served = tmp_path / "images"
    shutil.copytree(artifacts.images, served)
    # no watcher: this test swaps by hand (test_the_watcher_... below lets the server notice)
    server = make_server(index=served, ICR_ADMIN_KEY="admin", ICR_WATCH_SECONDS="0").start()
    failures: list[str] = []
    answered = 0
    stop = threading.Event()

    def hammer() -> None:
        nonlocal answered
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not stop.is_set():
                r = c.post("/v1/search/text", json={"text": "a red circle", "k": 5})
                if r.status_code == 200:
                    answered += 1
                else:
                    failures.append(f"{r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.get("/v1/info").json()["calibration"] is not None
        assert c.post("/v1/admin/reload").status_code == 401  # the admin key
        # a rebuilt folder (here: without its calibration) is renamed into place, then reloaded
        rebuilt = tmp_path / "rebuilt"
        shutil.copytree(artifacts.images, rebuilt)
        (rebuilt / CALIBRATION_FILE).unlink()
        os.rename(served, tmp_path / "previous")
        os.rename(rebuilt, served)
        r = c.post("/v1/admin/reload", headers={"X-API-Key": "admin"})
        assert r.status_code == 200 and r.json()["status"] == "reloaded", r.text
        assert c.get("/v1/info").json()["calibration"] is None  # the new folder is served
        # a broken replacement: refused, the served artifacts stay
        broken = tmp_path / "broken"
        shutil.copytree(artifacts.images, broken)
        manifest = json.loads((broken / "manifest.json").read_text())
        (broken / "index.faiss").write_bytes((broken / "index.faiss").read_bytes()[:100])
        os.rename(served, tmp_path / "second")
        os.rename(broken, served)
        r = c.post("/v1/admin/reload", headers={"X-API-Key": "admin"})
        assert r.status_code == 409 and "still serving the previous ones" in r.json()["message"], r.text
        assert str(tmp_path) not in r.text
        assert c.get("/readyz").status_code == 200
        assert c.get("/v1/info").json()["index"]["ntotal"] == manifest["ntotal"]
    stop.set()
    for t in threads:
        t.join()
    assert not failures, failures[:3]
    assert answered > 0
    server.stop()


def _wait_for(check, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "the server did not notice within the time limit"
        time.sleep(0.1)


def test_the_watcher_swaps_rebuilt_folders_and_refuses_files_changed_in_place(
    artifacts, make_server, tmp_path
) -> None:
    served = tmp_path / "images"
    shutil.copytree(artifacts.images, served)
    server = make_server(index=served, ICR_WATCH_SECONDS="0.2").start()
    with httpx.Client(base_url=server.url, timeout=60) as c:

        def search() -> httpx.Response:
            return c.post("/v1/search/text", json={"text": "a red circle", "k": 3})

        assert search().status_code == 200 and c.get("/v1/info").json()["calibration"] is not None
        # 1. icr index build renames a complete folder into place: swapped in, no restart, no admin call
        rebuilt = tmp_path / "rebuilt"
        shutil.copytree(artifacts.images, rebuilt)
        (rebuilt / CALIBRATION_FILE).unlink()
        os.rename(served, tmp_path / "previous")
        os.rename(rebuilt, served)
        _wait_for(lambda: c.get("/v1/info").json()["calibration"] is None)
        assert search().status_code == 200
        # 2. metadata.sqlite rewritten in place (same inode, other bytes): refused until whole
        metadata = served / "metadata.sqlite"
        original = metadata.read_bytes()
        with open(metadata, "r+b") as handle:
            handle.seek(len(original) // 2)
            handle.write(b"\0" * 4096)
        _wait_for(lambda: c.get("/readyz").status_code == 503)
        refused = search()
        assert refused.status_code == 503 and refused.json()["error"] == "artifacts_changed"
        assert "metadata.sqlite changed on disk while being served" in refused.json()["message"]
        assert str(tmp_path) not in refused.text
        # 3. the bytes are whole again (restored in place): served again
        with open(metadata, "r+b") as handle:
            handle.write(original)
        _wait_for(lambda: c.get("/readyz").status_code == 200)
        assert search().status_code == 200
    assert "Traceback" not in server.log_text()
