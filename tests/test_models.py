"""Encoders, model config and image preprocessing (training/models)."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.testing import assert_close

from icr.training.data.vocab import Vocabulary
from icr.training.models import DualEncoder, build_model, load_glove, normalize_model_config
from icr.training.models.preprocess import random_resized_crop_box

CAPTIONS = [
    "a red circle on the left",
    "two blue squares at the top",
    "a red circle on the left",  # duplicate caption: identical embeddings expected
    "square",
]


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.build([c.split() for c in CAPTIONS] + [["green", "triangle", "blue"]])


@pytest.fixture(scope="module")
def tiny_resnet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Hugging Face ResNet folder (saved locally, nothing downloaded)."""
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_resnet")
    ResNetModel(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])).save_pretrained(path)
    return path


def small_config(image: dict | None = None, text: dict | None = None, embed_dim: int = 16) -> dict:
    return {
        "embed_dim": embed_dim,
        "image": image or {"kind": "cnn", "width": 4},
        "text": text or {"kind": "gru", "word_dim": 8, "hidden": 16},
    }


def assert_unit_rows(x: torch.Tensor, rows: int, dim: int) -> None:
    assert x.shape == (rows, dim)
    assert_close(x.norm(dim=1), torch.ones(rows), atol=1e-5, rtol=0)


# --- config ---------------------------------------------------------------------------------------
def test_default_config_is_complete_idempotent_and_json() -> None:
    cfg = normalize_model_config({})
    assert cfg["embed_dim"] == 1024
    assert cfg["image"]["kind"] == "cnn" and cfg["text"]["kind"] == "gru"
    assert cfg["image"]["augment"] == "none" and cfg["image"]["image_size"] == 64
    assert normalize_model_config(cfg) == cfg
    assert json.loads(json.dumps(cfg)) == cfg
    resnet = normalize_model_config({"image": {"kind": "resnet"}})["image"]
    assert (resnet["image_size"], resnet["resize"], resnet["augment"]) == (224, 256, "crop_flip")
    assert resnet["mean"] == [0.485, 0.456, 0.406]


@pytest.mark.parametrize(
    ("cfg", "words"),
    [
        ({"image": {"kind": "vgg"}}, ["vgg", "cnn", "precomp", "resnet"]),
        ({"text": {"kind": "lstm"}}, ["lstm", "gru", "transformer"]),
        ({"image": {"kind": "cnn", "widht": 3}}, ["widht", "width"]),
        ({"embedding": 3}, ["embedding", "embed_dim"]),
        ({"image": {"kind": "resnet", "head_layers": 3}}, ["head_layers", "[1, 2]"]),
        ({"image": {"kind": "resnet", "head_layers": True}}, ["head_layers"]),
        ({"image": {"kind": "cnn", "resize": 32}}, ["resize", "image_size"]),
        ({"image": {"kind": "cnn", "std": [1, 0, 1]}}, ["std"]),
        ({"text": {"kind": "gru", "bidirectional": "yes"}}, ["bidirectional"]),
        ({"embed_dim": 0}, ["embed_dim"]),
    ],
)
def test_config_errors_name_the_key_and_the_valid_choices(cfg: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        normalize_model_config(cfg)
    for word in words:
        assert word in str(err.value)


def test_every_configurable_kind_has_a_registered_tower() -> None:
    from icr.training.models.config import IMAGE_DEFAULTS, TEXT_DEFAULTS
    from icr.training.models.towers import IMAGE_TOWERS, TEXT_TOWERS, TowerContext, build_tower

    assert set(IMAGE_TOWERS) == set(IMAGE_DEFAULTS)
    assert set(TEXT_TOWERS) == set(TEXT_DEFAULTS)
    with pytest.raises(ValueError, match="unknown image tower kind 'vit'; choose one of: clip, cnn"):
        build_tower(IMAGE_TOWERS, "image", {"kind": "vit"}, 8, TowerContext(load_weights=False))


def test_model_config_is_complete_and_gru_needs_a_vocab(vocab: Vocabulary) -> None:
    model = build_model(small_config(), vocab)
    assert isinstance(model, DualEncoder)
    assert normalize_model_config(model.config) == model.config
    assert json.loads(json.dumps(model.config)) == model.config
    assert model.embed_dim == 16 and model.vocab is vocab
    with pytest.raises(ValueError, match="vocab"):
        build_model(small_config())


# --- image towers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("pool", ["flatten", "avg"])
def test_cnn_shapes_and_unit_norm(vocab: Vocabulary, pool: str) -> None:
    model = build_model(small_config({"kind": "cnn", "width": 4, "pool": pool}), vocab)
    emb = model.encode_image(torch.randn(3, 3, 64, 64))
    assert_unit_rows(emb, 3, 16)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())  # GroupNorm only
    if pool == "flatten":
        with pytest.raises(ValueError, match="64x64"):
            model.encode_image(torch.randn(1, 3, 48, 48))


