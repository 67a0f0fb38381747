"""A user's own gallery: photo folders with metadata files, `icr embed`'s clip-retrieval layout (resumable,
checked against its checkpoint), indices built from either, and query filters against a Python oracle."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from icr.index.build import build_photo_index
from icr.index.embed import embed_to_folder
from icr.index.embeddings_layout import MANIFEST, open_embeddings_folder
from icr.index.filters import FilterCache, parse_filter, to_sql
from icr.index.index_folder import load_index_dir
from icr.index.metadata import MetadataStore
from icr.training.checkpoint import load_checkpoint
from icr.training.data.errors import DatasetError
from icr.training.embedding import embed_captions, embed_image_batch

FORMATS = {"a.png": "PNG", "b.jpg": "JPEG", "sub/c.bmp": "BMP", "sub/deeper/d.tif": "TIFF", "e.webp": "WEBP"}
FORMATS |= {"f.gif": "GIF", "g.ppm": "PPM", "sub/h.png": "PNG"}


def _photos(root: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Eight small photos in eight formats and three folder levels; returns their pixels by relative path."""
    rng = np.random.default_rng(seed)
    pixels = {}
    for name, fmt in FORMATS.items():
        array = rng.integers(0, 256, (24 + len(name), 40, 3), dtype=np.uint8)
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        kwargs = {"quality": 100} if fmt in ("JPEG", "WEBP") else {}
        Image.fromarray(array).save(path, format=fmt, **kwargs)
        with Image.open(path) as decoded:  # what a decoder gives back (JPEG is lossy)
            pixels[name] = np.asarray(decoded.convert("RGB"))
    (root / "notes.txt").write_text("not an image")
    return pixels


def _metadata_rows() -> list[dict]:
    rows = []
    for i, name in enumerate(sorted(FORMATS)):
        rows.append(
            {
                "file": name,
                "album": ["home", "trip"][i % 2],
                "year": 2015 + i,
                "rating": i / 2,
                "caption": f"photo {i}",
            }
        )
    return rows


