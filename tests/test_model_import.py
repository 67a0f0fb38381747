"""`icr model import` and `icr.load`: a stock CLIP / SigLIP folder as a checkpoint with no training,
and any checkpoint as an encoder of captions and images.

The oracle is the stock transformers model: its ``get_text_features`` / ``get_image_features`` on
what its own processor (``AutoProcessor`` from the saved folder: the PIL image processors, no
torchvision) makes of the captions and images, L2-normalised. The folders are the tiny random ones
of ``test_pretrained_towers.py``, each with its family's processor file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_pretrained_towers import CAPTIONS, CLIP_DIM, SIGLIP_DIM, random_images, write_folder
from typer.testing import CliRunner

import icr
from icr.cli import app
from icr.core.atomic import sha256_file
from icr.training.checkpoint import load_checkpoint, read_checkpoint_config
from icr.training.data.karpathy import load_image, load_karpathy
from icr.training.pretrained_import import import_stock_model

# sizes that exercise the resize and the crop (CLIP: shorter side to 36, crop 32; SigLIP: 32 x 32)
IMAGE_SIZES = [(40, 50), (32, 32), (64, 33), (90, 31)]


def siglip_processor_folder(folder: Path) -> Path:
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    write_folder(folder, "siglip", processor=False)
    SiglipImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> a tiny stock folder with its tokenizer and its processor file."""
    return {
        "clip": write_folder(tmp_path_factory.mktemp("stock-clip"), "clip", processor=True),
        "siglip": siglip_processor_folder(tmp_path_factory.mktemp("stock-siglip")),
    }