@pytest.mark.parametrize("pooling", ["mean", "max"])
def test_precomp_matches_per_region_loop(vocab: Vocabulary, pooling: str) -> None:
    torch.manual_seed(0)
    model = build_model(
        small_config({"kind": "precomp", "feature_dim": 5, "pooling": pooling}), vocab
    ).double()
    fc = model.image_encoder.fc
    # Small dyadic values keep every product and sum exact, so tied regions tie exactly after the
    # batched matmul too (otherwise summation order breaks ties in the last bit).
    with torch.no_grad():
        fc.weight.copy_(torch.randint(-4, 5, fc.weight.shape) / 4)
        fc.bias.copy_(torch.randint(-4, 5, fc.bias.shape) / 4)
    feats = torch.randint(-3, 4, (4, 3, 5)).double() / 2
    feats[1] = feats[0]  # duplicate image
    feats[2, 1] = feats[2, 0]  # tied regions (max has two arg-maxes)
    feats.requires_grad_(True)

    fast = model.encode_image(feats)
    rows = []
    for b in range(feats.shape[0]):
        projected = [fc(feats[b, r]) for r in range(feats.shape[1])]
        acc = projected[0]
        for p in projected[1:]:
            acc = acc + p if pooling == "mean" else torch.maximum(acc, p)
        acc = acc / len(projected) if pooling == "mean" else acc
        rows.append(acc / acc.norm())
    slow = torch.stack(rows)
    assert_close(fast, slow)
    weights = torch.randn_like(fast)
    g_fast = torch.autograd.grad((fast * weights).sum(), [feats, fc.weight])
    g_slow = torch.autograd.grad((slow * weights).sum(), [feats, fc.weight])
    for a, b in zip(g_fast, g_slow, strict=True):
        assert_close(a, b)
    assert_unit_rows(model.encode_image(torch.randn(2, 5, dtype=torch.float64)).float(), 2, 16)  # (B, F)
    with pytest.raises(ValueError, match="feature_dim"):
        model.encode_image(torch.randn(2, 3, 7, dtype=torch.float64))


@pytest.mark.parametrize("head_layers", [1, 2])
def test_resnet_frozen_backbone_stays_in_eval_without_grad(
    vocab: Vocabulary, tiny_resnet_dir: Path, head_layers: int
) -> None:
    image = {
        "kind": "resnet",
        "path": str(tiny_resnet_dir),
        "head_layers": head_layers,
        "image_size": 32,
        "resize": 36,
    }
    model = build_model(small_config(image), vocab)
    tower = model.image_encoder
    assert model.config["image"]["backbone"]["library"] == "transformers"
    bn = next(m for m in tower.backbone.modules() if isinstance(m, torch.nn.BatchNorm2d))
    stats = bn.running_mean.clone()

    model.train()
    assert not tower.backbone.training and tower.head.training
    emb = model.encode_image(torch.randn(3, 3, 32, 32) * 3 + 1)  # far from the running statistics
    assert_unit_rows(emb, 3, 16)
    emb.sum().backward()
    assert all(p.grad is None and not p.requires_grad for p in tower.backbone.parameters())
    assert all(p.grad is not None for p in tower.head.parameters())
    assert torch.equal(bn.running_mean, stats)  # BatchNorm statistics did not drift

    model.set_finetune(image=True)
    assert model.config["image"]["finetune"] is True and tower.backbone.training
    model.encode_image(torch.randn(2, 3, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in tower.backbone.parameters())


def test_resnet_rebuilds_from_stored_structure_without_the_folder(
    vocab: Vocabulary, tiny_resnet_dir: Path
) -> None:
    image = {"kind": "resnet", "path": str(tiny_resnet_dir), "image_size": 32, "resize": 36}
    model = build_model(small_config(image), vocab).eval()
    cfg = copy.deepcopy(model.config)
    cfg["image"]["path"] = str(tiny_resnet_dir / "moved-away")
    rebuilt = build_model(cfg, vocab, load_weights=False)
    rebuilt.load_state_dict(model.state_dict())
    rebuilt.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model.encode_image(x), rebuilt.encode_image(x))