@pytest.fixture(scope="module")
def gallery(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    _photos(root)
    return root


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_photo_index_stores_every_image_with_its_fields(tiny_checkpoint, gallery, tmp_path, fmt):
    rows = _metadata_rows()
    meta = tmp_path / f"meta.{fmt}"
    if fmt == "jsonl":
        meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        from pyarrow import csv, parquet

        table = pa.Table.from_pylist(rows)
        csv.write_csv(table, meta) if fmt == "csv" else parquet.write_table(table, meta)
    out = tmp_path / "idx"
    manifest = build_photo_index(
        tiny_checkpoint, images=gallery, metadata=meta, out=out, progress=False, gpu="off"
    )
    assert manifest.gallery_count == len(FORMATS) and manifest.metadata_fields == ["album", "year", "rating"]
    assert manifest.data["kind"] == "images" and manifest.data["metadata_unmatched"] == 0
    assert manifest.recall_check["query_modality"] == "text"  # the metadata's captions are the queries
    index, _, store = load_index_dir(out)
    model, _ = load_checkpoint(tiny_checkpoint)
    names = sorted(FORMATS)  # the listing is sorted by relative path
    expected = embed_image_batch(model, [Image.open(gallery / n).convert("RGB") for n in names])  # (8, D)
    np.testing.assert_allclose(index.reconstruct_n(0, index.ntotal), expected, atol=1e-5)
    stored = store.get(range(len(names)))
    for i, (row, name) in enumerate(zip(stored, names, strict=True)):
        assert row["source"] == str((gallery / name).resolve()) and row["captions"] == [f"photo {i}"]
        assert row["fields"] == {"album": ["home", "trip"][i % 2], "year": 2015 + i, "rating": i / 2}
    store.close()


def test_a_corrupt_photo_stops_the_build_by_name_or_is_skipped(tiny_checkpoint, tmp_path):
    root = tmp_path / "photos"
    _photos(root)
    (root / "sub" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"junk" * 20)
    out = tmp_path / "idx"
    with pytest.raises(DatasetError, match=r"sub/broken\.png.*--skip-bad"):
        build_photo_index(tiny_checkpoint, images=root, out=out, progress=False, gpu="off")
    assert not out.exists()  # nothing half-built
    manifest = build_photo_index(
        tiny_checkpoint, images=root, skip_bad=True, out=out, progress=False, gpu="off"
    )
    assert manifest.gallery_count == len(FORMATS) == manifest.ntotal
    assert [s["file"] for s in manifest.data["skipped"]] == ["sub/broken.png"]
    # the factory was chosen for the 9 files listed: the reason says 8 were indexed, not 9
    assert f"{len(FORMATS) + 1} items listed; 1 left out, {len(FORMATS)} indexed" in manifest.factory_reason
    # the record names the file and what is wrong, not the "pass --skip-bad" that was passed
    error = manifest.data["skipped"][0]["error"]
    assert "broken.png" in error and "cannot decode" in error and "--skip-bad" not in error
    assert manifest.recall_check["query_modality"] == "image"  # no captions: its own images query
    _, _, store = load_index_dir(out)
    assert [Path(r["source"]).name for r in store.get(range(manifest.ntotal))] == [
        Path(n).name for n in sorted(FORMATS)
    ]
    store.close()


def test_an_index_built_from_a_relative_checkpoint_serves_from_anywhere(
    tiny_checkpoint, gallery, tmp_path, monkeypatch
):
    import shutil

    shutil.copytree(tiny_checkpoint, tmp_path / "runs" / "ckpt")
    monkeypatch.chdir(tmp_path)
    manifest = build_photo_index(
        Path("runs/ckpt"), images=gallery, out=Path("idx"), progress=False, gpu="off"
    )
    assert manifest.checkpoint_path == str(tmp_path / "runs" / "ckpt")  # not "runs/ckpt"


def test_metadata_rows_that_name_no_image_are_named(tiny_checkpoint, gallery, tmp_path):
    meta = tmp_path / "meta.jsonl"
    rows = [*_metadata_rows(), {"file": "trip/missing.png", "album": "trip"}, {"file": "a.pgn", "year": 1}]
    meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = build_photo_index(
        tiny_checkpoint, images=gallery, metadata=meta, out=tmp_path / "idx", progress=False, gpu="off"
    )
    assert manifest.data["metadata_unmatched"] == 2
    assert manifest.data["metadata_unmatched_files"] == ["a.pgn", "trip/missing.png"]


def test_a_gallery_holds_common_photo_formats_only(tmp_path):
    """An allow-list, not every format PIL opens: a .tga file is not listed, and a file named .png
    whose content is another format (SGI here) is refused naming the file and the accepted formats,
    by photo-folder builds and by dataset loading alike."""
    from icr.index.photo_folder import decode_image, list_photos
    from icr.training.data.karpathy import load_image

    pixels = np.zeros((8, 8, 3), np.uint8)
    Image.fromarray(pixels).save(tmp_path / "a.png")
    Image.fromarray(pixels).save(tmp_path / "b.tga")
    Image.fromarray(pixels).save(tmp_path / "c.png", format="SGI")
    assert [p.name for p in list_photos(tmp_path)] == ["a.png", "c.png"]
    error = decode_image(tmp_path / "c.png")
    assert isinstance(error, DatasetError), error
    for says in ("c.png", "accepted format (JPEG, PNG, WEBP, GIF, BMP, TIFF, PPM)", "--skip-bad"):
        assert says in str(error), str(error)
    with pytest.raises(DatasetError, match=r"c\.png.*JPEG, PNG, WEBP, GIF, BMP, TIFF, PPM"):
        load_image(tmp_path / "c.png")


def test_metadata_files_are_checked(tmp_path):
    from icr.index.photo_folder import read_metadata

    bad = tmp_path / "m.jsonl"
    bad.write_text('{"file": "a.png"}\n{"name": "b.png"\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not JSON"):
        read_metadata(bad)
    bad.write_text('{"name": "a.png", "x": 1}\n')
    with pytest.raises(ValueError, match="no key column.*file, path, image_path, filename"):
        read_metadata(bad)
    bad.write_text('{"file": "a.png"}\n{"file": "./a.png"}\n')
    with pytest.raises(ValueError, match="row 2: 'a.png' appears twice"):
        read_metadata(bad)
    bad.write_text('{"file": "a.png", "is_distractor": 1}\n')
    with pytest.raises(ValueError, match="'is_distractor' is reserved"):
        read_metadata(bad)
    (tmp_path / "m.xlsx").write_text("x")
    with pytest.raises(ValueError, match=r"m\.xlsx: metadata must be \.jsonl"):
        read_metadata(tmp_path / "m.xlsx")


# --- icr embed ------------------------------------------------------------------------------------
def test_embed_writes_clip_retrieval_shards_and_resumes(tiny_checkpoint, tmp_path):
    root = tmp_path / "photos"
    _photos(root)
    meta = tmp_path / "meta.jsonl"
    meta.write_text("".join(json.dumps(r) + "\n" for r in _metadata_rows()))
    out = tmp_path / "emb"
    (root / "f.gif").write_bytes(b"GIF89a" + b"\0" * 10)  # in shard 1 (images 3..5): the run stops there
    with pytest.raises(DatasetError, match="f.gif"):
        embed_to_folder(
            tiny_checkpoint, out, images=root, metadata=meta, shard_size=3, progress=False, device="cpu"
        )
    done = json.loads((out / MANIFEST).read_text())
    assert [s["index"] for s in done["shards"]] == [0] and not done["complete"]
    first = (out / "img_emb" / "img_emb_0.npy").stat().st_mtime_ns
    with pytest.raises(ValueError, match="unfinished `icr embed` run"):
        open_embeddings_folder(out, 32)
    _photos(root)  # the file is fixed; the same command continues after shard 0
    # on the CPU, as the oracle below: on a GPU the vectors differ by ~1e-4 (cuDNN's TF32 convolutions)
    manifest = embed_to_folder(
        tiny_checkpoint, out, images=root, metadata=meta, shard_size=3, progress=False, device="cpu"
    )
    assert (out / "img_emb" / "img_emb_0.npy").stat().st_mtime_ns == first  # not redone
    assert manifest["complete"] and manifest["num_shards"] == 3 and manifest["rows"] == len(FORMATS)
    assert manifest["text"] and manifest["fields"] == ["album", "year", "rating"]

    model, config = load_checkpoint(tiny_checkpoint)
    names = sorted(FORMATS)
    images = np.concatenate([np.load(out / "img_emb" / f"img_emb_{i}.npy") for i in range(3)])  # (8, D)
    expected = embed_image_batch(model, [Image.open(root / n).convert("RGB") for n in names])
    np.testing.assert_allclose(images, expected, atol=1e-5)
    texts = np.concatenate([np.load(out / "text_emb" / f"text_emb_{i}.npy") for i in range(3)])
    np.testing.assert_allclose(texts, embed_captions(model, [f"photo {i}" for i in range(8)]), atol=1e-5)
    from pyarrow import parquet

    table = parquet.read_table(out / "metadata" / "metadata_1.parquet").to_pylist()
    assert [r["image_path"] for r in table] == names[3:6]
    assert table[0]["caption"] == "photo 3" and table[0]["year"] == 2018 and table[0]["album"] == "trip"

    with pytest.raises(ValueError, match="other shard_size"):
        embed_to_folder(tiny_checkpoint, out, images=root, metadata=meta, shard_size=4, progress=False)


def test_index_from_embeddings_checks_the_checkpoint(tiny_checkpoint, tiny_benchmark, tmp_path):
    out = tmp_path / "emb"
    embed_to_folder(tiny_checkpoint, out, data=tiny_benchmark, split="test", shard_size=5, progress=False)
    idx = tmp_path / "idx"
    manifest = build_photo_index(tiny_checkpoint, embeddings=out, out=idx, progress=False, gpu="off")
    assert manifest.gallery_count == 12 and manifest.data["kind"] == "embeddings"
    assert manifest.recall_check["query_modality"] == "text" and manifest.recall_check["recall"] == 1.0
    index, _, store = load_index_dir(idx)
    folder = open_embeddings_folder(out, 32)
    stored = np.concatenate([v for v, _ in folder.chunks()])
    np.testing.assert_array_equal(index.reconstruct_n(0, 12), stored)
    first = store.get([0])[0]
    assert first["source"].endswith("synth_test_000000.png") and len(first["captions"]) == 5
    store.close()

    manifest_path = out / MANIFEST
    tampered = json.loads(manifest_path.read_text())
    tampered["checkpoint_sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(tampered))
    with pytest.raises(ValueError, match="embeddings of checkpoint sha256 000000000000.*Re-embed"):
        build_photo_index(tiny_checkpoint, embeddings=out, out=tmp_path / "idx2", progress=False, gpu="off")
    manifest_path.unlink()  # a foreign folder (clip-retrieval's): fine as distractors, never as the gallery
    with pytest.raises(ValueError, match="nothing says which model wrote these embeddings"):
        build_photo_index(tiny_checkpoint, embeddings=out, out=tmp_path / "idx2", progress=False, gpu="off")


def _float16_shards(foreign: Path, sizes: list[int], seed: int) -> None:
    """clip-retrieval's img_emb shards: float16 unit rows of dim 32, no manifest."""
    (foreign / "img_emb").mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i, n in enumerate(sizes):
        v = rng.normal(size=(n, 32))
        np.save(
            foreign / "img_emb" / f"img_emb_{i}.npy",
            (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float16),
        )


def test_foreign_float16_shards_are_distractors(tiny_checkpoint, gallery, tmp_path):
    """clip-retrieval writes float16 img_emb files and no manifest: accepted as distractors."""
    foreign = tmp_path / "foreign"
    _float16_shards(foreign, [7, 5], seed=0)
    manifest = build_photo_index(
        tiny_checkpoint,
        images=gallery,
        distractor_embeddings=foreign,
        out=tmp_path / "idx",
        progress=False,
        gpu="off",
    )
    assert manifest.distractor_count == 12 and manifest.ntotal == len(FORMATS) + 12
    _, _, store = load_index_dir(tmp_path / "idx")
    assert (
        store.get([len(FORMATS)])[0]["is_distractor"]
        and store.get([len(FORMATS)])[0]["source"] == "distractor:0"
    )
    store.close()
    np.save(foreign / "img_emb" / "img_emb_1.npy", np.ones((3, 32), np.float16))
    with pytest.raises(ValueError, match=r"img_emb_1\.npy: row 0 has norm 5\.6569"):
        build_photo_index(
            tiny_checkpoint,
            images=gallery,
            distractor_embeddings=foreign,
            out=tmp_path / "i2",
            progress=False,
            gpu="off",
        )


def test_distractor_embeddings_keep_their_metadata_columns(tiny_checkpoint, gallery, tmp_path):
    """clip-retrieval's metadata parquet (image_path, caption, url, ...) stays with each distractor."""
    from pyarrow import Table, parquet

    foreign = tmp_path / "foreign"
    _float16_shards(foreign, [3], seed=1)
    (foreign / "metadata").mkdir()
    rows = [
        {"image_path": f"web/{i}.jpg", "caption": f"web photo {i}", "url": f"https://example.org/{i}.jpg"}
        for i in range(3)
    ]
    parquet.write_table(Table.from_pylist(rows), foreign / "metadata" / "metadata_0.parquet")
    build_photo_index(
        tiny_checkpoint,
        images=gallery,
        distractor_embeddings=foreign,
        out=tmp_path / "idx",
        progress=False,
        gpu="off",
    )
    _, _, store = load_index_dir(tmp_path / "idx")
    stored = store.get(range(len(FORMATS), len(FORMATS) + 3))
    store.close()
    assert [r["source"] for r in stored] == ["web/0.jpg", "web/1.jpg", "web/2.jpg"]
    assert all(r["is_distractor"] for r in stored)
    assert [r["captions"] for r in stored] == [["web photo 0"], ["web photo 1"], ["web photo 2"]]
    assert [r["fields"] for r in stored] == [{"url": f"https://example.org/{i}.jpg"} for i in range(3)]


# --- filters ----------------------------------------------------------------------------------------
def _matches(row: dict, spec: dict) -> bool:
    """The oracle: a filter evaluated in Python on a row."""
    fields = row["fields"] or {}
    for name, cond in spec.items():
        value = row["is_distractor"] if name == "is_distractor" else fields.get(name)
        if not isinstance(cond, dict):
            if cond is None:
                if value is not None:
                    return False
            elif (
                isinstance(value, list | dict)
                or value is None
                or isinstance(value, str) != isinstance(cond, str)
                or value != cond
            ):
                return False
            continue
        for op, bound in cond.items():
            if op == "in":
                if (
                    isinstance(value, list | dict)
                    or value is None
                    or not any(isinstance(value, str) == isinstance(b, str) and value == b for b in bound)
                ):
                    return False
            else:
                if isinstance(value, str | list | dict) or value is None:
                    return False
                if not {
                    "gt": value > bound,
                    "gte": value >= bound,
                    "lt": value < bound,
                    "lte": value <= bound,
                }[op]:
                    return False
    return True


def test_filters_select_what_a_python_oracle_selects(tmp_path):
    rng = np.random.default_rng(0)
    albums = ["home", "trip", "work", "1", "ünï"]
    rows = []
    for i in range(3000):
        fields = {}
        if rng.random() < 0.9:
            fields["album"] = albums[rng.integers(len(albums))]
        if rng.random() < 0.8:
            fields["year"] = (
                int(rng.integers(2000, 2025)) if rng.random() < 0.9 else str(rng.integers(2000, 2025))
            )
        if rng.random() < 0.7:
            fields["rating"] = round(float(rng.random() * 5), 2)
        fields["flag"] = bool(rng.random() < 0.5)
        rows.append(
            {
                "id": i,
                "source": f"{i}.png",
                "is_distractor": bool(i % 7 == 0),
                "fields": fields if i % 11 else None,
            }
        )
    path = tmp_path / "m.sqlite"
    with MetadataStore.create(path) as store:
        store.add(rows)
    store = MetadataStore.open(path)
    known = ["album", "year", "rating", "flag"]
    specs: list[dict] = [
        {"album": "trip"},
        {"album": "1"},  # text "1" never equals the number 1
        {"year": 2010},
        {"year": "2010"},
        {"year": {"gte": 2010, "lt": 2015}},
        {"rating": {"gt": 2.5}, "album": {"in": ["home", "work"]}},
        {"rating": None},
        {"flag": True, "is_distractor": False},
        {"is_distractor": True},
        {"album": {"in": ["ünï", "home"]}, "year": {"lte": 2003}},
        {"rating": {"gte": 1, "lte": 1.5}, "flag": False},
    ]
    for _ in range(40):  # random combinations
        spec = {}
        if rng.random() < 0.5:
            spec["album"] = {"in": list(rng.choice(albums, 2, replace=False))}
        if rng.random() < 0.5:
            lo = int(rng.integers(2000, 2025))
            spec["year"] = {"gte": lo, "lt": lo + int(rng.integers(1, 8))}
        if rng.random() < 0.3:
            spec["is_distractor"] = bool(rng.random() < 0.5)
        specs.append(spec or {"flag": True})
    every = store.get(range(3000))
    for spec in specs:
        where, params = to_sql(parse_filter(spec, known))
        got = store.matching_ids(where, params)
        expected = [r["id"] for r in every if _matches(r, spec)]
        assert got.tolist() == expected, spec
    cache = FilterCache(store, 3000)
    selection, cached = cache.select(parse_filter({"album": "trip"}, known))
    again, cached_again = cache.select(parse_filter({"album": "trip"}, known))
    assert not cached and cached_again and again is selection
    bits = np.unpackbits(selection.bitmap, bitorder="little")[:3000]
    assert np.flatnonzero(bits).tolist() == selection.ids.tolist()
    store.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"albm": "x"}, "unknown field 'albm'; this index's fields are: album, year, is_distractor"),
        ({"year": {"between": [1, 2]}}, "filter.year: unknown operator 'between'"),
        ({"year": {"gte": "2010"}}, "filter.year.gte: a range bound must be a finite number"),
        ({"year": {"gte": True}}, "a range bound must be a finite number"),
        ({"album": {"in": []}}, r"filter.album.in: a list of 1 to 1000 values"),
        ({"album": {"in": [None]}}, "null cannot be listed"),
        ({"album": ["a"]}, "expected a string, number, boolean or null"),
        ({"album": {}}, "an empty condition"),
        ({"is_distractor": "no"}, "filter.is_distractor: true or false"),
        (["album"], "a JSON object of field -> condition"),
    ],
)
def test_bad_filters_say_what_to_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_filter(spec, ["album", "year"])


