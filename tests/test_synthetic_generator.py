"""The embedded benchmark generator: determinism, format, atomic writes, distractor stream."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from icr.training.data.karpathy import load_karpathy, verify_images
from icr.training.data.synthetic import world
from icr.training.data.synthetic.generate import (
    DistractorStream,
    load_scenes,
    make_image,
    make_scene,
    write_dataset,
)
from icr.training.data.synthetic.ground_truth import is_relevant, relevance_mask
from icr.training.data.synthetic.parse import parse_caption

SMALL = {"train": 12, "val": 4, "test": 5}


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "data"
    write_dataset(out, **SMALL, seed=7)
    return out


def test_same_seed_same_bytes_other_seed_other_bytes(synth: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    write_dataset(again, **SMALL, seed=7)
    assert _digest(again) == _digest(synth)
    other = tmp_path / "other"
    write_dataset(other, **SMALL, seed=8)
    a, b = _digest(synth), _digest(other)
    assert a.keys() == b.keys()
    assert sum(a[k] != b[k] for k in a) >= len(a) - 1


def test_image_i_does_not_depend_on_split_sizes(synth: Path, tmp_path: Path) -> None:
    bigger = tmp_path / "bigger"
    write_dataset(bigger, train=20, val=4, test=6, seed=7)
    for name in ("images/synth_train_000011.png", "images/synth_test_000004.png"):
        assert (bigger / name).read_bytes() == (synth / name).read_bytes()


def test_loads_through_the_karpathy_loader(synth: Path) -> None:
    ds = load_karpathy(synth)
    assert ds.name == "synthetic"
    assert {k: len(v) for k, v in ds.splits.items()} == SMALL
    test = ds.split("test")
    assert test.num_captions == 5 * SMALL["test"]
    assert verify_images(test) == SMALL["test"]
    scenes = load_scenes(synth)
    assert scenes.seed == 7 and scenes.image_size == 64
    for record in test.images:
        scene = scenes.by_imgid[record.imgid]
        assert 1 <= len(scene.objects) <= 3
        assert all(is_relevant(c, scene) for c in record.captions)  # each caption true of its image
        for caption, tokens in zip(record.captions, record.tokens, strict=True):
            assert tokens == tuple(re.findall(r"[a-z]+", caption.lower()))  # lower-case, no punctuation
    first = json.loads((synth / "dataset_synthetic.json").read_text())["images"][0]
    assert set(first) >= {"filename", "filepath", "imgid", "split", "sentids", "sentences"}
    assert set(first["sentences"][0]) == {"raw", "tokens", "imgid", "sentid"}


def test_images_have_the_requested_size_and_vary(synth: Path) -> None:
    from PIL import Image

    ds = load_karpathy(synth)
    arrays = [np.asarray(Image.open(r.path)) for r in ds.split("train").images]
    assert all(a.shape == (64, 64, 3) and a.dtype == np.uint8 for a in arrays)
    assert len({a.tobytes() for a in arrays}) == len(arrays)
    scenes = load_scenes(synth).by_imgid.values()
    assert {s.background.tone for s in scenes} == set(world.BACKGROUND_TONES)


def test_attribute_coverage_over_many_scenes() -> None:
    stream = DistractorStream(600, seed=1)
    table = stream.scene_table()
    assert set(np.unique(table.shape[table.shape >= 0])) == set(range(len(world.SHAPES)))
    assert set(np.unique(table.colour[table.colour >= 0])) == set(range(len(world.COLOURS)))
    assert set(np.unique(table.size[table.size >= 0])) == {0, 1}
    assert set(np.unique(table.count)) == {1, 2, 3}
    cells = {(r, c) for r, c in zip(table.row[table.row >= 0], table.col[table.col >= 0], strict=True)}
    assert len(cells) == world.GRID * world.GRID


def test_existing_output_is_kept_without_force_and_replaced_with_it(synth: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    write_dataset(out, train=2, val=1, test=1, seed=1)
    before = _digest(out)
    with pytest.raises(FileExistsError, match="--force"):
        write_dataset(out, train=2, val=1, test=1, seed=2)
    assert _digest(out) == before
    write_dataset(out, train=3, val=1, test=1, seed=2, force=True)
    assert len(load_karpathy(out).split("train")) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]  # no partial or backup folders left


def test_interrupted_generation_leaves_previous_dataset_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "ds"
    write_dataset(out, train=2, val=1, test=1, seed=1)
    before = _digest(out)
    from icr.training.data.synthetic import generate

    calls = {"n": 0}
    real = generate._png_bytes

    def crash_after_three(image: np.ndarray) -> bytes:
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return real(image)

    monkeypatch.setattr(generate, "_png_bytes", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(out, train=10, val=1, test=1, seed=5, force=True)
    assert _digest(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--train"):
        write_dataset(tmp_path / "x", train=-1)
    with pytest.raises(ValueError, match="--image-size"):
        write_dataset(tmp_path / "x", image_size=4)
    with pytest.raises(ValueError, match="--tone-captions"):
        write_dataset(tmp_path / "x", tone_captions=1.5)
    assert not (tmp_path / "x").exists()


def test_distractor_stream_is_lazy_deterministic_and_random_access() -> None:
    stream = DistractorStream(10, seed=3, image_size=32)
    assert len(stream) == 10
    items = list(stream)
    assert [k for k, _, _ in items] == list(range(10))
    # random access and a longer stream give the same distractor k
    longer = DistractorStream(1_000_000, seed=3, image_size=32)
    for k in (0, 4, 9):
        assert np.array_equal(longer.image(k), items[k][2])
        assert longer.scene(k) == items[k][1]
    # batches resume from any start and stay within bounds
    batches = list(stream.batches(4, start=2))
    assert [b[0].tolist() for b in batches] == [[2, 3, 4, 5], [6, 7, 8, 9]]
    assert batches[0][1].shape == (4, 32, 32, 3)
    assert np.array_equal(batches[0][1][0], items[2][2])
    # the stream of a million is an iterator, not a list: taking one item draws one image
    first = next(iter(longer))
    assert first[0] == 0
    with pytest.raises(IndexError):
        stream.image(10)
    # scene-only derivation (used for relevance over millions) agrees with the rendered one
    assert all(make_scene(3, "distractor", k) == items[k][1] for k in range(10))
    # distractors differ from the dataset's own images of the same index
    assert not np.array_equal(make_image(3, "test", 0, 32)[1], items[0][2])


def test_scene_to_dict_is_dataclasses_asdict_and_round_trips() -> None:
    from dataclasses import asdict

    from icr.training.data.synthetic.scene import Scene

    for k in range(300):
        scene = make_scene(11, "distractor", k)
        naive = {"background": asdict(scene.background), "objects": [asdict(o) for o in scene.objects]}
        assert scene.to_dict() == naive
        assert Scene.from_dict(json.loads(json.dumps(scene.to_dict()))) == scene


def test_distractor_batches_rendered_in_processes_are_the_same() -> None:
    stream = DistractorStream(23, seed=5, image_size=32)
    serial = list(stream.batches(4, start=1))
    parallel = list(stream.batches(4, start=1, workers=2))  # 6 batches, at most 4 ahead
    assert len(parallel) == len(serial) == 6
    for (ids_a, images_a, scenes_a), (ids_b, images_b, scenes_b) in zip(serial, parallel, strict=True):
        assert np.array_equal(ids_a, ids_b) and np.array_equal(images_a, images_b) and scenes_a == scenes_b
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        next(stream.batches(0, workers=2))


def test_dataset_rendered_in_processes_is_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from icr.training.data.synthetic import generate

    monkeypatch.setattr(generate, "SYNTH_CHUNK", 7)  # 40 images: 6 chunks over 3 splits, some short
    monkeypatch.setattr(generate, "render_workers", lambda: 2)
    generate.write_dataset(tmp_path / "parallel", train=20, val=13, test=7, image_size=32, seed=2)
    monkeypatch.setattr(generate, "render_workers", lambda: 1)
    generate.write_dataset(tmp_path / "serial", train=20, val=13, test=7, image_size=32, seed=2)
    serial = tmp_path / "serial"
    files = sorted(p.relative_to(serial) for p in serial.rglob("*") if p.is_file())
    assert len(files) == 40 + 2  # images, Karpathy JSON, scenes
    for f in files:
        assert (tmp_path / "parallel" / f).read_bytes() == (serial / f).read_bytes(), f


def test_distractor_scene_table_serves_relevance() -> None:
    stream = DistractorStream(300, seed=4)
    table = stream.scene_table(chunk=128)  # several chunks, concatenated
    assert len(table) == 300
    q = parse_caption("a red circle")
    mask = relevance_mask(q, table)
    expected = [is_relevant(q, stream.scene(k)) for k in range(300)]
    assert mask.tolist() == expected
    assert 0 < mask.sum() < 300
    part = stream.scene_table(100, 200)
    assert relevance_mask(q, part).tolist() == expected[100:200]


def test_scene_file_errors_name_the_file(tmp_path: Path) -> None:
    from icr.training.data.errors import DatasetError

    with pytest.raises(DatasetError, match="scenes.json"):
        load_scenes(tmp_path)
    (tmp_path / "scenes.json").write_text('{"format_version": 1,\n "scenes": [')
    with pytest.raises(DatasetError, match=r"scenes.json:2:"):
        load_scenes(tmp_path)
    (tmp_path / "scenes.json").write_text('{"format_version": 99, "scenes": []}')
    with pytest.raises(DatasetError, match="--force"):
        load_scenes(tmp_path)


def _train_captions_with(synth: Path, out: Path, **mix: float) -> list[tuple[str, Any]]:
    """Write the benchmark again with a train-caption ``mix`` (tone_captions=..., count_captions=...):
    it is recorded only there, only the JSON files differ, every image and every val/test caption is
    the same. Returns each train caption with its image's scene."""
    write_dataset(out, **SMALL, seed=7, **mix)
    for name, value in mix.items():
        assert name not in load_scenes(synth).generator  # the benchmark's bytes are unchanged
        assert load_scenes(out).generator[name] == value
    before, after = (_digest(d) for d in (synth, out))
    assert {k for k in before if before[k] != after[k]} == {"dataset_synthetic.json", "scenes.json"}
    old, new = (json.loads((d / "dataset_synthetic.json").read_text())["images"] for d in (synth, out))
    scenes = load_scenes(out)
    captions = []
    for a, b in zip(old, new, strict=True):
        assert a["filename"] == b["filename"]
        if b["split"] != "train":
            assert a["sentences"] == b["sentences"]
            continue
        scene = scenes.for_imgids([b["imgid"]])[0]
        captions += [(s["raw"], scene) for s in b["sentences"]]
    return captions


def test_tone_captions_name_the_tone_in_train_captions_only(synth: Path, tmp_path: Path) -> None:
    for text, scene in _train_captions_with(synth, tmp_path / "toned", tone_captions=1.0):
        query = parse_caption(text)
        if len(query.objects) == 1:
            assert query.background == scene.background.tone, text
        assert is_relevant(text, scene), text


def test_count_captions_change_train_captions_only(synth: Path, tmp_path: Path) -> None:
    bare = 0
    for text, scene in _train_captions_with(synth, tmp_path / "counted", count_captions=1.0):
        query = parse_caption(text)
        assert is_relevant(text, scene), text
        bare += query.count is not None and not query.objects
    assert bare > 0
    with pytest.raises(ValueError, match="--count-captions"):
        write_dataset(tmp_path / "bad", **SMALL, count_captions=1.5)