def test_resnet_path_errors(vocab: Vocabulary, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model.image.path is required"):
        build_model(small_config({"kind": "resnet"}), vocab)
    with pytest.raises(ValueError, match="does not exist"):
        build_model(small_config({"kind": "resnet", "path": str(tmp_path / "nope")}), vocab)
    with pytest.raises(ValueError, match="config.json"):
        build_model(small_config({"kind": "resnet", "path": str(tmp_path)}), vocab)
    try:
        import torchvision  # noqa: F401
    except Exception:
        weights = tmp_path / "resnet50.pth"
        weights.write_bytes(b"not used")
        with pytest.raises(ValueError, match="torchvision"):
            build_model(small_config({"kind": "resnet", "path": str(weights)}), vocab)


# --- text towers ----------------------------------------------------------------------------------
def test_gru_tokenize_adds_specials_pads_and_truncates(vocab: Vocabulary) -> None:
    model = build_model(small_config(text={"kind": "gru", "word_dim": 4, "hidden": 16, "max_len": 5}), vocab)
    batch = model.tokenize(["red circle", "a red circle on the left", "zebra"])
    ids, lengths = batch["input_ids"], batch["lengths"]
    assert ids.dtype == torch.long and lengths.tolist() == [4, 5, 3]
    red, circle = vocab.id_of("red"), vocab.id_of("circle")
    assert ids[0].tolist() == [Vocabulary.START, red, circle, Vocabulary.END, Vocabulary.PAD]
    assert ids[1, 0] == Vocabulary.START and ids[1, -1] == Vocabulary.END  # truncated, <end> kept
    assert ids[2, :3].tolist() == [Vocabulary.START, Vocabulary.UNK, Vocabulary.END]
    with pytest.raises(ValueError, match="list"):
        model.tokenize("a red circle")


@pytest.mark.parametrize("bidirectional", [False, True])
def test_gru_matches_per_caption_loop(vocab: Vocabulary, bidirectional: bool) -> None:
    """Packed batch == each caption run alone over its valid tokens (values and gradients)."""
    torch.manual_seed(0)
    hidden = 6 if bidirectional else 12
    text = {"kind": "gru", "word_dim": 5, "hidden": hidden, "bidirectional": bidirectional}
    model = build_model(small_config(text=text, embed_dim=12), vocab).double()
    tower = model.text_encoder
    batch = model.tokenize(CAPTIONS)

    fast = model.encode_text(batch)
    rows = []
    for ids, n in zip(batch["input_ids"], batch["lengths"].tolist(), strict=True):
        out, _ = tower.rnn(tower.embed(ids[:n]).unsqueeze(0))  # (1, n, dirs * H), no padding at all
        if bidirectional:  # forward state after the last token, backward state after the first
            state = torch.cat([out[0, n - 1, :hidden], out[0, 0, hidden:]])
        else:
            state = out[0, n - 1]
        rows.append(state / state.norm())
    slow = torch.stack(rows)
    assert_close(fast, slow)
    assert torch.equal(fast[0], fast[2])
    weights = torch.randn_like(fast)
    params = [tower.embed.weight, *tower.rnn.parameters()]
    g_fast = torch.autograd.grad((fast * weights).sum(), params)
    g_slow = torch.autograd.grad((slow * weights).sum(), params)
    for a, b in zip(g_fast, g_slow, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize(("bidirectional", "head_layers"), [(False, 0), (True, 2)])
def test_gru_with_glove_shapes_and_frozen_embeddings(
    vocab: Vocabulary, tmp_path: Path, bidirectional: bool, head_layers: int
) -> None:
    glove = tmp_path / "glove.txt"
    glove.write_text("red 1 2 3 4\nCircle 5 6 7 8\nsquare 0.5 0.5 0.5 0.5\nzebra 9 9 9 9\n", encoding="utf-8")
    text = {
        "kind": "gru",
        "word_dim": 4,
        "hidden": 8,
        "bidirectional": bidirectional,
        "head_layers": head_layers,
        "glove_path": str(glove),
        "finetune_embeddings": False,
    }
    model = build_model(small_config(text=text), vocab)
    weight = model.text_encoder.embed.weight
    assert torch.equal(weight[vocab.id_of("red")], torch.tensor([1.0, 2, 3, 4]))
    assert torch.equal(weight[vocab.id_of("circle")], torch.tensor([5.0, 6, 7, 8]))  # lower-cased match
    assert model.text_encoder.glove_coverage == pytest.approx(3 / (len(vocab) - 4))
    model.train()
    emb = model.encode_text(model.tokenize(CAPTIONS))
    assert_unit_rows(emb, len(CAPTIONS), 16)
    emb.sum().backward()
    assert weight.grad is None and all(p.grad is not None for p in model.text_encoder.rnn.parameters())


def test_load_glove_exact_match_wins_and_dimension_errors(vocab: Vocabulary, tmp_path: Path) -> None:
    path = tmp_path / "vectors.txt"
    path.write_text("Blue 1 1\nblue 2 2\nBLUE 3 3\nthe end x\n", encoding="utf-8")
    weights, coverage = load_glove(path, vocab, 2)
    assert weights.shape == (len(vocab), 2)
    assert torch.equal(weights[vocab.id_of("blue")], torch.tensor([2.0, 2.0]))
    assert coverage == pytest.approx(1 / (len(vocab) - 4))
    others = torch.cat([weights[: vocab.id_of("blue")], weights[vocab.id_of("blue") + 1 :]])
    assert others.abs().max() <= 0.1  # untouched rows keep the U(-0.1, 0.1) init
    with pytest.raises(ValueError) as err:
        load_glove(path, vocab, 3)
    assert str(path) in str(err.value) and "2-d" in str(err.value) and "word_dim" in str(err.value)
    with pytest.raises(ValueError, match="not found"):
        load_glove(tmp_path / "missing.txt", vocab, 2)


@pytest.fixture(scope="module")
def minilm_model() -> DualEncoder:
    torch.manual_seed(0)
    return build_model(
        small_config({"kind": "precomp", "feature_dim": 6}, {"kind": "transformer", "finetune": False})
    )


def test_transformer_mean_pooling_matches_per_caption_loop(minilm_model: DualEncoder) -> None:
    model = minilm_model.eval()
    captions = ["a red circle", "two blue squares at the top of the picture"]
    batch = model.tokenize(captions)
    assert set(batch) == {"input_ids", "attention_mask"}
    assert model.config["text"]["hf_config"]["model_type"] == "bert"
    with torch.no_grad():
        fast = model.encode_text(batch)
        tower = model.text_encoder
        for i, caption in enumerate(captions):
            ids = tower.tokenizer([caption], return_tensors="pt")["input_ids"]  # unpadded
            pooled = tower.model(input_ids=ids).last_hidden_state[0].mean(dim=0)
            slow = tower.proj(pooled)
            assert_close(fast[i], slow / slow.norm(), atol=1e-5, rtol=1e-4)
    assert_unit_rows(fast, 2, 16)


def test_unknown_words_are_the_words_the_tokenizer_cannot_read(vocab: Vocabulary, minilm_model) -> None:
    """A word-vocabulary tower cannot read a word outside its vocabulary; WordPiece spells most words
    from pieces and maps only what it has no piece for to [UNK]."""
    gru = build_model(small_config(), vocab)
    known = [w for w in vocab.itos if not w.startswith("<")][:2]
    text = f"{known[0]} qwerty, {known[1]}! Zebra"
    assert gru.unknown_words(text) == ["qwerty", "zebra"]
    assert gru.unknown_words(" ".join(known)) == [] and gru.unknown_words("!!!") == []
    assert minilm_model.unknown_words("a red circle qwerty") == []
    assert minilm_model.unknown_words("a red \U00010330\U00010331 circle") == ["\U00010330\U00010331"]


def test_transformer_frozen_trains_only_the_projection(minilm_model: DualEncoder) -> None:
    model = minilm_model
    model.train()
    assert not model.text_encoder.model.training  # frozen: no dropout
    img, cap = model(torch.randn(2, 4, 6), model.tokenize(["a red circle", "a square"]))
    (img @ cap.T).sum().backward()
    assert model.text_encoder.proj.weight.grad is not None
    assert all(p.grad is None for p in model.text_encoder.model.parameters())
    model.zero_grad()
    model.eval()


def test_transformer_cls_pooling_finetunes_every_transformer_weight() -> None:
    torch.manual_seed(0)
    text = {"kind": "transformer", "pooling": "cls", "max_len": 8}
    model = build_model(small_config({"kind": "precomp", "feature_dim": 6}, text)).train()
    tower = model.text_encoder
    batch = model.tokenize(["a red circle", "a very long caption that will be cut at eight tokens"])
    assert batch["input_ids"].shape == (2, 8)
    model.encode_text(batch).sum().backward()
    # Every weight gets a gradient: DistributedDataParallel fails on unused parameters.
    assert all(p.grad is not None for p in tower.parameters())
    model.eval()
    with torch.no_grad():
        cls = tower.proj(tower.model(**batch).last_hidden_state[:, 0])  # (B, D)
        assert_close(model.encode_text(batch), cls / cls.norm(dim=1, keepdim=True))


# --- both towers ----------------------------------------------------------------------------------
def test_gradients_reach_both_towers(vocab: Vocabulary) -> None:
    torch.manual_seed(0)
    model = build_model(small_config(), vocab).train()
    img, cap = model(torch.randn(4, 3, 64, 64), model.tokenize(CAPTIONS))
    assert_unit_rows(img, 4, 16)
    assert_unit_rows(cap, 4, 16)
    (img @ cap.T).logsumexp(dim=1).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_default_embedded_model_runs(vocab: Vocabulary) -> None:
    model = build_model({}, vocab)
    img, cap = model(torch.randn(2, 3, 64, 64), model.tokenize(CAPTIONS[:2]))
    assert_unit_rows(img, 2, 1024)
    assert_unit_rows(cap, 2, 1024)


# --- preprocessing --------------------------------------------------------------------------------
def _scene(width: int = 100, height: int = 80) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def test_cnn_eval_transform_is_exact_for_64px(vocab: Vocabulary) -> None:
    model = build_model(small_config(), vocab)
    pixels = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    for train in (False, True):  # augment "none": training sees the same pixels as evaluation
        out = model.image_transform(train)(Image.fromarray(pixels), np.random.default_rng(0))
        assert out.dtype == torch.float32 and out.shape == (3, 64, 64)
        expected = (torch.from_numpy(pixels).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
        assert_close(out, expected)
    gray = model.image_transform(False)(Image.fromarray(pixels[..., 0], "L"), None)
    assert gray.shape == (3, 64, 64) and torch.equal(gray[0], gray[1])


def test_transform_stack_equals_one_image_at_a_time() -> None:
    from icr.training.models.preprocess import ImageTransform

    rng = np.random.default_rng(3)
    exact = [Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)) for _ in range(3)]
    exact.append(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))  # arrays go the same way
    mixed = [*exact, _scene(100, 80)]  # one image needs resizing: no one-operation shortcut
    stats = {"mean": (0.1, 0.2, 0.3), "std": (0.5, 0.6, 0.7)}
    for transform, images in (
        (ImageTransform(image_size=64, resize=None, **stats), exact),
        (ImageTransform(image_size=64, resize=72, **stats), mixed),
        (ImageTransform(image_size=48, resize=None, augment="crop_flip", train=True, **stats), mixed),
    ):
        stacked = transform.stack(images, lambda j: np.random.default_rng([5, j]))
        one_by_one = [transform(im, np.random.default_rng([5, j])) for j, im in enumerate(images)]
        assert stacked.shape == (len(images), 3, transform.image_size, transform.image_size)
        assert torch.equal(stacked, torch.stack(one_by_one))