def test_sql_never_splices_field_names(tmp_path):
    """Names travel as bound JSON paths: a name full of SQL stays a name."""
    path = tmp_path / "m.sqlite"
    name = "x') OR 1=1 --"
    with MetadataStore.create(path) as store:
        store.add(
            [{"id": 0, "source": "a", "fields": {name: 1}}, {"id": 1, "source": "b", "fields": {"x": 1}}]
        )
    with MetadataStore.open(path) as store:
        assert store.matching_ids(*to_sql(parse_filter({name: 1}, [name]))).tolist() == [0]
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM items").fetchone()[0] == 2


def test_cli_embed_then_build_then_misuse(tiny_checkpoint, gallery, tmp_path):
    from typer.testing import CliRunner

    from icr.cli import app

    runner = CliRunner()
    meta = tmp_path / "meta.csv"
    meta.write_text(
        "file,album\n"
        + "".join(f"{n},{'trip' if i % 2 else 'home'}\n" for i, n in enumerate(sorted(FORMATS)))
    )
    emb, idx = tmp_path / "emb", tmp_path / "idx"
    ok = runner.invoke(
        app,
        [
            "embed",
            "-m",
            str(tiny_checkpoint),
            "--images",
            str(gallery),
            "--metadata",
            str(meta),
            "--out",
            str(emb),
            "--quiet",
        ],
    )
    assert ok.exit_code == 0, ok.output
    assert f"wrote {emb}" in ok.output and "rows" in ok.output
    ok = runner.invoke(
        app,
        [
            "index",
            "build",
            "-m",
            str(tiny_checkpoint),
            "--embeddings",
            str(emb),
            "--out",
            str(idx),
            "--gpu",
            "off",
            "--quiet",
        ],
    )
    assert ok.exit_code == 0, ok.output
    _, manifest, store = load_index_dir(idx)
    assert manifest.metadata_fields == ["album"] and store.get([1])[0]["fields"] == {"album": "trip"}
    store.close()
    assert manifest.rebuild_command(idx, tiny_checkpoint) == (
        f"icr index build --checkpoint {tiny_checkpoint} --embeddings {emb.resolve()} --out {idx}"
    )
    for args, message in [
        (
            ["index", "build", "-m", str(tiny_checkpoint), "--out", str(tmp_path / "x")],
            "give the gallery: --data D",
        ),
        (
            [
                "index",
                "build",
                "-m",
                str(tiny_checkpoint),
                "--images",
                str(gallery),
                "--embeddings",
                str(emb),
                "--out",
                str(tmp_path / "x"),
            ],
            "give one gallery",
        ),
        (
            [
                "index",
                "build",
                "-m",
                str(tiny_checkpoint),
                "--images",
                str(gallery),
                "-d",
                str(gallery),
                "--out",
                str(tmp_path / "x"),
            ],
            "leave out --data",
        ),
        (
            ["embed", "-m", str(tiny_checkpoint), "--out", str(tmp_path / "y")],
            "give one source: --images DIR",
        ),
        (
            [
                "embed",
                "-m",
                str(tiny_checkpoint),
                "--images",
                str(tmp_path / "nowhere"),
                "--out",
                str(tmp_path / "y"),
            ],
            "image folder not found",
        ),
        (
            ["embed", "-m", str(tiny_checkpoint), "--images", str(gallery), "--out", str(gallery)],
            "holds no embeddings_manifest.json",
        ),
    ]:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
