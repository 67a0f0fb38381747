"""Karpathy JSON loader: real JSON and real image files written into tmp_path."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from PIL import Image

from icr.training.data.errors import DatasetError, line_of
from icr.training.data.karpathy import (
    find_karpathy_json,
    load_image,
    load_karpathy,
    verify_images,
)
from icr.training.data.vocab import tokenize

FLICKR_SPLITS = ["train", "val", "train", "test", "train"]  # JSON order, interleaved on purpose


def _write_image(path: Path, color: tuple[int, int, int] = (200, 30, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 6), color).save(path)  # format from the suffix: real JPEG/PNG bytes


def _sentences(imgid: int, filename: str, count: int, with_tokens: bool = True) -> list[dict]:
    sentences = []
    for j in range(count):
        raw = f"A photo of {filename.split('.')[0]}, caption {j}."
        sentence = {"raw": raw, "imgid": imgid, "sentid": imgid * 10 + j}
        if with_tokens:
            sentence["tokens"] = tokenize(raw)
        sentences.append(sentence)
    return sentences


def _flickr_data() -> dict:
    images = []
    for i, split in enumerate(FLICKR_SPLITS):
        filename = f"img{i}.jpg"
        # Image 1 has no "tokens": the loader must tokenize the raw captions itself.
        sentences = _sentences(i, filename, 5, with_tokens=i != 1)
        images.append(
            {
                "filename": filename,
                "imgid": i,
                "split": split,
                "sentids": [s["sentid"] for s in sentences],
                "sentences": sentences,
            }
        )
    return {"dataset": "flickr30k", "images": images}


def _write_json(path: Path, data: dict) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2)
    path.write_text(text, encoding="utf-8")
    return text


@pytest.fixture
def flickr(tmp_path: Path) -> Path:
    """dataset_flickr30k.json with the images beside it (no filepath, like Flickr30k)."""
    root = tmp_path / "flickr30k"
    data = _flickr_data()
    _write_json(root / "dataset_flickr30k.json", data)
    for entry in data["images"]:
        _write_image(root / entry["filename"])
    return root / "dataset_flickr30k.json"


COCO_ENTRIES = [  # (filename, filepath, split, number of captions)
    ("COCO_train2014_000000000009.jpg", "train2014", "train", 5),
    ("COCO_val2014_000000000042.jpg", "val2014", "restval", 5),
    ("COCO_val2014_000000000073.jpg", "val2014", "val", 5),
    ("COCO_val2014_000000000074.jpg", "val2014", "test", 5),
    ("COCO_train2014_000000000025.jpg", "train2014", "train", 7),
]


@pytest.fixture
def coco(tmp_path: Path) -> tuple[Path, Path]:
    """dataset_coco.json with images under a separate root in train2014/ and val2014/."""
    image_root = tmp_path / "coco_images"
    images = []
    for i, (filename, filepath, split, count) in enumerate(COCO_ENTRIES):
        sentences = _sentences(i, filename, count)
        images.append(
            {
                "filepath": filepath,
                "filename": filename,
                "cocoid": 1000 + i,
                "imgid": i,
                "split": split,
                "sentids": [s["sentid"] for s in sentences],
                "sentences": sentences,
            }
        )
        _write_image(image_root / filepath / filename, color=(i * 40, 100, 50))
    json_path = tmp_path / "annotations" / "dataset_coco.json"
    _write_json(json_path, {"dataset": "coco", "images": images})
    return json_path, image_root


def _line_containing(text: str, needle: str) -> int:
    """1-based line computed independently of the code under test."""
    return next(n for n, line in enumerate(text.splitlines(), start=1) if needle in line)


# ----------------------------------------------------------------------------- happy paths


def test_flickr_splits_order_grouping_and_paths(flickr: Path) -> None:
    ds = load_karpathy(flickr)
    assert ds.name == "flickr30k"
    assert ds.image_root == flickr.parent
    assert {name: len(split) for name, split in ds.splits.items()} == {"train": 3, "val": 1, "test": 1}

    train = ds.split("train")
    assert [r.filename for r in train.images] == ["img0.jpg", "img2.jpg", "img4.jpg"]  # JSON order
    assert len(train.captions) == 15 and len(train.caption_tokens) == 15
    for c, caption in enumerate(train.captions):
        image = train.images[train.image_of_caption(c)]
        assert train.image_of_caption(c) == c // 5
        assert caption == f"A photo of {image.filename[:-4]}, caption {c % 5}."
    for record in train.images:
        assert record.path == flickr.parent / record.filename
        assert record.path.is_file()
        assert record.cocoid is None
        assert record.split == record.source_split == "train"
    with pytest.raises(IndexError):
        train.image_of_caption(15)


def test_tokens_fall_back_to_tokenizing_raw(flickr: Path) -> None:
    record = load_karpathy(flickr).split("val").images[0]  # img1 has no "tokens" in the JSON
    assert record.filename == "img1.jpg"
    assert record.tokens[0] == ("a", "photo", "of", "img1", "caption", "0")
    assert record.sentids == (10, 11, 12, 13, 14)


def test_directory_argument_finds_the_json(flickr: Path) -> None:
    assert find_karpathy_json(flickr.parent) == flickr
    assert len(load_karpathy(flickr.parent).split("test")) == 1


def test_coco_restval_folded_into_train(coco: tuple[Path, Path]) -> None:
    json_path, image_root = coco
    ds = load_karpathy(json_path, image_root)
    assert set(ds.splits) == {"train", "val", "test"}
    train = ds.split("train")
    assert [r.cocoid for r in train.images] == [1000, 1001, 1004]  # restval keeps its JSON position
    assert [r.source_split for r in train.images] == ["train", "restval", "train"]
    assert all(r.split == "train" for r in train.images)
    for record, (filename, filepath, _, _) in zip(
        train.images, [COCO_ENTRIES[i] for i in (0, 1, 4)], strict=True
    ):
        assert record.path == image_root / filepath / filename
    with pytest.raises(DatasetError, match="fold_restval=False"):
        ds.split("restval")


def test_coco_restval_kept_separate(coco: tuple[Path, Path]) -> None:
    json_path, image_root = coco
    ds = load_karpathy(json_path, image_root, fold_restval=False)
    assert {n: len(s) for n, s in ds.splits.items()} == {"train": 2, "restval": 1, "val": 1, "test": 1}
    assert ds.split("restval").images[0].filename == COCO_ENTRIES[1][0]


def test_coco_seven_captions_keep_first_five_in_order(coco: tuple[Path, Path]) -> None:
    json_path, image_root = coco
    train = load_karpathy(json_path, image_root).split("train")
    record = train.images[2]
    assert record.filename == COCO_ENTRIES[4][0]
    assert record.captions == tuple(f"A photo of {record.filename[:-4]}, caption {j}." for j in range(5))
    assert record.sentids == (40, 41, 42, 43, 44)
    assert len(record.tokens) == 5
    # The 6th/7th captions must not leak into the grouping: 15 captions for 3 images.
    assert len(train.captions) == 15
    assert train.captions[10:15] == list(record.captions)


# ----------------------------------------------------------------------------- errors


def test_missing_json(tmp_path: Path) -> None:
    missing = tmp_path / "dataset_flickr30k.json"
    with pytest.raises(DatasetError, match="dataset JSON not found") as info:
        load_karpathy(missing)
    assert str(missing) in str(info.value)


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    json_path = tmp_path / "dataset_flickr30k.json"
    lines = json.dumps(_flickr_data(), indent=2).splitlines()
    bad = _line_containing("\n".join(lines), '"split": "test"')
    lines[bad - 1] = lines[bad - 1].replace('"test"', '"test" "oops"')  # missing comma
    json_path.write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(DatasetError, match="malformed JSON") as info:
        load_karpathy(json_path, check_images=False)
    assert f"dataset_flickr30k.json:{bad}:" in str(info.value)
    assert info.value.line == bad


def test_image_with_four_captions_names_image_split_and_line(tmp_path: Path) -> None:
    data = _flickr_data()
    del data["images"][3]["sentences"][-1]
    json_path = tmp_path / "dataset_flickr30k.json"
    text = _write_json(json_path, data)
    with pytest.raises(DatasetError) as info:
        load_karpathy(json_path, check_images=False)
    message = str(info.value)
    line = _line_containing(text, '"filename": "img3.jpg"')
    assert f"dataset_flickr30k.json:{line}:" in message
    assert "img3.jpg" in message and "'test'" in message and "4 caption" in message


def test_missing_required_key_names_entry_and_line(tmp_path: Path) -> None:
    data = _flickr_data()
    del data["images"][2]["split"]
    json_path = tmp_path / "dataset_flickr30k.json"
    text = _write_json(json_path, data)
    with pytest.raises(DatasetError) as info:
        load_karpathy(json_path, check_images=False)
    message = str(info.value)
    assert "image entry 2" in message and "img2.jpg" in message and "'split'" in message
    line = _line_containing(text, '"filename": "img2.jpg"')
    assert f"dataset_flickr30k.json:{line}:" in message


def test_missing_top_level_images(tmp_path: Path) -> None:
    json_path = tmp_path / "dataset_coco.json"
    _write_json(json_path, {"dataset": "coco", "annotations": []})
    with pytest.raises(DatasetError, match='"images"') as info:
        load_karpathy(json_path)
    assert "dataset_coco.json" in str(info.value)


def test_missing_image_file(flickr: Path) -> None:
    (flickr.parent / "img2.jpg").unlink()
    with pytest.raises(DatasetError) as info:
        load_karpathy(flickr)
    message = str(info.value)
    assert "1 of 5 image files" in message
    assert str(flickr.parent / "img2.jpg") in message
    assert "image_root" in message
    # Captions alone still load when asked to.
    assert len(load_karpathy(flickr, check_images=False).split("train")) == 3


def test_wrong_image_root_is_reported(coco: tuple[Path, Path], tmp_path: Path) -> None:
    json_path, _ = coco
    with pytest.raises(DatasetError, match="5 of 5") as info:
        load_karpathy(json_path, tmp_path / "nowhere")
    assert "does not exist" in str(info.value)


def test_file_that_is_not_an_image(flickr: Path) -> None:
    broken = flickr.parent / "img4.jpg"
    broken.write_bytes(b"this is not a JPEG")
    train = load_karpathy(flickr).split("train")  # existence check passes; decoding does not
    with pytest.raises(DatasetError, match="cannot decode") as info:
        load_image(broken)
    assert str(broken) in str(info.value)

    with pytest.raises(DatasetError) as info:
        verify_images(train)
    message = str(info.value)
    assert "1 of 3 images" in message and str(broken) in message
    assert "img0.jpg" not in message and "img2.jpg" not in message


def test_verify_images_counts_good_images(flickr: Path) -> None:
    ds = load_karpathy(flickr)
    assert verify_images(ds.split("train")) == 3
    assert verify_images(ds.split("val").images + ds.split("test").images) == 2


def test_load_image_converts_to_rgb_and_reports_missing(tmp_path: Path) -> None:
    gray = tmp_path / "gray.png"
    Image.new("L", (5, 4), 128).save(gray)
    image = load_image(gray)
    assert image.mode == "RGB" and image.size == (5, 4)
    assert image.getpixel((0, 0)) == (128, 128, 128)
    with pytest.raises(DatasetError, match="not found") as info:
        load_image(tmp_path / "absent.jpg")
    assert "absent.jpg" in str(info.value)


def test_unknown_split_lists_available(flickr: Path) -> None:
    with pytest.raises(DatasetError) as info:
        load_karpathy(flickr).split("dev")
    message = str(info.value)
    assert "'dev'" in message and "'train', 'val', 'test'" in message and "dataset_flickr30k.json" in message


def test_find_karpathy_json_none_or_several(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text("{}", encoding="utf-8")
    with pytest.raises(DatasetError, match="no Karpathy split file") as info:
        find_karpathy_json(tmp_path)
    assert "other.json" in str(info.value)
    (tmp_path / "dataset_coco.json").write_text("{}", encoding="utf-8")
    (tmp_path / "dataset_flickr30k.json").write_text("{}", encoding="utf-8")
    with pytest.raises(DatasetError, match="dataset_coco.json, dataset_flickr30k.json"):
        find_karpathy_json(tmp_path)


def test_line_of_and_error_pickling(tmp_path: Path) -> None:
    text = '{\n  "a": 1,\n  "b": "x.jpg"\n}'
    assert line_of(text, '"x.jpg"') == 3
    assert line_of(text, "{") == 1
    assert line_of(text, "missing") is None
    err = DatasetError("bad thing.", path=tmp_path / "f.json", line=3, hint="Fix it.")
    assert str(err) == f"{tmp_path / 'f.json'}:3: bad thing. Fix it."
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == str(err) and copy.line == 3 and isinstance(copy, ValueError)