def test_rendered_batch_array_is_normalised_like_the_images_one_by_one() -> None:
    """A (N, S, S, 3) uint8 batch (the distractor renderer's) skips PIL and comes out
    channels_last; the values are bitwise those of the naive float32 formula and of the list path."""
    from icr.training.models.preprocess import ImageTransform

    batch = np.random.default_rng(4).integers(0, 256, (5, 64, 64, 3), dtype=np.uint8)
    batch[0, 0, :, :] = np.arange(64)[:, None] * 4  # every 4th byte value in each channel
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    naive = (batch.astype(np.float32) / np.float32(255.0) - np.float32(mean)) / np.float32(std)
    for resize in (None, 72):
        transform = ImageTransform(image_size=64, resize=resize, mean=mean, std=std)
        stacked = transform.stack(batch, lambda _j: np.random.default_rng(0))  # (5, 3, 64, 64)
        assert torch.equal(stacked, transform.stack(list(batch), lambda _j: np.random.default_rng(0)))
        if resize is None:
            assert stacked.is_contiguous(memory_format=torch.channels_last)
            assert np.array_equal(stacked.numpy(), naive.transpose(0, 3, 1, 2))


def test_eval_transform_resizes_shorter_side_then_center_crops() -> None:
    from icr.training.models.preprocess import ImageTransform

    image = _scene(100, 80)
    transform = ImageTransform(image_size=64, resize=72, mean=(0.1, 0.2, 0.3), std=(0.5, 0.6, 0.7))
    out = transform(image)
    resized = image.resize((90, 72), Image.Resampling.BILINEAR)  # 80 -> 72, 100 -> int(72 * 100 / 80)
    left, top = 13, 4  # round((90 - 64) / 2), round((72 - 64) / 2)
    crop = np.asarray(resized, np.float32)[top : top + 64, left : left + 64] / 255.0
    expected = (crop - np.array([0.1, 0.2, 0.3], np.float32)) / np.array([0.5, 0.6, 0.7], np.float32)
    assert_close(out, torch.from_numpy(expected).permute(2, 0, 1))


