"""Precomp loader: real .npy arrays and caption .txt files written into tmp_path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from icr.training.data.errors import DatasetError
from icr.training.data.precomp import available_precomp_splits, load_precomp


def _write(folder: Path, split: str, ims: np.ndarray, captions: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / f"{split}_ims.npy", ims)
    (folder / f"{split}_caps.txt").write_text("".join(c + "\n" for c in captions), encoding="utf-8")


def _features(*shape: int) -> np.ndarray:
    # Row r is filled with r so a wrong caption->row mapping shows up in the values.
    n = shape[0]
    return np.arange(n, dtype=np.float32).reshape(n, *([1] * (len(shape) - 1))) * np.ones(shape, np.float32)


def test_five_captions_per_image(tmp_path: Path) -> None:
    folder = tmp_path / "coco_precomp"
    captions = [f"image {i} caption {j}" for i in range(3) for j in range(5)]
    _write(folder, "dev", _features(3, 8), captions)
    split = load_precomp(folder, "dev")
    assert split.im_div == 5 and len(split) == 15 and split.num_images == 3
    assert isinstance(split.images, np.memmap)  # memory-mapped, not read into RAM
    for c, caption in enumerate(split.captions):
        row = split.image_of_caption(c)
        assert caption.startswith(f"image {row} ")
        assert float(split.images[row][0]) == row
    with pytest.raises(IndexError):
        split.image_of_caption(15)


def test_one_caption_per_row(tmp_path: Path) -> None:
    _write(tmp_path, "train", _features(4, 6), ["a dog", "a cat", "two birds", "a red car"])
    split = load_precomp(tmp_path, "train")
    assert split.im_div == 1 and len(split) == 4
    assert [split.image_of_caption(c) for c in range(4)] == [0, 1, 2, 3]
    assert split.captions[2] == "two birds"


def test_region_features(tmp_path: Path) -> None:
    _write(tmp_path, "testall", _features(4, 36, 8), [f"cap {i}" for i in range(20)])
    split = load_precomp(tmp_path, "testall")
    assert split.images.shape == (4, 36, 8) and split.im_div == 5
    assert split.image_of_caption(19) == 3
    assert np.all(split.images[split.image_of_caption(12)] == 2.0)


def test_count_mismatch_names_both_files(tmp_path: Path) -> None:
    _write(tmp_path, "test", _features(3, 8), [f"cap {i}" for i in range(14)])
    with pytest.raises(DatasetError) as info:
        load_precomp(tmp_path, "test")
    message = str(info.value)
    assert "test_caps.txt" in message and "test_ims.npy" in message
    assert "14 caption lines" in message and "3 feature rows" in message and "15" in message


def test_empty_line_reports_line_number(tmp_path: Path) -> None:
    captions = [f"cap {i}" for i in range(10)]
    captions[3] = "   "
    _write(tmp_path, "dev", _features(2, 8), captions)
    with pytest.raises(DatasetError, match="empty caption line") as info:
        load_precomp(tmp_path, "dev")
    assert f"{tmp_path / 'dev_caps.txt'}:4:" in str(info.value)
    assert info.value.line == 4


def test_non_utf8_reports_line_number(tmp_path: Path) -> None:
    _write(tmp_path, "dev", _features(1, 4), ["ok"] * 5)
    (tmp_path / "dev_caps.txt").write_bytes(b"one\ntwo\nth\xffree\nfour\nfive\n")
    with pytest.raises(DatasetError, match="not UTF-8") as info:
        load_precomp(tmp_path, "dev")
    assert "dev_caps.txt:3:" in str(info.value)


def test_missing_split_lists_available(tmp_path: Path) -> None:
    _write(tmp_path, "train", _features(1, 4), ["a"] * 5)
    _write(tmp_path, "dev", _features(1, 4), ["a"] * 5)
    np.save(tmp_path / "test_ims.npy", _features(1, 4))  # captions missing: not a usable split
    assert available_precomp_splits(tmp_path) == ["dev", "train"]
    with pytest.raises(DatasetError) as info:
        load_precomp(tmp_path, "test")
    message = str(info.value)
    assert "test_caps.txt" in message and "'dev', 'train'" in message


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="folder not found") as info:
        load_precomp(tmp_path / "f30k_precomp", "test")
    assert "f30k_precomp" in str(info.value)


def test_corrupt_npy_names_file(tmp_path: Path) -> None:
    _write(tmp_path, "dev", _features(1, 4), ["a"] * 5)
    (tmp_path / "dev_ims.npy").write_bytes(b"\x93NUMPY garbage that is not a header")
    with pytest.raises(DatasetError, match="cannot read feature array") as info:
        load_precomp(tmp_path, "dev")
    assert "dev_ims.npy" in str(info.value)
