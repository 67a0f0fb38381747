"""Index directories end to end on a tiny embedded benchmark: build (images + distractors, and
captions), manifest and metadata round trips, checkpoint mismatch, interrupted builds, the CLI."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch
from tiny_model import TINY_MODEL
from typer.testing import CliRunner

from icr.index.build import build_caption_index, build_image_index
from icr.index.index_folder import INDEX_FILE, load_index_dir
from icr.index.manifest import MANIFEST_FILE, Manifest, check_compatible
from icr.index.metadata import METADATA_FILE, MetadataStore
from icr.index.vector_index import search
from icr.training.checkpoint import load_checkpoint, read_checkpoint_config
from icr.training.config import load_config
from icr.training.data.synthetic.generate import DistractorStream, load_scenes
from icr.training.data.training_data import open_split
from icr.training.embedding import embed_image_batch, embed_images, threads_beside_workers

N_DISTRACTORS = 50


def as_json(value):
    """``value`` as it comes back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the machine is shared with a training job; tiny models gain nothing from threads
    before = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    yield
    torch.set_num_threads(before[0])
    faiss.omp_set_num_threads(before[1])


@pytest.fixture(scope="module")
def data(tiny_benchmark) -> Path:
    return tiny_benchmark


def _train(data: Path, run: Path, seed: int, *extra: str) -> Path:
    from icr.training.train import train  # the test trains a checkpoint; index/ itself never imports this

    config = load_config(
        None,
        [
            f'data.path="{data}"',
            f'train.out="{run}"',
            "train.batch_size=8",
            "train.epochs=1",
            "train.max_steps=2",
            "data.val_images=12",
            "train.threads=1",
            f"train.seed={seed}",
            *TINY_MODEL,
            *extra,
        ],
    )
    train(config, progress=False)
    return run / "last"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint


