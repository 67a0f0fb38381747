"""Pretrained CLIP / SigLIP towers (image and text kind "clip") from tiny random local folders.

The folders are written here with save_pretrained (nothing is downloaded): 2 layers, hidden 32,
32 x 32 images in 8 x 8 patches, a character-level CLIP tokenizer. SigLIP's own tokenizer needs
sentencepiece, which is not installed, so the SigLIP folder carries the same CLIP tokenizer: the
tower loads whatever AutoTokenizer loads from the folder.
"""

from __future__ import annotations

import json
import math
import shutil
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.testing import assert_close

from icr.training.checkpoint import load_checkpoint, save_checkpoint
from icr.training.config import load_config
from icr.training.models import DualEncoder, build_model
from icr.training.models.clip_towers import processor_preprocessing

CAPTIONS = ["a red circle on the left", "two blue squares at the top", "a green triangle"]
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
CLIP_DIM, SIGLIP_DIM = 16, 32  # CLIP: projection_dim; SigLIP: the vision hidden size
CLIP_LOGIT_SCALE = 2.6592  # CLIPConfig's logit_scale_init_value
SIGLIP_LOGIT_SCALE = math.log(10.0)


def tiny_tokenizer():
    """A character-level CLIP BPE tokenizer (no merges): a-z, digits, punctuation, two specials."""
    from transformers import CLIPTokenizer

    chars = list(string.ascii_lowercase + string.digits + ",.'-")
    vocab = {token: i for i, token in enumerate([*chars, *(c + "</w>" for c in chars)])}
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[])


def write_folder(folder: Path, family: str, processor: bool) -> Path:
    """A tiny random CLIPModel or SiglipModel folder, as a user would save the real one."""
    from transformers import CLIPConfig, CLIPModel, SiglipConfig, SiglipModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = tiny_tokenizer()
    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {**TINY, "image_size": 32, "patch_size": 8}
    torch.manual_seed(0)
    if family == "clip":
        text = {**TINY, **ids, "max_position_embeddings": 64}
        model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=CLIP_DIM))
    else:
        text = {**TINY, **ids, "max_position_embeddings": 48, "projection_size": SIGLIP_DIM}
        model = SiglipModel(SiglipConfig(text_config=text, vision_config=vision))
        with torch.no_grad():
            model.logit_scale.fill_(SIGLIP_LOGIT_SCALE)  # random init is 0; a trained model's is not
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if processor:  # shorter side to 36, centre crop 32: exercises both steps on the 32 px benchmark
        CLIPImageProcessorPil(
            size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32}
        ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_folder(tmp_path_factory.mktemp("tiny-clip"), "clip", processor=True)


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_folder(tmp_path_factory.mktemp("tiny-siglip"), "siglip", processor=False)


