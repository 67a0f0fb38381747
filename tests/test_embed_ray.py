"""`icr embed --engine ray` on a local Ray instance of 2 CPUs: the folder equals the local engine's
(embeddings within 1e-5, metadata rows, manifests' shards) for a photo folder with metadata, webdataset
tar shards and a parquet list of paths; resume (recorded shards are not redone, across engines); an
embedding actor killed mid-run loses and duplicates no row."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ray = pytest.importorskip("ray", reason="the Ray engine needs the [distributed] extra (ray[data])")
pytest.importorskip("ray.data", reason="the Ray engine needs the [distributed] extra (ray[data])")

from test_own_gallery import FORMATS, _metadata_rows, _photos  # noqa: E402

from icr.index.embed import embed_to_folder  # noqa: E402
from icr.index.embeddings_layout import MANIFEST, read_rows, shard_paths  # noqa: E402
from icr.training.data.errors import DatasetError  # noqa: E402

NAMES = sorted(FORMATS)  # a photo folder's listing order
# Ray Data's own DataContext warns about its deprecated settings each time it is copied
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory: pytest.TempPathFactory):
    """A local Ray instance: 2 CPUs (one embedding actor + decode tasks), a 200 MB object store."""
    if ray.is_initialized():
        ray.shutdown()
    temp = tmp_path_factory.mktemp("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200 * 1024**2,
        _temp_dir=str(temp),
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    try:
        yield
    finally:
        ray.shutdown()


def _embed(checkpoint: Path, out: Path, engine: str, **source) -> dict:
    return embed_to_folder(checkpoint, out, engine=engine, progress=False, device="cpu", **source)


def _assert_same_folder(ray_out: Path, local_out: Path) -> None:
    """Same shards (rows, planned), same metadata rows, embeddings within 1e-5."""
    dirs = (ray_out, local_out)
    a, b = (json.loads((d / MANIFEST).read_text()) for d in dirs)
    assert a["complete"] and b["complete"]
    for key in ("source", "count", "num_shards", "rows", "fields", "text", "skipped", "dim"):
        assert a[key] == b[key], key
    assert a["checkpoint_sha256"] == b["checkpoint_sha256"]
    shards = [{k: s[k] for k in ("index", "rows", "planned")} for s in a["shards"]]
    assert shards == [{k: s[k] for k in ("index", "rows", "planned")} for s in b["shards"]]
    assert a["engine"] == "ray" and {s["engine"] for s in a["shards"]} == {"ray"}
    for s in a["shards"]:
        (img_a, text_a, meta_a), (img_b, text_b, meta_b) = (shard_paths(d, s["index"]) for d in dirs)
        np.testing.assert_allclose(np.load(img_a), np.load(img_b), atol=1e-5)
        assert text_a.is_file() == text_b.is_file() == a["text"]
        if a["text"]:
            np.testing.assert_allclose(np.load(text_a), np.load(text_b), atol=1e-5)
        assert read_rows(meta_a) == read_rows(meta_b)


def _both(checkpoint: Path, tmp_path: Path, **source) -> list[dict]:
    """Embed with each engine; check the folders match; the rows in order."""
    _embed(checkpoint, tmp_path / "local", "local", shard_size=3, batch_size=2, **source)
    manifest = _embed(checkpoint, tmp_path / "ray", "ray", shard_size=3, batch_size=2, **source)
    _assert_same_folder(tmp_path / "ray", tmp_path / "local")
    return [r for i in range(manifest["num_shards"]) for r in read_rows(shard_paths(tmp_path / "ray", i)[2])]


def test_photo_folder_with_metadata(tiny_checkpoint, ray_local, tmp_path):
    root = tmp_path / "photos"
    _photos(root)
    meta = tmp_path / "meta.jsonl"
    meta.write_text("".join(json.dumps(r) + "\n" for r in _metadata_rows()))
    rows = _both(tiny_checkpoint, tmp_path, images=root, metadata=meta)
    assert [r["image_path"] for r in rows] == NAMES
    assert [r["caption"] for r in rows] == [f"photo {i}" for i in range(len(NAMES))]
    assert rows[3]["year"] == 2018 and rows[3]["album"] == "trip"


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as handle:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            handle.addfile(info, io.BytesIO(data))


def test_webdataset_shards(tiny_checkpoint, ray_local, tmp_path):
    photos = tmp_path / "photos"
    _photos(photos)
    shards = tmp_path / "shards"
    shards.mkdir()
    members: list[list[tuple[str, bytes]]] = [[], []]
    for n, name in enumerate(NAMES):
        key = f"{n // 4:03d}/s{n:04d}"
        stem = Path(name).stem
        data = (photos / name).read_bytes()
        # the format by extension is what a webdataset writer does; PIL reads the bytes' real format
        part = members[n // 4]
        part.append((f"{key}.json", json.dumps({"stem": stem, "n": n}).encode()))
        part.append((f"{key}.{'jpg' if n % 2 else 'png'}", data))
        part.append((f"{key}.txt", f"caption {n}\n".encode()))
    members[1].append(("999/no-image.txt", b"a sample without an image is left out"))
    members[1].append(("999/broken.png", b"\x89PNG\r\n\x1a\n" + b"junk" * 20))
    members[1].append(("999/broken.txt", b"left out with --skip-bad"))
    _tar(shards / "b-00001.tar", members[1])
    _tar(shards / "a-00000.tar", members[0])
    rows = _both(tiny_checkpoint, tmp_path, webdataset=shards, skip_bad=True)
    assert [r["image_path"] for r in rows] == [f"{n // 4:03d}/s{n:04d}" for n in range(len(NAMES))]
    assert [r["caption"] for r in rows] == [f"caption {n}" for n in range(len(NAMES))]
    assert [r["stem"] for r in rows] == [Path(n).stem for n in NAMES] and rows[5]["n"] == 5
    manifest = json.loads((tmp_path / "ray" / MANIFEST).read_text())
    assert manifest["source"]["kind"] == "webdataset" and manifest["source"]["without_image"] == 1
    assert manifest["source"]["tars"] == ["a-00000.tar", "b-00001.tar"]
    assert [s["file"] for s in manifest["skipped"]] == ["999/broken"]
    assert "b-00001.tar/999/broken.png" in manifest["skipped"][0]["error"]


def test_parquet_list_of_paths(tiny_checkpoint, ray_local, tmp_path):
    import pyarrow as pa
    from pyarrow import parquet

    photos = tmp_path / "photos"
    _photos(photos)
    order = NAMES[::-1]  # the list's order, not the folder's
    listed = [str(photos / n) if i % 3 == 0 else f"photos/{n}" for i, n in enumerate(order)]
    table = pa.Table.from_pylist(
        [{"path": p, "caption": f"list {i}", "score": i / 4} for i, p in enumerate(listed)]
    )
    parquet.write_table(table, tmp_path / "list.parquet")
    rows = _both(tiny_checkpoint, tmp_path, image_list=tmp_path / "list.parquet")
    assert [r["image_path"] for r in rows] == listed
    assert [r["caption"] for r in rows] == [f"list {i}" for i in range(len(order))]
    assert [r["score"] for r in rows] == [i / 4 for i in range(len(order))]


def test_resume_skips_recorded_shards_and_either_engine_finishes(tiny_checkpoint, ray_local, tmp_path):
    root = tmp_path / "photos"
    _photos(root)
    good = (root / "f.gif").read_bytes()
    (root / "f.gif").write_bytes(b"GIF89a" + b"\0" * 10)  # image 3: shard 1 of 3 stops the run
    args = {"images": root, "shard_size": 3, "batch_size": 2}
    out = tmp_path / "ray"
    with pytest.raises(DatasetError, match="f.gif"):
        _embed(tiny_checkpoint, out, "ray", **args)
    manifest = json.loads((out / MANIFEST).read_text())
    assert [s["index"] for s in manifest["shards"]] == [0] and not manifest["complete"]
    first = shard_paths(out, 0)[0].stat().st_mtime_ns
    (root / "f.gif").write_bytes(good)
    done = _embed(tiny_checkpoint, out, "ray", **args)  # the same command continues
    assert shard_paths(out, 0)[0].stat().st_mtime_ns == first
    assert done["complete"] and done["rows"] == len(NAMES)
    _embed(tiny_checkpoint, tmp_path / "local", "local", **args)
    _assert_same_folder(out, tmp_path / "local")

    # started by the local engine, finished by the Ray one (same identity, equal results)
    (root / "f.gif").write_bytes(b"GIF89a" + b"\0" * 10)
    mixed = tmp_path / "mixed"
    with pytest.raises(DatasetError, match="f.gif"):
        _embed(tiny_checkpoint, mixed, "local", **args)
    first = shard_paths(mixed, 0)[0].stat().st_mtime_ns
    (root / "f.gif").write_bytes(good)
    done = _embed(tiny_checkpoint, mixed, "ray", **args)
    assert shard_paths(mixed, 0)[0].stat().st_mtime_ns == first
    assert [s["engine"] for s in done["shards"]] == ["local", "ray", "ray"] and done["engine"] == "ray"
    for i in range(3):
        np.testing.assert_allclose(
            np.load(shard_paths(mixed, i)[0]), np.load(shard_paths(tmp_path / "local", i)[0]), atol=1e-5
        )
    with pytest.raises(ValueError, match="other shard_size"):
        _embed(tiny_checkpoint, mixed, "ray", images=root, shard_size=4)


def test_ray_arguments_are_checked(tiny_checkpoint, ray_local, tmp_path):
    root = tmp_path / "photos"
    _photos(root)
    with pytest.raises(ValueError, match="2 CPU.*decoding needs at least one more; give --actors at most 1"):
        _embed(tiny_checkpoint, tmp_path / "a", "ray", images=root, actors=2)
    with pytest.raises(ValueError, match="--address and --actors apply to --engine ray"):
        _embed(tiny_checkpoint, tmp_path / "b", "local", images=root, address="auto")
    with pytest.raises(ValueError, match="--engine ray reads image files"):
        _embed(tiny_checkpoint, tmp_path / "c", "ray", data=tmp_path)


def _embedders() -> list[dict]:
    from ray._private import state  # the state API without the dashboard

    return [a for a in state.actors().values() if "_Embedder" in a["ActorClassName"]]


def _embedder_pids() -> list[int]:
    return [int(a["Pid"]) for a in _embedders() if a["State"] == "ALIVE" and a.get("Pid")]


@pytest.mark.slow
def test_a_killed_embedding_actor_loses_and_duplicates_no_row(tiny_checkpoint, ray_local, tmp_path):
    rng = np.random.default_rng(1)
    root = tmp_path / "photos"
    root.mkdir()
    for n in range(192):
        Image.fromarray(rng.integers(0, 256, (20 + n % 7, 24, 3), dtype=np.uint8)).save(root / f"{n:03d}.png")
    killed: list[int] = []

    def kill_once(shard: int) -> None:  # after the first shard is recorded: most of the run is ahead
        if not killed:
            pids = _embedder_pids()
            assert pids, "no embedding actor alive mid-run"
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    args = {"images": root, "shard_size": 16, "batch_size": 4}
    out = tmp_path / "ray"
    manifest = embed_to_folder(
        tiny_checkpoint, out, engine="ray", progress=False, device="cpu", on_shard=kill_once, **args
    )
    assert killed and manifest["complete"] and manifest["rows"] == 192
    assert killed[0] not in _embedder_pids()  # that process is gone; the run went on without it
    assert max(a["NumRestarts"] for a in _embedders()) >= 1  # Ray restarted the actor
    _embed(tiny_checkpoint, tmp_path / "local", "local", **args)
    _assert_same_folder(out, tmp_path / "local")
    rows = [r["image_path"] for i in range(12) for r in read_rows(shard_paths(out, i)[2])]
    assert rows == [f"{n:03d}.png" for n in range(192)]  # each image once, in listing order
