"""POST /v1/admin/reload swaps in a rebuilt index folder while clients search: no request fails; a
broken replacement is refused and the served artifacts stay."""

from __future__ import annotations

import json
import os
import shutil
import threading

import httpx

from icr.index.calibration import CALIBRATION_FILE


def test_reload_swaps_a_rebuilt_index_under_load(artifacts, make_server, tmp_path) -> None:
    served = tmp_path / "images"
    shutil.copytree(artifacts.images, served)
    server = make_server(index=served, ICR_ADMIN_KEY="admin").start()
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