@pytest.fixture(scope="module")
def built(data, checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("indices") / "images"
    build_image_index(
        checkpoint, data, distractors=N_DISTRACTORS, out=out, progress=False, gpu="off", batch_size=16
    )
    return out


def test_image_index_holds_the_gallery_then_the_distractors(built, data, checkpoint):
    index, manifest, metadata = load_index_dir(built)
    config = read_checkpoint_config(checkpoint)
    assert sorted(p.name for p in built.iterdir()) == sorted([INDEX_FILE, MANIFEST_FILE, METADATA_FILE])
    assert (manifest.modality, manifest.metric, manifest.dim) == ("image", "inner_product", 32)
    assert (manifest.gallery_count, manifest.distractor_count, manifest.ntotal) == (12, N_DISTRACTORS, 62)
    assert manifest.checkpoint_sha256 == config.weights_sha256
    assert manifest.factory == "Flat" and "exact" in manifest.factory_reason
    assert manifest.recall_check["k"] == 10 and manifest.recall_check["queries"] == 60  # all 60 captions
    assert manifest.recall_check["recall"] == 1.0  # Flat is exact
    assert manifest.build_seconds > 0 and manifest.peak_rss_mb > 0 and manifest.built_on == "cpu"
    assert manifest.data["path"] == str(data) and manifest.data["split"] == "test"
    assert index.ntotal == metadata.count() == 62

    # ids 0..11 are the split's images, 12..61 distractors 0..49, each stored as the model embeds it
    model, _ = load_checkpoint(checkpoint)
    split = open_split(data, "test")
    gallery = embed_images(model, split)  # (12, D)
    stream = DistractorStream.for_dataset(data, N_DISTRACTORS)
    distractors = embed_image_batch(model, [stream.image(k) for k in range(N_DISTRACTORS)])  # (50, D)
    stored = index.reconstruct_n(0, index.ntotal)  # (62, D)
    assert np.allclose(stored, np.concatenate([gallery, distractors]), atol=1e-5)

    rows = metadata.get([13, 0, 13])
    assert [r["id"] for r in rows] == [13, 0, 13]
    first = rows[1]
    assert first["source"].endswith("synth_test_000000.png") and not first["is_distractor"]
    assert first["captions"] == split.captions[:5] and first["image_id"] == 0
    scenes = load_scenes(data)
    test_imgids = sorted(i for i, s in scenes.by_imgid.items() if i >= 52)  # train 40 + val 12 first
    assert first["scene"] == as_json(scenes.by_imgid[test_imgids[0]].to_dict())
    assert rows[0] == {
        "id": 13,
        "source": "distractor:1",
        "captions": [],
        "is_distractor": True,
        "scene": as_json(stream.scene(1).to_dict()),
        "image_id": None,
        "fields": None,
    }
    metadata.close()


def test_caption_index_with_ivf(data, checkpoint, tmp_path):
    manifest = build_caption_index(
        checkpoint, data, out=tmp_path / "caps", factory="IVF4,Flat", progress=False, gpu="off"
    )
    assert (manifest.modality, manifest.ntotal, manifest.gallery_count) == ("text", 60, 60)
    assert manifest.factory == "IVF4,Flat" and manifest.recall_check["query_modality"] == "image"
    assert manifest.recall_check["nprobe"] in (1, 2, 4) and manifest.recall_check["queries"] == 12
    assert manifest.recall_check["recall"] >= 0.95 or manifest.recall_check["nprobe"] == 4
    index, loaded, metadata = load_index_dir(tmp_path / "caps")
    assert loaded == manifest
    split = open_split(data, "test")
    row = metadata.get([7])[0]
    assert row["captions"] == [split.captions[7]] and row["image_id"] == 1
    assert row["source"].endswith("synth_test_000001.png")
    # with every list probed the IVF index answers like an exact scan
    model, _ = load_checkpoint(checkpoint)
    queries = embed_images(model, split)  # (12, D)
    stored = index.reconstruct_n(0, index.ntotal)  # (60, D)
    scores, ids = search(index, queries, 5, nprobe=4)
    for q, s, i in zip(queries, scores, ids, strict=True):
        exact = stored @ q
        assert np.all(exact[i] >= np.sort(exact)[::-1][4] - 1e-5) and np.allclose(s, exact[i], atol=1e-5)
    metadata.close()


def test_distractor_embeddings_from_a_file(data, checkpoint, tmp_path):
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(20, 32)).astype(np.float32)
    np.save(tmp_path / "bad.npy", emb)
    with pytest.raises(ValueError, match="bad.npy: row 0 has norm .* L2-normalised"):
        build_image_index(
            checkpoint,
            data,
            distractor_embeddings=tmp_path / "bad.npy",
            out=tmp_path / "x",
            progress=False,
            gpu="off",
        )
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.building-*"))
    np.save(tmp_path / "d.npy", emb / np.linalg.norm(emb, axis=1, keepdims=True))
    manifest = build_image_index(
        checkpoint,
        data,
        distractor_embeddings=tmp_path / "d.npy",
        out=tmp_path / "idx",
        progress=False,
        gpu="off",
    )
    assert (manifest.gallery_count, manifest.distractor_count) == (12, 20)
    assert manifest.data["distractor_source"] == str(tmp_path / "d.npy")
    np.save(tmp_path / "wrong_dim.npy", np.ones((3, 8), np.float32))
    with pytest.raises(ValueError, match=r"wrong_dim.npy: .*\(N, 32\)"):
        build_image_index(
            checkpoint,
            data,
            distractor_embeddings=tmp_path / "wrong_dim.npy",
            out=tmp_path / "y",
            progress=False,
            gpu="off",
        )