@pytest.fixture(scope="module")
def imported(stock: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> its imported checkpoint, written through the CLI."""
    out = tmp_path_factory.mktemp("imported")
    result = {}
    for family, folder in stock.items():
        run = CliRunner().invoke(app, ["model", "import", str(folder), "--out", str(out / family)])
        assert run.exit_code == 0, run.output
        assert "weights_sha256" in run.output and "loading the model" in run.output
        result[family] = out / family
    return result


def stock_embeddings(folder: Path, family: str, images: list[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
    """(captions, images) as the stock model embeds them, each row L2-normalised."""
    from transformers import AutoModel, AutoProcessor

    model = AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
    # the PIL image processor, which icr's preprocessing reproduces: with torchvision installed (the
    # [gpu] extra) transformers picks its "fast" processor, whose resize differs by ~1e-3
    processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True, use_fast=False)
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        if family == "siglip":  # padded to the longest length, no mask: SigLIP's documented use
            length = model.config.text_config.max_position_embeddings
            ids = processor(text=CAPTIONS, padding="max_length", max_length=length, return_tensors="pt")
            text = model.get_text_features(input_ids=ids["input_ids"]).pooler_output
        else:
            tokens = processor(text=CAPTIONS, padding=True, return_tensors="pt")
            text = model.get_text_features(
                input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
            ).pooler_output
        image = model.get_image_features(pixel_values=pixels).pooler_output
    norm = torch.nn.functional.normalize
    return norm(text, dim=-1).numpy(), norm(image, dim=-1).numpy()


def assert_same_directions(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose((ours * theirs).sum(axis=1), 1.0, atol=1e-5)  # cosine
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def assert_same_weights(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    mine, stock = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == stock.keys()
    assert all(torch.equal(mine[name], stock[name]) for name in stock)


# --- the imported checkpoint equals the stock model -----------------------------------------------
@pytest.mark.parametrize(("family", "dim"), [("clip", CLIP_DIM), ("siglip", SIGLIP_DIM)])
def test_imported_embeddings_are_the_stock_models(
    family: str, dim: int, stock: dict[str, Path], imported: dict[str, Path], tmp_path: Path
) -> None:
    images = random_images(IMAGE_SIZES, seed=4)
    ref_text, ref_image = stock_embeddings(stock[family], family, images)
    encoder = icr.load(imported[family], device="cpu")
    assert encoder.dim == dim and encoder.device == "cpu"
    assert_same_directions(encoder.encode_text(CAPTIONS), ref_text)
    assert_same_directions(encoder.encode_images(images), ref_image)
    # files decode to the same vectors, batched or not
    paths = []
    for i, image in enumerate(images):
        paths.append(tmp_path / f"{i}.png")
        image.save(paths[-1])
    assert_same_directions(encoder.encode_images(paths, batch_size=3), ref_image)
    assert_same_directions(encoder.encode_text(CAPTIONS, batch_size=1), ref_text)


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_the_checkpoint_is_the_frozen_model_and_says_where_it_came_from(
    family: str, stock: dict[str, Path], imported: dict[str, Path]
) -> None:
    meta = read_checkpoint_config(imported[family])
    origin = meta.as_dict()["imported_from"]
    assert origin["path"] == str(stock[family].resolve()) and origin["model_type"] == family
    assert origin["weights_sha256"] == {"model.safetensors": sha256_file(stock[family] / "model.safetensors")}
    assert meta.step is None and meta.epoch is None and meta.objective is None and meta.data is None
    assert meta.model["image"]["finetune"] is False and meta.model["text"]["finetune"] is False
    assert meta.model["image"]["processor"] is not None  # the folder's own file, recorded
    assert meta.tokenizer == "tokenizer"
    # the pretrained projection heads and logit scale, as loaded
    from transformers import AutoModel

    reference = AutoModel.from_pretrained(str(stock[family]), local_files_only=True)
    model, _ = load_checkpoint(imported[family])
    assert model.logit_scale is not None
    assert model.logit_scale.item() == pytest.approx(reference.logit_scale.item(), rel=1e-6)
    assert origin["pretrained_logit_scale"] == pytest.approx(reference.logit_scale.item(), rel=1e-6)
    for ours, theirs in (
        (model.image_encoder, reference.vision_model),
        (model.text_encoder, reference.text_model),
    ):
        assert_same_weights(ours.model, theirs)
    if family == "clip":  # the projections live beside the transformers (SigLIP's heads inside them)
        assert torch.equal(model.image_encoder.proj.weight, reference.visual_projection.weight)
        assert torch.equal(model.text_encoder.proj.weight, reference.text_projection.weight)


def test_the_checkpoint_loads_without_the_folder(stock: dict[str, Path], tmp_path: Path) -> None:
    folder = Path(shutil.copytree(stock["clip"], tmp_path / "clip"))
    import_stock_model(folder, tmp_path / "ckpt")
    text = icr.load(tmp_path / "ckpt").encode_text(CAPTIONS)
    shutil.rmtree(folder)
    np.testing.assert_array_equal(icr.load(tmp_path / "ckpt").encode_text(CAPTIONS), text)


# --- icr.load on a trained checkpoint --------------------------------------------------------------
def test_load_equals_the_checkpoints_own_encoders(tiny_checkpoint: Path, tiny_benchmark: Path) -> None:
    """A trained checkpoint (CNN + GRU): icr.load against load_checkpoint + the model called directly."""
    model, _ = load_checkpoint(tiny_checkpoint)
    files = [
        tiny_benchmark / "images" / r.filename for r in load_karpathy(tiny_benchmark).split("test").images
    ]
    captions = ["a red circle", "two blue squares on the left", "a green triangle at the top right"]
    transform = model.image_transform(train=False)
    odd = random_images([(50, 41)], seed=5)  # not the training size: resized and cropped
    with torch.no_grad():
        direct_images = model.encode_image(
            torch.stack([transform(load_image(f)) for f in files] + [transform(odd[0])])
        ).numpy()
        direct_text = model.encode_text(model.tokenize(captions)).numpy()

    encoder = icr.load(tiny_checkpoint, device="cpu", batch_size=5)
    assert encoder.dim == model.embed_dim and encoder.meta.step is not None
    np.testing.assert_allclose(encoder.encode_images([*files, odd[0]]), direct_images, atol=1e-6)
    np.testing.assert_allclose(encoder.encode_text(captions), direct_text, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(encoder.encode_text(captions), axis=1), 1.0, atol=1e-5)
    assert encoder.encode_text([]).shape == (0, model.embed_dim)
    assert encoder.encode_images([]).shape == (0, model.embed_dim)


def test_load_names_the_bad_input(tiny_checkpoint: Path, tmp_path: Path) -> None:
    encoder = icr.load(tiny_checkpoint, device="cpu")
    good = tmp_path / "good.png"
    random_images([(32, 32)])[0].save(good)
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match=r"broken\.jpg: cannot decode image \(images\[1\]\)"):
        encoder.encode_images([good, broken])
    with pytest.raises(FileNotFoundError, match=r"missing\.png: image file not found"):
        encoder.encode_images([str(tmp_path / "missing.png")])
    wide = tmp_path / "wide.png"
    Image.new("RGB", (400, 10)).save(wide)  # beyond the gallery's aspect-ratio bound
    with pytest.raises(ValueError, match=r"wide\.png: .*aspect ratio"):
        encoder.encode_images([wide])
    with pytest.raises(ValueError, match="wrap it"):
        encoder.encode_images(good)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wrap it"):
        encoder.encode_text("a red circle")
    with pytest.raises(ValueError, match=r"images\[0\] is a int"):
        encoder.encode_images([3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="device must be one of"):
        icr.load(tiny_checkpoint, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            icr.load(tiny_checkpoint, device="cuda")
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        icr.load(tmp_path / "nowhere")


# --- the command's errors -------------------------------------------------------------------------
def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["model", "import", *args])
    return result.exit_code, result.output


def test_help_has_examples() -> None:
    code, output = invoke("--help")
    assert code == 0 and "Examples" in output and "icr model import" in output


def test_import_refuses_folders_it_cannot_import(stock: dict[str, Path], tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    code, output = invoke(str(tmp_path / "nowhere"), "--out", str(tmp_path / "a"))
    assert code == 2 and "nowhere: model folder not found" in output and "Traceback" not in output

    code, output = invoke(str(tmp_path), "--out", str(tmp_path / "a"))
    assert code == 2 and "no config.json" in output

    bert = tmp_path / "bert"
    BertModel(
        BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    ).save_pretrained(bert)
    code, output = invoke(str(bert), "--out", str(tmp_path / "a"))
    assert code == 2 and "model_type 'bert' cannot be imported" in output
    assert "'clip' (CLIPModel), 'siglip' (SiglipModel)" in output

    no_tokenizer = Path(shutil.copytree(stock["clip"], tmp_path / "no-tokenizer"))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (no_tokenizer / name).unlink(missing_ok=True)
    code, output = invoke(str(no_tokenizer), "--out", str(tmp_path / "a"))
    assert code == 2 and "no tokenizer files" in output and "CLIPProcessor.from_pretrained" in output

    no_processor = Path(shutil.copytree(stock["siglip"], tmp_path / "no-processor"))
    (no_processor / "preprocessor_config.json").unlink()
    code, output = invoke(str(no_processor), "--out", str(tmp_path / "a"))
    assert code == 2 and "no preprocessor_config.json" in output and "SiglipProcessor" in output

    no_weights = Path(shutil.copytree(stock["clip"], tmp_path / "no-weights"))
    (no_weights / "model.safetensors").unlink()
    code, output = invoke(str(no_weights), "--out", str(tmp_path / "a"))
    assert code == 2 and "no weights" in output
    assert not (tmp_path / "a").exists()


def test_import_never_replaces_a_folder_that_is_not_a_checkpoint(
    stock: dict[str, Path], tmp_path: Path
) -> None:
    taken = tmp_path / "photos"
    taken.mkdir()
    (taken / "holiday.jpg").write_bytes(b"precious")
    code, output = invoke(str(stock["clip"]), "--out", str(taken), "--force")
    assert code == 2 and "is not a checkpoint; refusing to replace it" in output
    assert (taken / "holiday.jpg").read_bytes() == b"precious"

    out = tmp_path / "ckpt"
    assert invoke(str(stock["clip"]), "--out", str(out), "--quiet")[0] == 0
    code, output = invoke(str(stock["siglip"]), "--out", str(out))
    assert code == 2 and "already holds a checkpoint" in output and "--force" in output
    assert read_checkpoint_config(out).as_dict()["imported_from"]["model_type"] == "clip"
    code, output = invoke(str(stock["siglip"]), "--out", str(out), "--force", "--quiet")
    assert code == 0 and "loading the model" not in output
    assert read_checkpoint_config(out).as_dict()["imported_from"]["model_type"] == "siglip"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_on_cuda_equals_the_cpu(imported: dict[str, Path]) -> None:
    images = random_images(IMAGE_SIZES, seed=6)
    for checkpoint in imported.values():
        cpu, gpu = icr.load(checkpoint, device="cpu"), icr.load(checkpoint, device="auto")
        assert gpu.device == "cuda"
        np.testing.assert_allclose(gpu.encode_text(CAPTIONS), cpu.encode_text(CAPTIONS), atol=1e-4)
        np.testing.assert_allclose(gpu.encode_images(images), cpu.encode_images(images), atol=1e-4)