def test_crop_flip_is_deterministic_given_rng_and_flips(vocab: Vocabulary, tiny_resnet_dir: Path) -> None:
    image = {"kind": "resnet", "path": str(tiny_resnet_dir), "image_size": 32, "resize": 36}
    model = build_model(small_config(image), vocab)
    train = model.image_transform(True)
    train = pickle.loads(pickle.dumps(train))  # DataLoader workers pickle the transform
    left_red = np.zeros((40, 60, 3), np.uint8)
    left_red[:, :30, 0] = 255
    left_red[:, 30:, 2] = 255
    picture = Image.fromarray(left_red)
    outs = [train(picture, np.random.default_rng(seed)) for seed in range(40)]
    assert all(o.shape == (3, 32, 32) and o.dtype == torch.float32 for o in outs)
    assert torch.equal(train(picture, np.random.default_rng(7)), outs[7])
    assert len({o.numpy().tobytes() for o in outs}) > 30
    left_is_red = [bool(o[0, :, 0].mean() > o[2, :, 0].mean()) for o in outs]
    assert any(left_is_red) and not all(left_is_red)  # some crops were flipped
    with pytest.raises(ValueError, match="rng"):
        train(picture, None)
    assert model.image_transform(False)(picture, None).shape == (3, 32, 32)