def test_auto_measures_the_ann_candidates_at_the_service_depth(data, checkpoint, tmp_path, monkeypatch):
    from icr.index import factory_choice, vector_index

    # an inverted file from 100 vectors on (default 100,000), an HNSW trial on a 300-vector sample
    monkeypatch.setattr(vector_index, "FLAT_LIMIT", 100)
    monkeypatch.setattr(factory_choice, "HNSW_SAMPLE", 300)
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(20, 32))
    emb = centres[rng.integers(0, 20, 1500)] + 0.5 * rng.normal(size=(1500, 32))  # (1500, 32)
    np.save(tmp_path / "d.npy", (emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float32))
    manifest = build_image_index(
        checkpoint,
        data,
        distractor_embeddings=tmp_path / "d.npy",
        out=tmp_path / "idx",
        factory="auto",
        progress=False,
        gpu="off",
    )
    nlist = round(4 * np.sqrt(1512))
    trials = manifest.extra["factory_trials"]
    assert [t["factory"] for t in trials] == [
        f"IVF{nlist},Flat",
        f"IVF{nlist}_HNSW32,Flat",
        "HNSW32",
        f"IVF{nlist},SQ8,RFlat",
    ]
    winner = trials[0]  # replaced only by a candidate meeting the targets and faster beyond the noise
    for t in trials[1:]:
        if t["meets_targets"] and t["recall_at_k"] is not None and t["p50_ms"] < 0.95 * winner["p50_ms"]:
            winner = t
    assert (
        manifest.factory == winner["factory"] and "measured at the service's depth" in manifest.factory_reason
    )
    check = manifest.recall_check
    assert check["depth"] == 1000 and check["recall"] == pytest.approx(winner["recall_at_k"], abs=1e-6)
    assert check["recall_at_depth"] == pytest.approx(winner["recall_at_depth"], abs=1e-6)
    assert (check.get("ef_search"), check["nprobe"]) == (
        winner["setting"].get("efSearch"),
        winner["setting"].get("nprobe"),
    )
    index, loaded, metadata = load_index_dir(tmp_path / "idx")  # what was kept is what was written
    metadata.close()
    assert loaded == manifest and index.ntotal == 1512
    if manifest.factory == "HNSW32":
        assert faiss.downcast_index(index).hnsw.efSearch == check["ef_search"]
    else:
        assert faiss.extract_index_ivf(getattr(index, "codes", index)).nprobe == check["nprobe"]
        assert ("vectors.f32" in manifest.files) == manifest.factory.endswith("RFlat")


def test_manifest_round_trip_and_validation(built, tmp_path):
    manifest = Manifest.read(built)
    assert Manifest.from_dict(json.loads(manifest.to_json())) == manifest
    assert list(manifest.to_dict())[:2] == ["format", "format_version"]
    path = tmp_path / MANIFEST_FILE
    cases = {
        "not an icr index manifest": {**manifest.to_dict(), "format": "other"},
        "format_version 2": {**manifest.to_dict(), "format_version": 2},
        "dim: Field required": {k: v for k, v in manifest.to_dict().items() if k != "dim"},
        "dim: Input should be greater than or equal to 1": {**manifest.to_dict(), "dim": 0},
        "ntotal: Input should be a valid integer": {**manifest.to_dict(), "ntotal": "22"},
        "gallery_count: Input should be a valid integer": {**manifest.to_dict(), "gallery_count": True},
        "!= ntotal": {**manifest.to_dict(), "ntotal": 99},
        "modality: Input should be 'image' or 'text'": {**manifest.to_dict(), "modality": "audio"},
        "built_on: Input should be 'cpu' or 'gpu'": {**manifest.to_dict(), "built_on": "tpu"},
        "data: split: Field required": {**manifest.to_dict(), "data": {"path": "x"}},
        "recall_check: k: Input should be a valid integer": {
            **manifest.to_dict(),
            "recall_check": {**manifest.recall_check, "k": 1.5},
        },
        "build_seconds: Input should be a valid number; created: Input should be a valid string": {
            **manifest.to_dict(),
            "build_seconds": "fast",
            "created": 3,
        },
    }
    for message, payload in cases.items():
        path.write_text(json.dumps(payload))
        with pytest.raises(ValueError, match=f"{path}: .*{message}"):
            Manifest.read(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"{path}:1:2: index manifest is not valid JSON"):
        Manifest.read(path)