def folder_of(family: str, request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{family}_dir")


def clip_config(folder: Path, dim: int, **tower: object) -> dict:
    return {
        "embed_dim": dim,
        "image": {"kind": "clip", "path": str(folder), **tower},
        "text": {"kind": "clip", "path": str(folder), **tower},
    }


def random_images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def embed(
    model: DualEncoder, images: list[Image.Image], captions: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    transform = model.image_transform(train=False)
    pixels = torch.stack([transform(im) for im in images])  # (B, 3, 32, 32)
    with torch.no_grad():
        return model.encode_image(pixels), model.encode_text(model.tokenize(captions))


# --- embeddings -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("family", "dim"), [("clip", CLIP_DIM), ("siglip", SIGLIP_DIM)])
def test_embeddings_are_the_models_own_features_normalised(family: str, dim: int, request) -> None:
    from transformers import AutoModel

    folder = folder_of(family, request)
    model = build_model(clip_config(folder, dim)).eval()
    images = random_images([(40, 50), (32, 32), (64, 33)])
    img, cap = embed(model, images, CAPTIONS)
    assert img.shape == (3, dim) and cap.shape == (3, dim)
    assert_close(img.norm(dim=1), torch.ones(3), atol=1e-5, rtol=0)
    assert_close(cap.norm(dim=1), torch.ones(3), atol=1e-5, rtol=0)

    # the same numbers as the HF model's get_*_features, L2-normalised
    reference = AutoModel.from_pretrained(
        str(folder), local_files_only=True, attn_implementation="sdpa"
    ).eval()
    transform = model.image_transform(train=False)
    pixels = torch.stack([transform(im) for im in images])
    batch = model.tokenize(CAPTIONS)
    with torch.no_grad():
        ref_img = reference.get_image_features(pixel_values=pixels).pooler_output
        if family == "siglip":  # padded to max_len, no mask: as SigLIP was trained
            assert batch["input_ids"].shape[1] == 48
            ref_cap = reference.get_text_features(input_ids=batch["input_ids"]).pooler_output
        else:
            ref_cap = reference.get_text_features(**batch).pooler_output
    assert_close(img, torch.nn.functional.normalize(ref_img, dim=-1), atol=1e-5, rtol=1e-5)
    assert_close(cap, torch.nn.functional.normalize(ref_cap, dim=-1), atol=1e-5, rtol=1e-5)


def test_a_byte_level_tokenizer_has_no_unknown_words(clip_dir: Path) -> None:
    """CLIP's BPE spells any word: no query is outside the evidence for unknown words (the calibration's
    n-gram evidence has to tell instead)."""
    model = build_model(clip_config(clip_dir, CLIP_DIM))
    assert model.unknown_words("qwerty the eiffel tower at night") == []


def test_one_folder_can_serve_one_tower_beside_another_kind(clip_dir: Path) -> None:
    cfg = {
        "embed_dim": CLIP_DIM,
        "image": {"kind": "clip", "path": str(clip_dir)},
        "text": {"kind": "gru", "word_dim": 8, "hidden": 16},
    }
    from icr.training.data.vocab import Vocabulary

    model = build_model(cfg, Vocabulary.build([c.split() for c in CAPTIONS])).eval()
    img, cap = embed(model, random_images([(32, 32)]), CAPTIONS[:2])
    assert img.shape == (1, CLIP_DIM) and cap.shape == (2, CLIP_DIM)
    assert model.logit_scale is not None  # "auto": a clip tower brings its logit scale


# --- training modes -------------------------------------------------------------------------------
def trainable(model: DualEncoder, tower: str) -> set[str]:
    encoder = model.image_encoder if tower == "image" else model.text_encoder
    return {name for name, p in encoder.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(("family", "dim"), [("clip", CLIP_DIM), ("siglip", SIGLIP_DIM)])
def test_frozen_last_n_and_full_train_the_stated_parameters(family: str, dim: int, request) -> None:
    folder = folder_of(family, request)
    full = build_model(clip_config(folder, dim))
    every = {t: {n for n, _ in getattr(full, f"{t}_encoder").named_parameters()} for t in ("image", "text")}
    assert trainable(full, "image") == every["image"] and trainable(full, "text") == every["text"]

    frozen = build_model(clip_config(folder, dim, finetune=False)).train()
    assert trainable(frozen, "image") == set() and trainable(frozen, "text") == set()
    assert not frozen.image_encoder.model.training and not frozen.text_encoder.model.training

    last = build_model(clip_config(folder, dim, finetune_last_n=1))
    top = {
        "image": ("model.post_layernorm.", "proj." if family == "clip" else "model.head."),
        "text": ("model.final_layer_norm.", "proj." if family == "clip" else "model.head."),
    }
    for tower in ("image", "text"):
        expected = {n for n in every[tower] if n.startswith(("model.encoder.layers.1.", *top[tower]))}
        assert trainable(last, tower) == expected
        assert not any(".layers.0." in n or "embeddings" in n for n in expected)
    # last 0: only the final norm and the projection; the flag is recorded and reversible
    none = build_model(clip_config(folder, dim, finetune_last_n=0))
    assert all(n.startswith(top["image"]) for n in trainable(none, "image"))
    none.set_finetune(image=False)
    assert trainable(none, "image") == set() and none.config["image"]["finetune"] is False
    none.set_finetune(image=True)
    assert trainable(none, "image") and all(n.startswith(top["image"]) for n in trainable(none, "image"))


# --- preprocessing --------------------------------------------------------------------------------
def naive_pixels(image: Image.Image, resize: int, crop: int, mean, std, square: bool) -> torch.Tensor:
    """The Hugging Face processor written out: bicubic resize, centre crop (offset rounded down),
    /255, per-channel normalisation."""
    w, h = image.size
    if square:
        image = image.resize((resize, resize), Image.Resampling.BICUBIC)
    elif min(w, h) != resize:
        size = (resize, int(resize * h / w)) if w <= h else (int(resize * w / h), resize)
        image = image.resize(size, Image.Resampling.BICUBIC)
    w, h = image.size
    left, top = (w - crop) // 2, (h - crop) // 2
    image = image.crop((left, top, left + crop, top + crop))
    x = np.asarray(image, dtype=np.float64) / 255.0  # (S, S, 3)
    x = (x - np.asarray(mean)) / np.asarray(std)
    return torch.from_numpy(x.transpose(2, 0, 1)).float()  # (3, S, S)


def test_clip_preprocessing_is_the_processors(clip_dir: Path) -> None:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    model = build_model(clip_config(clip_dir, CLIP_DIM))
    image_cfg = model.config["image"]
    assert (image_cfg["image_size"], image_cfg["resize"], image_cfg["resize_mode"]) == (32, 36, "shorter")
    assert image_cfg["resample"] == "bicubic" and image_cfg["processor"]["size"] == {"shortest_edge": 36}
    assert model.preprocessing["crop_offset"] == "floor"
    transform = model.image_transform(train=False)
    processor = CLIPImageProcessorPil.from_pretrained(str(clip_dir))
    images = random_images([(45, 60), (71, 33), (32, 32), (37, 36)], seed=1)
    for image in images:
        ours = transform(image)
        assert ours.shape == (3, 32, 32)
        assert_close(
            ours, naive_pixels(image, 36, 32, image_cfg["mean"], image_cfg["std"], False), atol=1e-5, rtol=0
        )
        theirs = torch.as_tensor(np.asarray(processor(image, return_tensors="np")["pixel_values"][0]))
        assert_close(ours, theirs.float(), atol=1e-5, rtol=0)
    # the batched path (training) equals the one-by-one path
    stacked = transform.stack(images[2:3], lambda j: np.random.default_rng(j))
    assert_close(stacked[0], transform(images[2]))


def test_siglip_without_processor_file_uses_the_family_defaults(siglip_dir: Path) -> None:
    model = build_model(clip_config(siglip_dir, SIGLIP_DIM))
    image_cfg = model.config["image"]
    assert image_cfg["processor"] is None
    assert (image_cfg["image_size"], image_cfg["resize"], image_cfg["resize_mode"]) == (32, 32, "square")
    assert image_cfg["mean"] == [0.5, 0.5, 0.5] and image_cfg["std"] == [0.5, 0.5, 0.5]
    transform = model.image_transform(train=False)
    for image in random_images([(45, 60), (80, 20)], seed=2):
        assert_close(
            transform(image), naive_pixels(image, 32, 32, [0.5] * 3, [0.5] * 3, True), atol=1e-5, rtol=0
        )


def test_processor_configs_map_to_the_transform_or_are_refused() -> None:
    siglip = {
        "do_resize": True,
        "size": {"height": 224, "width": 224},
        "resample": 3,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255,
    }
    assert processor_preprocessing(siglip, "siglip", 224) == {
        "image_size": 224,
        "resize": 224,
        "resize_mode": "square",
        "resample": "bicubic",
        "mean": [0.5, 0.5, 0.5],
        "std": [0.5, 0.5, 0.5],
    }
    legacy_clip = {"size": 224, "crop_size": 224, "do_center_crop": True, "resample": 3}  # openai's old file
    out = processor_preprocessing(legacy_clip, "clip", 224)
    assert (out["resize"], out["image_size"], out["resize_mode"]) == (224, 224, "shorter")
    assert out["mean"] == [0.48145466, 0.4578275, 0.40821073]
    with pytest.raises(ValueError, match="resample"):
        processor_preprocessing({**siglip, "resample": 1}, "siglip", 224)
    with pytest.raises(ValueError, match="not supported"):
        processor_preprocessing({**siglip, "size": {"height": 224, "width": 256}}, "siglip", 224)


# --- errors ---------------------------------------------------------------------------------------
def test_clear_errors(clip_dir: Path, tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    with pytest.raises(ValueError, match=r"set model.embed_dim = 16"):
        build_model(clip_config(clip_dir, 64))
    bert = tmp_path / "bert"
    BertModel(
        BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    ).save_pretrained(bert)
    with pytest.raises(ValueError, match=r"model_type 'bert' is not CLIP or SigLIP"):
        build_model(clip_config(bert, CLIP_DIM))
    with pytest.raises(ValueError, match="no config.json"):
        build_model(clip_config(tmp_path / "missing", CLIP_DIM))
    with pytest.raises(ValueError, match="path is required"):
        build_model({"embed_dim": CLIP_DIM, "image": {"kind": "clip"}, "text": {"kind": "clip"}})
    with pytest.raises(ValueError, match="finetune_last_n = 3, but the model has 2"):
        build_model(clip_config(clip_dir, CLIP_DIM, finetune_last_n=3))
    cfg = clip_config(clip_dir, CLIP_DIM)
    cfg["image"]["image_size"] = 48
    with pytest.raises(ValueError, match="takes 32 x 32 images"):
        build_model(cfg)
    with pytest.raises(ValueError, match="logit_scale"):
        build_model({**clip_config(clip_dir, CLIP_DIM), "logit_scale": "sometimes"})


# --- learned logit scale --------------------------------------------------------------------------
def test_a_learned_scale_replaces_the_objectives_temperature() -> None:
    from icr.training.losses import build_loss

    torch.manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(6, 8, dtype=torch.float64), dim=1)
    cap = torch.nn.functional.normalize(torch.randn(6, 8, dtype=torch.float64), dim=1)
    ids = torch.arange(6)
    for name, params, factor in [
        ("ntxent", {"temperature": 0.05}, 20.0),
        ("ntxent_multi", {"temperature": 0.1, "sampling": "caption"}, 10.0),
        ("sampled_softmax", {"scale": 16.0}, 16.0),
    ]:
        loss = build_loss(name, **params)
        assert loss.fixed_logit_scale() == pytest.approx(factor)
        fixed = loss(img, cap, ids, ids)["loss"]
        log_scale = torch.tensor(math.log(factor), dtype=torch.float64, requires_grad=True)
        learned = loss(img, cap, ids, ids, logit_scale=log_scale.exp())["loss"]
        assert_close(learned, fixed)
        learned.backward()
        assert log_scale.grad is not None and log_scale.grad != 0
    triplet = build_loss("triplet_hardest")
    assert triplet.fixed_logit_scale() is None
    with pytest.raises(ValueError, match="no temperature"):
        triplet(img, cap, ids, ids, logit_scale=torch.tensor(10.0))


# --- the training loop and checkpoints ------------------------------------------------------------
def run_config(data: Path, out: Path, folder: Path, dim: int, *extra: str) -> dict:
    return load_config(
        None,
        [
            f'data.path="{data}"',
            f'train.out="{out}"',
            "train.batch_size=8",
            "train.epochs=1",
            "train.max_steps=3",
            "train.log_every=1",
            "data.val_images=12",
            "train.threads=1",
            "optim.lr=1e-3",
            f"model.embed_dim={dim}",
            'model.image.kind="clip"',
            f'model.image.path="{folder}"',
            'model.text.kind="clip"',
            f'model.text.path="{folder}"',
            *extra,
        ],
    )


def test_training_learns_the_logit_scale_and_checkpoints_load_without_the_folder(
    clip_dir: Path, tiny_benchmark: Path, tmp_path: Path
) -> None:
    from icr.training.train import train

    folder = Path(shutil.copytree(clip_dir, tmp_path / "clip"))
    run = tmp_path / "run"
    # one whole epoch (25 steps of 8 captions), so that validation embeds the val split too
    config = run_config(
        tiny_benchmark, run, folder, CLIP_DIM, "model.image.finetune_last_n=1", "train.max_steps=0"
    )
    summary = train(config, progress=False)
    assert summary["steps"] == 25 and summary["best_rsum"] is not None

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scales = [r["logit_scale"] for r in records if r["event"] == "train"]
    assert scales[0] == pytest.approx(math.exp(CLIP_LOGIT_SCALE), rel=1e-4)  # CLIP's own, to start
    assert scales[-1] != scales[0]  # a trained parameter
    assert any(r["event"] == "val" for r in records)

    shutil.rmtree(folder)  # loading needs neither the model folder nor its tokenizer or processor
    model, config = load_checkpoint(run / "last")
    assert config.tokenizer == "tokenizer" and config.model["image"]["hf_config"]["model_type"] == "clip"
    assert config.preprocessing["resize"] == 36 and config.preprocessing["resample"] == "bicubic"
    assert model.logit_scale is not None and model.logit_scale.item() != pytest.approx(CLIP_LOGIT_SCALE)
    learned = config.objective["learned_logit_scale"]  # beside the unused fixed temperature
    assert learned == pytest.approx(math.exp(model.logit_scale.item()), rel=1e-5)
    # the frozen first layer kept its pretrained weights; the trained last layer did not
    from safetensors.torch import load_file

    original = load_file(str(clip_dir / "model.safetensors"))
    frozen = "vision_model.encoder.layers.0.mlp.fc1.weight"
    trained = "vision_model.encoder.layers.1.mlp.fc1.weight"
    assert torch.equal(model.image_encoder.model.encoder.layers[0].mlp.fc1.weight, original[frozen])
    assert not torch.equal(model.image_encoder.model.encoder.layers[1].mlp.fc1.weight, original[trained])


@pytest.mark.parametrize(("family", "dim"), [("clip", CLIP_DIM), ("siglip", SIGLIP_DIM)])
def test_checkpoint_round_trip_embeds_equally_without_the_folder(
    family: str, dim: int, request, tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(folder_of(family, request), tmp_path / family))
    model = build_model(clip_config(folder, dim, finetune_last_n=1)).eval()
    assert model.logit_scale is not None and model.logit_scale_pretrained
    expected = CLIP_LOGIT_SCALE if family == "clip" else SIGLIP_LOGIT_SCALE
    assert model.logit_scale.item() == pytest.approx(expected, rel=1e-5)
    path = save_checkpoint(tmp_path / "ckpt", model, {"step": 0})
    shutil.rmtree(folder)

    loaded, config = load_checkpoint(path)
    images = random_images([(40, 50), (90, 31)], seed=3)
    for a, b in zip(embed(model, images, CAPTIONS), embed(loaded, images, CAPTIONS), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(model.tokenize(CAPTIONS)["input_ids"], loaded.tokenize(CAPTIONS)["input_ids"])
    assert loaded.config == model.config and config.model == model.config
    assert loaded.logit_scale is not None and torch.equal(loaded.logit_scale, model.logit_scale)
    assert loaded.config["image"]["finetune_last_n"] == 1


def test_an_objective_without_temperature_leaves_the_scale_alone(
    siglip_dir: Path, tiny_benchmark: Path, tmp_path: Path
) -> None:
    from icr.training.train import Trainer

    config = run_config(
        tiny_benchmark,
        tmp_path / "run",
        siglip_dir,
        SIGLIP_DIM,
        'loss.name="triplet_hardest"',
        "train.val_every=0",
    )
    trainer = Trainer(config, progress=False)
    assert trainer.model.logit_scale is not None and not trainer.model.logit_scale.requires_grad
    trainer.fit()
    assert trainer.model.logit_scale.item() == pytest.approx(SIGLIP_LOGIT_SCALE, rel=1e-6)


def test_a_learned_scale_without_a_pretrained_one_starts_from_the_temperature(
    tiny_benchmark: Path, tmp_path: Path
) -> None:
    from tiny_model import TINY_MODEL

    from icr.training.train import Trainer

    overrides = [f'data.path="{tiny_benchmark}"', f'train.out="{tmp_path}"', *TINY_MODEL]
    trainer = Trainer(load_config(None, [*overrides, 'model.logit_scale="learned"']), progress=False)
    assert trainer.model.logit_scale is not None
    assert trainer.model.logit_scale.item() == pytest.approx(math.log(1 / 0.1))
    assert Trainer(load_config(None, overrides), progress=False).model.logit_scale is None  # "auto": fixed


def test_ltd_trains_a_frozen_image_tower_with_a_clip_text_tower(
    clip_dir: Path, tiny_benchmark: Path, tmp_path: Path
) -> None:
    from icr.training.train import train

    config = run_config(
        tiny_benchmark,
        tmp_path / "run",
        clip_dir,
        CLIP_DIM,
        "model.image.finetune=false",
        'decoding.kind="ltd"',
        "train.max_steps=2",
        "train.val_every=0",
        f'data.cache_dir="{tmp_path / "cache"}"',
    )
    summary = train(config, progress=False)
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in records if r["event"] == "train")