@pytest.mark.parametrize(("width", "height"), [(100, 80), (300, 20), (20, 300), (7, 7)])
def test_random_resized_crop_box_stays_inside(width: int, height: int) -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        left, top, right, bottom = random_resized_crop_box(width, height, rng)
        assert 0 <= left < right <= width and 0 <= top < bottom <= height


def test_precomp_feature_transform(vocab: Vocabulary) -> None:
    model = build_model(small_config({"kind": "precomp", "feature_dim": 5}), vocab)
    transform = model.image_transform(True)
    regions = np.arange(15, dtype=np.float64).reshape(3, 5)
    out = transform(regions, np.random.default_rng(0))
    assert out.dtype == torch.float32 and torch.equal(out, torch.arange(15.0).reshape(3, 5))
    assert transform(np.ones(5), None).shape == (5,)
    with pytest.raises(ValueError, match="feature_dim"):
        transform(np.ones((3, 4)), None)
    assert model.preprocessing == {"input": "features", "feature_dim": 5}


@pytest.mark.parametrize("augment", ["none", "crop_flip"])
def test_preloaded_pixel_arrays_transform_as_their_images_do(tiny_benchmark: Path, augment: str) -> None:
    """A preloaded split hands out (S, S, 3) uint8 arrays, which the transforms batch without PIL:
    the tensors must equal those of the images read from disk, for the training and eval transforms."""
    from icr.training.data.training_data import open_split
    from icr.training.models.preprocess import ImageTransform

    from_disk = open_split(tiny_benchmark, "val", preload=False)
    preloaded = open_split(tiny_benchmark, "val", preload=True)
    assert isinstance(preloaded.get_image(0), np.ndarray)
    rows = [3, 0, 7, 7]
    for train in (False, True):
        transform = ImageTransform(32, None, (0.5, 0.5, 0.5), (0.2, 0.3, 0.4), augment=augment, train=train)

        def rng_of(j: int) -> np.random.Generator:
            return np.random.default_rng([1, j])

        want = transform.stack([from_disk.get_image(i) for i in rows], rng_of)  # PIL images
        got = transform.stack([preloaded.get_image(i) for i in rows], rng_of)
        assert isinstance(from_disk.get_image(0), Image.Image)
        assert_close(got, want, rtol=0, atol=0)
        assert got.shape == (4, 3, 32, 32)