def test_checkpoint_mismatch_names_the_rebuild_command(built, data, checkpoint, tmp_path):
    manifest = Manifest.read(built)
    config = read_checkpoint_config(checkpoint)
    check_compatible(manifest, config)  # the checkpoint that built it
    check_compatible(manifest, config.weights_sha256, 32)
    other = _train(data, tmp_path / "other", seed=1)
    with pytest.raises(ValueError) as err:
        check_compatible(manifest, read_checkpoint_config(other), index_dir=built, checkpoint_path=other)
    message = str(err.value)
    assert "sha256" in message and f"index {built} does not match" in message
    assert (
        f"`icr index build --checkpoint {other} --data {data} --split test "
        f"--distractors {N_DISTRACTORS} --out {built}`"
    ) in message
    with pytest.raises(ValueError, match=r"dim 32, the model embeds in dim 64.*index build --checkpoint C "):
        check_compatible(manifest, config.weights_sha256, 64)


def test_metadata_round_trip(tmp_path):
    path = tmp_path / "m.sqlite"
    rows = [
        {
            "id": i,
            "source": f"img{i}.png",
            "captions": [f"caption {i}", "ünïcode"],
            "is_distractor": i % 2 == 1,
            "scene": {"n": i} if i % 3 else None,
            "image_id": i,
            "fields": {"album": f"a{i % 7}", "year": 2000 + i % 30, "tags": ["x"]} if i % 5 else None,
        }
        for i in range(25_000)
    ]  # more than one insert chunk
    with MetadataStore.create(path) as store:
        assert store.add(iter(rows)) == 25_000
    with pytest.raises(FileExistsError):
        MetadataStore.create(path)
    store = MetadataStore.open(path)
    assert store.count() == 25_000
    ids = [24_999, 3, 0, 3] + list(range(100, 1100))  # more than one query chunk, repeats, any order
    assert store.get(ids) == [rows[i] for i in ids]
    with pytest.raises(KeyError, match="25000"):
        store.get([1, 25_000])
    with pytest.raises(ValueError, match="read-only"):
        store.add(rows[:1])
    bad = tmp_path / "bad.sqlite"
    with MetadataStore.create(bad) as writer:
        with pytest.raises(ValueError) as err:  # a writer's bug is named by row and field
            writer.add([rows[0], {**rows[1], "captions": "one caption", "colour": "red"}])
    assert str(err.value) == (
        f"{bad}: metadata row 1: captions: Input should be a valid list; "
        "colour: Extra inputs are not permitted"
    )
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        store._db.execute("DELETE FROM items")  # read-only at the SQLite level too
    store.close()
    with pytest.raises(FileNotFoundError, match="nowhere.sqlite"):
        MetadataStore.open(tmp_path / "nowhere.sqlite")
    # A store of schema version 1 (before user fields) still reads: its rows have no fields.
    old = tmp_path / "v1.sqlite"
    with sqlite3.connect(old) as db:
        db.execute(
            "CREATE TABLE items (id INTEGER PRIMARY KEY, source TEXT NOT NULL, captions TEXT NOT NULL, "
            "is_distractor INTEGER NOT NULL, scene TEXT, image_id INTEGER)"
        )
        db.execute("INSERT INTO items VALUES (0, 'a.png', '[\"c\"]', 0, NULL, 0)")
        db.execute("PRAGMA user_version=1")
    with MetadataStore.open(old) as v1:
        assert v1.get([0]) == [
            {"id": 0, "source": "a.png", "captions": ["c"], "is_distractor": False, "scene": None,
             "image_id": 0, "fields": None}
        ]  # fmt: skip
    (tmp_path / "junk.sqlite").write_bytes(b"junk" * 100)
    with pytest.raises(ValueError, match="junk.sqlite: not a readable metadata store"):
        MetadataStore.open(tmp_path / "junk.sqlite")


