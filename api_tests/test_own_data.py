"""The README's "your own data" walk-through, line by line, in a fresh folder: a tiny random CLIP
fine-tuned on captioned pairs and imported stock, `icr embed` of a photo folder with metadata and
EXIF-rotated phone JPEGs, `icr index build --embeddings`, a real `icr serve`, and the README's Python
client code: a filter, labels through the API, a refit, a min_relevance search."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from server_support import ICR, ROOT, free_port

from icr.client import Client

SECTION = "## Your own data"


def _blocks() -> tuple[list[str], str]:
    """(the bash block's commands, continuation lines joined; the python block)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", 1)]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)
    python = re.search(r"```python\n(.*?)```", section, re.S)
    assert bash is not None and python is not None, "the section has a bash and a python block"
    joined = bash.group(1).replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip()], python.group(1)


def _run(command: str, cwd: Path) -> str:
    argv = shlex.split(command)
    if argv[0] == "icr":
        argv[0] = str(ICR)
    elif argv[0] == "python":
        argv[0] = sys.executable
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_the_readme_walk_through_runs_against_a_real_server(tmp_path: Path) -> None:
    commands, client_code = _blocks()
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    serve = [c for c in commands if c.startswith("icr serve")]
    assert len(serve) == 1 and serve[0].endswith("&") and commands[-1] == serve[0]
    for command in commands[:-1]:
        _run(command, tmp_path)

    port = free_port()
    argv = [str(ICR), *shlex.split(serve[0].rstrip("&"))[1:]]
    argv[argv.index("--port") + 1] = str(port)
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(argv, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"icr serve not ready:\n{log.read_text()}")

        printed = _run(
            f"python -c {shlex.quote(client_code.replace('http://127.0.0.1:8000', url))}", tmp_path
        )
        with open(tmp_path / "my-photos" / "meta.csv") as handle:
            rows = list(csv.DictReader(handle))
        selected = {r["file"] for r in rows if r["album"] == "trip" and int(r["year"]) >= 2023}
        assert printed.split()[0] == str(len(selected))  # found.matched

        with Client(url) as icr:
            found = icr.search_text("a red circle", k=50, filter={"album": "trip", "year": {"gte": 2023}})
            assert found.matched == found.passed == len(found.hits) == len(selected)
            assert {h.metadata["source"] for h in found.hits} == selected  # relative to the photo folder
            for hit in found.hits:
                assert hit.metadata["fields"]["album"] == "trip" and hit.metadata["fields"]["year"] >= 2023
            assert icr.info()["index"]["metadata_fields"] == ["album", "year", "camera"]
            # the client labelled the top 20 of each of the 5 queries, and the refit serves them
            counts = icr.feedback()["counts"]
            assert counts["judgements"] == counts["hits"] == 100 and counts["queries"] == 5
            assert icr.info()["calibration"]["labels"] == "user"
            # what the labels support decides what passes: 0.5 only where some score's bound reaches it
            supports = icr.feedback()["supports"]["thresholds"]
            trips = sum(r["album"] == "trip" for r in rows)
            sure = icr.search_text("a red circle", k=50, min_relevance=0.5, filter={"album": "trip"})
            assert sure.matched == trips and sure.passed == len(sure.hits) <= trips
            assert (sure.passed > 0) == supports["0.5"]["reached"]
            for hit in sure.hits:
                assert (
                    hit.relevance is not None
                    and hit.relevance >= 0.5
                    and hit.metadata["fields"]["album"] == "trip"
                )
            # the best bound the labels reach is given to the labelled hits it was fitted on
            best = max(supports[t].get("best_bound", float(t)) for t in supports) - 1e-3
            queries = sorted({json.loads(line)["query"] for line in open(tmp_path / "my-labels.jsonl")})
            passing = [icr.search_text(q, k=50, min_relevance=best) for q in queries]
            assert sum(found.passed for found in passing) > 0
            assert all(h.relevance is not None and h.relevance >= best for f in passing for h in f.hits)
            thumb = icr.image(found.hits[0].id, thumbnail=True)
            assert thumb[:8] == b"\x89PNG\r\n\x1a\n"
            _assert_sideways_photos_are_served_upright(icr, tmp_path, everything_k=len(rows))
            everything = icr.search_text("a red circle", k=50)
            assert everything.matched is None and everything.passed == len(rows)
        assert "Traceback" not in log.read_text()
    finally:
        server.terminate()
        server.wait(20)


def _assert_sideways_photos_are_served_upright(icr: Client, folder: Path, everything_k: int) -> None:
    """Each EXIF-rotated JPEG of the photo folder is served as the upright benchmark image it came from
    (photo_folder.py's order), not as its stored, sideways pixels."""
    sources = sorted((folder / "my-pairs" / "images").glob("synth_test_*.png"))
    hits = {h.metadata["source"]: h.id for h in icr.search_text("a red circle", k=everything_k).hits}
    sideways = sorted(name for name in hits if name.endswith(".jpg"))
    assert sideways, "photo_folder.py writes every fourth photo as a rotated JPEG"
    for name in sideways:
        number = int(Path(name).stem.removeprefix("IMG_"))
        served = np.asarray(Image.open(io.BytesIO(icr.image(hits[name]))).convert("RGB"), dtype=float)
        upright = np.asarray(Image.open(sources[number]).convert("RGB"), dtype=float)
        with Image.open(folder / "my-photos" / name) as stored:
            raw = np.asarray(stored.convert("RGB"), dtype=float)  # no EXIF applied: sideways
        assert served.shape == upright.shape
        assert np.abs(served - upright).mean() < 0.5 * np.abs(raw - upright).mean(), name
