"""Tokenizer and vocabulary, including the train-only rule on a real Karpathy JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from icr.training.data.errors import DatasetError
from icr.training.data.karpathy import load_karpathy
from icr.training.data.precomp import load_precomp
from icr.training.data.vocab import Vocabulary, build_training_vocab, build_vocab_from_split, tokenize


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("A man riding a HORSE.", ["a", "man", "riding", "a", "horse"]),
        ("It's a dog's toy!", ["it's", "a", "dog's", "toy"]),
        ("It\u2019s raining", ["it's", "raining"]),
        ("a t-shirt, jeans; and 2 hats...", ["a", "t", "shirt", "jeans", "and", "2", "hats"]),
        ("  spaces\tand\nnewlines  ", ["spaces", "and", "newlines"]),
        ("'quoted' words'", ["quoted", "words"]),
        ("Café crème", ["café", "crème"]),
        ("?!", []),
    ],
)
def test_tokenize(text: str, tokens: list[str]) -> None:
    assert tokenize(text) == tokens


def test_build_orders_by_count_then_alphabet() -> None:
    vocab = Vocabulary.build([["b", "a"], ["a", "c"], ["c", "a"], ["d"]])
    assert vocab.itos == ("<pad>", "<start>", "<end>", "<unk>", "a", "c", "b", "d")
    assert len(vocab) == 8
    assert Vocabulary.build([["b", "a"], ["a", "c"], ["c", "a"], ["d"]], min_count=2).itos[4:] == ("a", "c")


def _write_karpathy(folder: Path) -> Path:
    captions = {
        "train": "a dog runs on the grass",
        "restval": "a kangaroo jumps",
        "val": "a zebra stands",
        "test": "a giraffe eats leaves",
    }
    images = []
    for i, (split, caption) in enumerate(captions.items()):
        sentences = [
            {"raw": f"{caption} {j}", "tokens": tokenize(caption), "sentid": 5 * i + j} for j in range(5)
        ]
        images.append({"filename": f"{i}.jpg", "imgid": i, "split": split, "sentences": sentences})
    path = folder / "dataset_coco.json"
    path.write_text(json.dumps({"dataset": "coco", "images": images}, indent=2), encoding="utf-8")
    return path


def test_training_vocab_excludes_val_and_test_words(tmp_path: Path) -> None:
    ds = load_karpathy(_write_karpathy(tmp_path), check_images=False)
    vocab = build_training_vocab(ds)
    assert "dog" in vocab and "grass" in vocab
    assert "kangaroo" in vocab  # restval is folded into train, so its words are training words
    assert "zebra" not in vocab and "giraffe" not in vocab and "leaves" not in vocab
    assert vocab.encode("a zebra", add_special=False) == [vocab.id_of("a"), Vocabulary.UNK]
    # Building from the evaluation split would have included them: that is the leak avoided.
    assert "zebra" in build_vocab_from_split(ds.split("val"))


def test_vocab_from_precomp_split(tmp_path: Path) -> None:
    np.save(tmp_path / "train_ims.npy", np.zeros((1, 4), np.float32))
    (tmp_path / "train_caps.txt").write_text("A cat.\nA cat sits.\nCat!\nthe mat\nA mat\n", encoding="utf-8")
    vocab = build_vocab_from_split(load_precomp(tmp_path, "train"))
    assert vocab.itos[4:] == ("a", "cat", "mat", "sits", "the")


def test_encode_decode_round_trip() -> None:
    vocab = Vocabulary.build([tokenize("a dog runs on the grass"), tokenize("a cat sleeps")])
    ids = vocab.encode("A dog runs on the grass.")
    assert ids[0] == Vocabulary.START and ids[-1] == Vocabulary.END
    assert vocab.decode(ids) == "a dog runs on the grass"
    assert vocab.encode(["a", "cat"], add_special=False) == [vocab.id_of("a"), vocab.id_of("cat")]
    assert vocab.encode("a unicorn", add_special=False)[1] == 3
    # Padding after <end> (as in a padded batch) is ignored.
    assert vocab.decode([*vocab.encode("a cat sleeps"), 0, 0]) == "a cat sleeps"
    assert vocab.decode(vocab.encode("a unicorn")) == "a <unk>"
    with pytest.raises(IndexError):
        vocab.decode([len(vocab)])


def test_save_load_round_trip(tmp_path: Path) -> None:
    vocab = Vocabulary.build([tokenize("a dog runs"), tokenize("a dog sleeps")])
    path = vocab.save(tmp_path / "nested" / "vocab.json")
    loaded = Vocabulary.load(path)
    assert loaded == vocab and loaded.itos == vocab.itos
    assert loaded.encode("a dog sleeps") == vocab.encode("a dog sleeps")
    assert json.loads(path.read_text(encoding="utf-8"))["format_version"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["vocab.json"]  # no temp file left behind


def test_corrupt_vocab_file(tmp_path: Path) -> None:
    path = tmp_path / "vocab.json"
    path.write_text('{\n  "format_version": 1,\n  "words": ["a", \n', encoding="utf-8")
    with pytest.raises(DatasetError, match="malformed JSON") as info:
        Vocabulary.load(path)
    assert f"{path}:4:" in str(info.value)

    path.write_text(json.dumps({"format_version": 99, "words": []}), encoding="utf-8")
    with pytest.raises(DatasetError, match="format_version 99") as info:
        Vocabulary.load(path)
    assert str(path) in str(info.value)

    path.write_text(json.dumps({"format_version": 1, "words": ["a", "a"]}), encoding="utf-8")
    with pytest.raises(DatasetError, match="duplicate"):
        Vocabulary.load(path)

    with pytest.raises(DatasetError, match="not found"):
        Vocabulary.load(tmp_path / "absent.json")