def test_load_index_dir_names_missing_and_corrupt_files(built, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    (copy / INDEX_FILE).write_bytes(b"garbage")
    with pytest.raises(
        ValueError, match=f"{copy / INDEX_FILE}: its content changed since the build.*index build"
    ):
        load_index_dir(copy)
    # A file edited in place, same size and still valid: the recorded sha256 catches it.
    shutil.copy(built / INDEX_FILE, copy / INDEX_FILE)
    with sqlite3.connect(copy / METADATA_FILE) as db:
        db.execute("UPDATE items SET source = 'elsewhere.png' WHERE id = 0")
    with pytest.raises(ValueError, match=f"{copy / METADATA_FILE}: its content changed since the build"):
        load_index_dir(copy)
    shutil.copy(built / METADATA_FILE, copy / METADATA_FILE)
    _, restored, metadata = load_index_dir(copy)  # restored: loads again
    metadata.close()
    assert restored.files == Manifest.read(built).files and set(restored.files) == {INDEX_FILE, METADATA_FILE}
    # A manifest from before the hashes were recorded: the file's own checks still name it.
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    del manifest["files"]
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    (copy / INDEX_FILE).write_bytes(b"garbage")
    with pytest.raises(ValueError, match=f"{copy / INDEX_FILE}: not a readable FAISS index.*icr index build"):
        load_index_dir(copy)
    (copy / INDEX_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=f"{copy / INDEX_FILE}: index file not found.*index build"):
        load_index_dir(copy)
    shutil.copy(built / INDEX_FILE, copy / INDEX_FILE)
    (copy / METADATA_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=f"{copy / METADATA_FILE}: metadata store not found"):
        load_index_dir(copy)
    (copy / MANIFEST_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=f"{copy / MANIFEST_FILE}: index manifest not found"):
        load_index_dir(copy)
    with pytest.raises(FileNotFoundError, match="index directory not found"):
        load_index_dir(tmp_path / "nowhere")


def test_interrupted_build_keeps_the_previous_index(built, data, checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "idx"
    shutil.copytree(built, out)
    before = (out / MANIFEST_FILE).read_text()
    stale = tmp_path / ".idx.building-999999999-deadbeef"  # left by a killed build (no such pid)
    stale.mkdir()
    import icr.index.distractor_sources
    import icr.index.galleries
    import icr.index.gallery_streams

    real, calls = icr.index.gallery_streams.embed_image_batch, []

    def interrupt_midway(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # gallery done, inside the distractors
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    # the gallery's batches, then the distractors'
    for module in (icr.index.gallery_streams, icr.index.distractor_sources, icr.index.galleries):
        monkeypatch.setattr(module, "embed_image_batch", interrupt_midway)
    with pytest.raises(KeyboardInterrupt):
        build_image_index(
            checkpoint, data, distractors=N_DISTRACTORS, out=out, progress=False, gpu="off", batch_size=8
        )
    assert len(calls) == 3
    assert (out / MANIFEST_FILE).read_text() == before
    index, manifest, metadata = load_index_dir(out)
    assert index.ntotal == manifest.ntotal == 62
    metadata.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]  # no temp folder, stale one removed


def test_rebuild_replaces_an_index_but_never_other_data(data, checkpoint, tmp_path):
    out = tmp_path / "idx"
    first = build_image_index(checkpoint, data, out=out, progress=False, gpu="off")
    second = build_image_index(checkpoint, data, distractors=5, out=out, progress=False, gpu="off")
    assert (first.ntotal, second.ntotal) == (12, 17)
    assert Manifest.read(out) == second and sorted(p.name for p in tmp_path.iterdir()) == ["idx"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match="is not an index directory"):
        build_image_index(checkpoint, data, out=precious, progress=False, gpu="off")
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_bad_arguments_fail_before_embedding(data, checkpoint, tmp_path):
    with pytest.raises(ValueError, match="one distractor source"):
        build_image_index(
            checkpoint, data, distractors=3, distractor_embeddings=tmp_path / "d.npy", out=tmp_path / "i"
        )
    with pytest.raises(ValueError, match="unsupported index factory"):
        build_image_index(checkpoint, data, factory="IVF,Flat", out=tmp_path / "i")
    with pytest.raises(ValueError, match=r"dim \(32\) must be a multiple of 12.*PQ16x4fs,RFlat"):
        build_image_index(checkpoint, data, factory="IVF4,PQ12x4fs,RFlat", out=tmp_path / "i", progress=False)
    with pytest.raises(ValueError, match="needs at least 64 training vectors"):
        build_image_index(
            checkpoint, data, factory="IVF64,Flat", out=tmp_path / "i", progress=False, gpu="off"
        )
    assert not list(tmp_path.iterdir())


def test_cli_build(data, checkpoint, tmp_path):
    from icr.cli import app

    runner = CliRunner()
    helped = runner.invoke(app, ["index", "build", "--help"])
    assert helped.exit_code == 0 and "Examples" in helped.output and "icr index build" in helped.output
    out = tmp_path / "idx"
    result = runner.invoke(
        app,
        [
            "index",
            "build",
            "--checkpoint",
            str(checkpoint),
            "--data",
            str(data),
            "--distractors",
            "10",
            "--gpu",
            "off",
            "--quiet",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output and "ntotal" in result.output and "factory_reason" in result.output
    assert Manifest.read(out).ntotal == 22
    text = runner.invoke(
        app,
        [
            "index",
            "build",
            "-m",
            str(checkpoint),
            "-d",
            str(data),
            "--modality",
            "text",
            "--quiet",
            "--gpu",
            "off",
            "--out",
            str(tmp_path / "caps"),
        ],
    )
    assert text.exit_code == 0, text.output
    assert Manifest.read(tmp_path / "caps").modality == "text"
    bad = runner.invoke(
        app,
        [
            "index",
            "build",
            "-m",
            str(checkpoint),
            "-d",
            str(data),
            "--modality",
            "audio",
            "--out",
            str(tmp_path / "a"),
        ],
    )
    assert bad.exit_code == 2 and "Invalid value for '--modality'" in bad.output
    if faiss.get_num_gpus() == 0:
        on = runner.invoke(
            app,
            [
                "index",
                "build",
                "-m",
                str(checkpoint),
                "-d",
                str(data),
                "--gpu",
                "on",
                "--out",
                str(tmp_path / "g"),
            ],
        )
        assert on.exit_code == 2 and "--gpu on" in on.output
    assert os.path.isdir(out) and not (tmp_path / "a").exists()


def test_calibrate_fits_on_held_out_captions_searched_in_the_index(built, data, checkpoint):
    from icr.index.calibration import CALIBRATION_FILE, ServedCalibration, calibrate_index
    from icr.training.data.synthetic.ground_truth import relevance_mask
    from icr.training.data.synthetic.parse import parse_caption
    from icr.training.data.synthetic.scene import SceneTable
    from icr.training.embedding import embed_captions

    result = calibrate_index(built, split="val", eval_split="test", depth=30, progress=False, generated=40)
    stored = json.loads((built / CALIBRATION_FILE).read_text())
    assert stored == as_json(result)
    assert stored["format_version"] == 3 and stored["method"] == "per_query"
    assert stored["labels"] == "ground_truth" and stored["labels_note"] is None
    assert stored["checkpoint_sha256"] == Manifest.read(built).checkpoint_sha256
    # the 60 validation captions and 40 generated queries (some of which nothing in the index answers)
    assert stored["fit"] == {
        **stored["fit"],
        "split": "val",
        "queries": 100,
        "generated_queries": 40,
        "depth": 30,
        "gallery": "this index",
    }
    assert 0 < stored["fit"]["no_answer"] < 100
    served = ServedCalibration.read(built / CALIBRATION_FILE)
    assert served.method == "per_query"
    broken = built.parent / "broken-calibration.json"
    broken.write_text(json.dumps({**stored, "checkpoint_sha256": "x", "per_query": 3, "global": None}))
    with pytest.raises(ValueError) as err:
        ServedCalibration.read(broken)
    assert str(err.value) == (
        f"{broken}: invalid calibration file: checkpoint_sha256: String should match pattern "
        "'^[0-9a-f]{64}$'; global: Input should be a valid dictionary; per_query: Input should be a valid "
        "dictionary"
    )

    # The fit's hits, rebuilt here: each validation caption's top 30 in the index, judged by the
    # generator's truth over the test images' and distractors' scenes.
    model, _ = load_checkpoint(checkpoint)
    val = open_split(data, "val")
    index, manifest, metadata = load_index_dir(built)
    metadata.close()
    scores, ids = index.search(embed_captions(model, val.captions), 30)  # (60, 30) each
    test_records = json.loads((data / "dataset_synthetic.json").read_text())["images"]
    scenes = load_scenes(data)
    gallery = [scenes.by_imgid[r["imgid"]] for r in test_records if r["split"] == "test"]
    stream = DistractorStream.for_dataset(data, N_DISTRACTORS)
    table = SceneTable.from_scenes(gallery + [stream.scene(k) for k in range(N_DISTRACTORS)])
    truth = np.stack([relevance_mask(parse_caption(c), table)[ids[q]] for q, c in enumerate(val.captions)])
    # The global isotonic map keeps its promise on the hits it was fitted on: the hits it rates
    # >= p are relevant at least a fraction p of the time (pool-adjacent-violators' blocks).
    relevance = served.global_map(scores)
    for p in (0.3, 0.5, 0.8):
        passing = relevance >= p
        if passing.any():
            assert truth[passing].mean() >= p - 1e-9
    # The per-query map never ranks a lower score above a higher one within a query.
    emb = embed_captions(model, val.captions)
    for q in range(len(scores)):
        r = served.relevance(scores[q], emb[q : q + 1], val.captions[q])
        assert np.all(np.diff(r) <= 1e-12) and r.min() >= 0 and r.max() <= 1

    evaluation = stored["evaluation"]
    assert evaluation["split"] == "test" and evaluation["judged"] == "generated distractors"
    assert set(evaluation["maps"]) == {"per_query", "global"}
    pooled = evaluation["maps"]["per_query"]["pooled"]
    assert pooled["queries"] == 60 and set(pooled["thresholds"]) == {"0.5", "0.8", "0.9"}
    assert set(stored["kinds"]) == set(evaluation["maps"]["per_query"]["by_kind"])
    for row in stored["kinds"].values():
        assert row["handled_well"] == (row["p_at_10"] is not None and row["p_at_10"] >= 0.6)
    # per query: what each test caption's top 20 promise against what they deliver
    honesty = evaluation["maps"]["per_query"]["queries"]
    assert honesty["k"] == 20 and honesty["pooled"]["queries"] == 60
    assert set(honesty["by_kind"]) == set(evaluation["maps"]["per_query"]["by_kind"])
    # the evidence: the fitting captions themselves are inside it; nonsense and other domains are
    # not, and nothing of theirs passes a threshold
    assert stored["evidence"]["queries"] == 100 and served.evidence is not None
    assert served.evidence.assess(val.captions[0]).inside
    ood = evaluation["out_of_domain"]
    assert set(ood) == {"nonsense", "other_domain", "word_salad", "held_out_kind", "all"}
    for group in ("nonsense", "other_domain"):
        assert ood[group]["queries"] == 25 and ood[group]["withheld"] == 1.0
        assert ood[group]["passing_any"] == {"0.5": 0.0, "0.9": 0.0}
    generated = evaluation["generated"]  # 40 others, by style
    assert generated["queries"] == 40 and generated["honesty"]["pooled"]["queries"] == 40
    assert set(generated["honesty"]["by_kind"]) <= {"caption", "bare_count", "impossible"}
    relation = evaluation["maps"]["per_query"]["by_kind"]["relation"]["queries"]
    assert (
        ood["held_out_kind"]["queries"] == relation
    )  # withheld or not: 52 fitting captions are little evidence


def test_calibrate_refuses_another_checkpoint_and_bad_methods(built, data, tmp_path):
    from icr.index.calibration import calibrate_index

    other = _train(data, tmp_path / "other", seed=2)
    with pytest.raises(ValueError, match="icr index build --checkpoint"):
        calibrate_index(built, checkpoint=other, progress=False)
    with pytest.raises(ValueError, match="isotonic, platt"):
        calibrate_index(built, method="spline", progress=False)
    with pytest.raises(ValueError, match="--depth must be >= 1"):
        calibrate_index(built, depth=0, progress=False)


def test_cli_calibrate(built):
    from icr.cli import app

    result = CliRunner().invoke(
        app, ["index", "calibrate", str(built), "--method", "platt", "--depth", "20", "--quiet"]
    )
    assert result.exit_code == 0, result.output
    assert "held-out test captions (60), top 20, judged on generated distractors" in result.output
    assert "per_query" in result.output and "one_object" in result.output
    assert f"wrote {built / 'calibration.json'}" in result.output
    assert json.loads((built / "calibration.json").read_text())["global"]["method"] == "platt"


def test_distractor_images_from_a_folder(data, checkpoint, tmp_path):
    from PIL import Image

    from icr.training.data.errors import DatasetError

    folder = tmp_path / "extra"
    (folder / "sub").mkdir(parents=True)
    stream = DistractorStream(5, seed=3, image_size=32)
    paths = [folder / "a.png", folder / "b.jpg", folder / "sub" / "c.png", folder / "d.png", folder / "e.png"]
    for k, path in enumerate(paths):
        Image.fromarray(stream.image(k)).save(path)
    (folder / "notes.txt").write_text("not an image")
    out = tmp_path / "idx"
    manifest = build_image_index(
        checkpoint, data, distractor_images=folder, out=out, progress=False, gpu="off"
    )
    assert manifest.distractor_count == 5 and manifest.ntotal == 12 + 5
    index, _, metadata = load_index_dir(out)
    try:
        rows = metadata.get(list(range(12, 17)))
        assert [r["source"] for r in rows] == [str(p) for p in sorted(paths)]
        assert all(r["is_distractor"] for r in rows)
        model, _ = load_checkpoint(checkpoint)
        from icr.training.data.karpathy import load_image

        want = embed_image_batch(model, [load_image(p) for p in sorted(paths)])  # (5, D)
        got = np.stack([index.reconstruct(i) for i in range(12, 17)])
        np.testing.assert_allclose(got, want, atol=1e-5)
    finally:
        metadata.close()
    (folder / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DatasetError, match="broken.png"):
        build_image_index(checkpoint, data, distractor_images=folder, out=out, progress=False, gpu="off")
    assert Manifest.read(out).distractor_count == 5  # the previous index is untouched
    with pytest.raises(ValueError, match="one distractor source"):
        build_image_index(checkpoint, data, distractors=3, distractor_images=folder, out=out, progress=False)


def test_every_reader_uses_the_captions_per_image_of_training(data, tmp_path):
    """A model trained on 3 captions per image: its caption index, evaluation and calibration read 3
    per image too (the first 3 in file order), not the default 5."""
    from icr.index.calibration import calibrate_index
    from icr.training.evaluation.full_report import EvalOptions, evaluate_checkpoint

    checkpoint = _train(data, tmp_path / "run", 0, "data.captions_per_image=3")
    captions = build_caption_index(checkpoint, data, out=tmp_path / "caps", progress=False, gpu="off")
    assert captions.ntotal == 12 * 3
    options = EvalOptions(calibration_split=None, relevance_depth=0, progress=False, device="cpu")
    report = evaluate_checkpoint(checkpoint, data, options)
    assert report["data"]["captions"] == 12 * 3, report["data"]
    images = build_image_index(checkpoint, data, out=tmp_path / "imgs", progress=False, gpu="off")
    assert images.ntotal == 12
    fitted = calibrate_index(
        tmp_path / "imgs", split="val", eval_split="test", depth=10, progress=False, generated=0
    )
    assert fitted["fit"]["queries"] == 12 * 3


def test_embedding_beside_render_workers_leaves_them_the_cores_and_restores_the_threads() -> None:
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    with threads_beside_workers(cores, "cpu"):
        assert torch.get_num_threads() == 1  # the workers took every core
    assert torch.get_num_threads() == before
    with threads_beside_workers(0, "cpu"):  # rendering in this process: nothing to leave
        assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), threads_beside_workers(cores, "cpu"):
        raise RuntimeError("a failed batch")
    assert torch.get_num_threads() == before
