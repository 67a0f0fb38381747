"""COCOS counters: hand-computed small batches, naive per-query oracles, the t2i axis, the generic
counter against the triplet definitions, and `run_cocos` / `icr analyze cocos` on a tiny checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from icr.training.analysis.cocos import cocos_batch, counter_for, run_cocos
from icr.training.checkpoint import load_checkpoint, save_checkpoint
from icr.training.config import load_config
from icr.training.data.synthetic.generate import write_dataset
from icr.training.data.training_data import open_split, plan_epoch
from icr.training.embedding import embed_captions, embed_images
from icr.training.losses import build_loss, load_all
from icr.training.losses.triplet import Triplet


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# --- triplet: hand-computed ------------------------------------------------------------------------
# margin 0.2. i2t (rows, vs the row's diagonal): row 0 violates at col 1 (0.2 + 0.8 - 0.9 = 0.1),
# row 1 at cols 0 (0.1) and 2 (0.25), row 2 at col 1 (0.1): counts [1, 2, 1].
# t2i (columns, vs the column's diagonal): col 0 none, col 1 at row 0 (0.4), col 2 at row 1 (0.45): [0, 1, 1].
HAND = t([[0.9, 0.8, 0.1], [0.5, 0.6, 0.65], [0.1, 0.3, 0.4]])
EYE3 = torch.eye(3, dtype=torch.bool)


def test_triplet_hand_counts():
    out = cocos_batch(HAND, EYE3, "triplet", {"margin": 0.2})
    assert out == pytest.approx(
        {"i2t_Cq": 4 / 3, "i2t_CB": 4, "i2t_C0": 0, "t2i_Cq": 1.0, "t2i_CB": 2, "t2i_C0": 1}
    )


def test_triplet_hardest_hand_counts():
    out = cocos_batch(HAND, EYE3, "triplet_hardest", {"margin": 0.2})
    assert out == pytest.approx(
        {"i2t_Cq": 1.0, "i2t_CB": 3, "i2t_C0": 0, "t2i_Cq": 1.0, "t2i_CB": 2, "t2i_C0": 1}
    )


def test_triplet_margin_and_masked_duplicates():
    # margin 0: only strictly harder negatives: i2t row 1 col 2 (0.65 > 0.6); t2i col 1 row 0
    # (0.8 > 0.6) and col 2 row 1 (0.65 > 0.4)
    out = cocos_batch(HAND, EYE3, "triplet", {"margin": 0.0})
    assert (out["i2t_CB"], out["t2i_CB"]) == (1, 2)
    # captions 1 and 2 describe one image: (1, 2) and (2, 1) are positives, not negatives
    pos = EYE3.clone()
    pos[1, 2] = pos[2, 1] = True
    out = cocos_batch(HAND, pos, "triplet", {"margin": 0.2})
    assert (out["i2t_CB"], out["i2t_C0"]) == (2, 1)  # row 1 keeps col 0, row 2 loses col 1
    assert (out["t2i_CB"], out["t2i_C0"]) == (1, 2)  # col 1 keeps row 0, col 2 loses row 1


def test_triplet_t2i_counts_per_caption_column():
    # Image 0 is close to captions 1 and 2, so captions 1 and 2 each have image 0 as a violating
    # negative. Both violations sit in row 0: per image row (the seed's t2i axis) the counts would be
    # [2, 0, 0] (C^q 2, C^0 2); per caption column, as they must be, [0, 1, 1] (C^q 1, C^0 1).
    sim = t([[0.5, 0.7, 0.7], [0.0, 0.6, 0.0], [0.0, 0.0, 0.6]])
    out = cocos_batch(sim, EYE3, "triplet", {"margin": 0.2})
    assert (out["i2t_Cq"], out["i2t_CB"], out["i2t_C0"]) == (2.0, 2.0, 2.0)
    assert (out["t2i_Cq"], out["t2i_CB"], out["t2i_C0"]) == (1.0, 2.0, 1.0)
    flipped = cocos_batch(sim.T, EYE3, "triplet", {"margin": 0.2})  # captions become the rows
    assert {k[4:]: v for k, v in flipped.items() if k.startswith("i2t")} == {
        k[4:]: v for k, v in out.items() if k.startswith("t2i")
    }


def test_triplet_no_contribution_gives_nan_cq():
    out = cocos_batch(torch.eye(3, dtype=torch.float64), EYE3, "triplet_hardest", {"margin": 0.2})
    assert math.isnan(out["i2t_Cq"]) and out["i2t_CB"] == 0 and out["i2t_C0"] == 3


def test_triplet_rejects_image_level_batches():
    with pytest.raises(ValueError, match="caption-level"):
        cocos_batch(torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool), "triplet")


# --- NT-Xent: hand-computed ------------------------------------------------------------------------
def test_ntxent_hand_weights():
    tau = 0.1
    probs = [
        [0.7, 0.295, 0.005],  # one negative above 0.01 (0.295); 1 - p+ = 0.3
        [0.1, 0.5, 0.4],  # both (0.1 + 0.4); 1 - p+ = 0.5
        [0.02, 0.03, 0.95],
    ]  # both (0.05); 1 - p+ = 0.05
    sim = tau * torch.log(t(probs))  # row softmax of sim / tau gives back probs
    out = cocos_batch(sim, EYE3, "ntxent", {"temperature": tau}, epsilon=0.01)
    assert out["i2t_Cqv_neg"] == pytest.approx(5 / 3)
    assert out["i2t_Wqv_neg"] == pytest.approx((0.295 + 0.5 + 0.05) / 3)
    assert out["i2t_Wqv_pos"] == pytest.approx((0.3 + 0.5 + 0.05) / 3)
    out = cocos_batch(sim, EYE3, "ntxent", {"temperature": tau}, epsilon=0.2)
    assert out["i2t_Cqv_neg"] == pytest.approx(2 / 3)  # 0.295 and 0.4
    assert out["i2t_Wqv_neg"] == pytest.approx((0.295 + 0.4) / 3)


def test_ntxent_several_positives_sum_their_weight():
    sim = 0.1 * torch.log(t([[0.3, 0.3, 0.4]]))  # one image, two of its captions, one other caption
    pos = torch.tensor([[True, True, False]])
    out = cocos_batch(sim, pos, "ntxent", {"temperature": 0.1})
    assert (out["i2t_Cqv_neg"], out["i2t_Wqv_neg"], out["i2t_Wqv_pos"]) == pytest.approx((1, 0.4, 0.4))
    # t2i: caption 2 has no positive image (left out); captions 0, 1 see only their own image
    assert (out["t2i_Cqv_neg"], out["t2i_Wqv_neg"], out["t2i_Wqv_pos"]) == pytest.approx((0, 0, 0))


# --- SmoothAP: hand-computed -----------------------------------------------------------------------
SAP = t([[0.5, 0.3, 0.505, 0.495, 0.3], [0.0, 0.0, 0.9, 0.0, 0.0]])
SAP_POS = torch.tensor([[True, True, False, False, False], [False, False, True, False, False]])


def test_smoothap_hand_counts():
    # Query 0, tau 0.01, positives 0 (s 0.5) and 1 (s 0.3):
    #   i = 0: j = 2, 3 have D = +-0.005, G = 0.6225 / 0.3775, G(1-G) = 0.2350, R = 1 + 1.0 = 2.0
    #          -> 0.2350 / 4 = 0.0588 > 0.01, twice; j = 1, 4 (D = -0.2) ~ 0.
    #   i = 1: j = 4 has D = 0, G = 0.5, G(1-G) = 0.25, R = 1 + 3 x ~1 + 0.5 = 4.5 -> 0.25 / 20.25 = 0.0123.
    #   3 pairs / |P| = 2 -> C^q = 1.5. Query 1: its positive is 0.9 above all, nothing counts -> C^0.
    out = cocos_batch(SAP, SAP_POS, "smoothap", {"tau": 0.01}, epsilon=0.01)
    assert out["i2t_Cq"] == pytest.approx(1.5) and out["i2t_C0"] == 1
    # (1, 4) passes 0.01 only narrowly because of the 1 / R(1)^2 = 1 / 20.25 factor: 0.013 drops it.
    out = cocos_batch(SAP, SAP_POS, "smoothap", {"tau": 0.01}, epsilon=0.013)
    assert out["i2t_Cq"] == pytest.approx(1.0)
    # t2i: captions 0, 1 (image 0) and 2 (image 1) each have one positive 0.3-0.5 away from the other
    # image: nothing counts; captions 3, 4 have no positive and are left out.
    assert math.isnan(out["t2i_Cq"]) and out["t2i_C0"] == 3


def test_smoothap_t2i_uses_each_captions_own_image():
    # 2 images x 2 captions each; caption query j has one positive image and one other candidate.
    # col 0: tie (D = 0): G(1-G) / R^2 = 0.25 / 1.5^2 = 0.111 -> counts; col 1: D = -0.5, no;
    # col 2: tie -> counts; col 3: D = 0.8, no.  C^q = 1 over the 2 counting captions, C^0 = 2.
    sim = t([[0.5, 0.5, 0.2, 0.9], [0.5, 0.0, 0.2, 0.1]])
    pos = torch.tensor([[True, True, False, False], [False, False, True, True]])
    out = cocos_batch(sim, pos, "smoothap", {"tau": 0.01})
    assert (out["t2i_Cq"], out["t2i_C0"]) == (pytest.approx(1.0), 2)
    # i2t: image 0's positives tie (0.25 / 2.5^2 = 0.04 each way) -> 2 / 2 = 1; image 1: none.
    assert (out["i2t_Cq"], out["i2t_C0"]) == (pytest.approx(1.0), 1)


# --- naive per-query oracles -----------------------------------------------------------------------
def _views(sim: torch.Tensor, pos: torch.Tensor):
    return {"i2t": (sim.tolist(), pos.tolist()), "t2i": (sim.T.tolist(), pos.T.tolist())}


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def ntxent_oracle(sim, pos, tau, eps):
    out = {}
    for d, (rows, rel) in _views(sim, pos).items():
        c, wn, wp = [], [], []
        for s, r in zip(rows, rel, strict=True):
            if not any(r):
                continue
            z = sum(math.exp(x / tau) for x in s)
            p = [math.exp(x / tau) / z for x in s]
            heavy = [pj for pj, rj in zip(p, r, strict=True) if not rj and pj > eps]
            c.append(len(heavy))
            wn.append(sum(heavy))
            wp.append(1.0 - sum(pj for pj, rj in zip(p, r, strict=True) if rj))
        out.update({f"{d}_Cqv_neg": np.mean(c), f"{d}_Wqv_neg": np.mean(wn), f"{d}_Wqv_pos": np.mean(wp)})
    return out


def smoothap_oracle(sim, pos, tau, eps):
    out = {}
    for d, (rows, rel) in _views(sim, pos).items():
        per_query = []
        for s, r in zip(rows, rel, strict=True):
            positives = [i for i, ri in enumerate(r) if ri]
            if not positives:
                continue
            count = 0
            for i in positives:
                g = {j: _sigmoid((s[j] - s[i]) / tau) for j in range(len(s)) if j != i}
                rank = 1.0 + sum(g.values())
                count += sum(1 for gj in g.values() if gj * (1 - gj) / rank**2 > eps)
            per_query.append(count / len(positives))
        active = [v for v in per_query if v > 0]
        out[f"{d}_Cq"] = np.mean(active) if active else math.nan
        out[f"{d}_C0"] = len(per_query) - len(active)
    return out


def caption_level(seed: int, spread: float):
    """8 captions, captions 1 and 2 of one image (an off-diagonal positive)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([0, 1, 1, 2, 3, 4, 5, 6])
    return spread * torch.randn(8, 8, generator=g, dtype=torch.float64), ids[:, None] == ids[None, :]


def image_level(seed: int, spread: float):
    """4 images x 2 captions each."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(4)[:, None] == torch.arange(8)[None, :] // 2  # (4, 8)
    return spread * torch.randn(4, 8, generator=g, dtype=torch.float64), pos


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == pytest.approx(b[k], abs=1e-12), k


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", [caption_level, image_level])
def test_ntxent_matches_per_query_oracle(seed, layout):
    sim, pos = layout(seed, 0.3)
    for tau, eps in ((0.1, 0.01), (0.05, 0.05)):
        _close(cocos_batch(sim, pos, "ntxent", {"temperature": tau}, eps), ntxent_oracle(sim, pos, tau, eps))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", [caption_level, image_level])
def test_smoothap_matches_per_query_oracle(seed, layout):
    sim, pos = layout(seed, 0.02)  # within a few tau of each other: many pairs near the threshold
    for tau, eps in ((0.01, 0.01), (0.02, 0.005)):
        _close(cocos_batch(sim, pos, "smoothap", {"tau": tau}, eps), smoothap_oracle(sim, pos, tau, eps))


def test_smoothap_chunking_does_not_change_counts(monkeypatch):
    import icr.training.analysis.cocos as cocos

    sim, pos = image_level(7, 0.02)
    whole = cocos_batch(sim, pos, "smoothap")
    monkeypatch.setattr(cocos, "SMOOTHAP_CHUNK_ELEMENTS", 1)  # one query per chunk
    _close(cocos_batch(sim, pos, "smoothap"), whole)


# --- generic counter -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["triplet", "triplet_hardest"])
def test_generic_reproduces_the_triplet_counters(seed, name):
    sim, pos = caption_level(seed, 0.3)
    own = cocos_batch(sim, pos, name, {"margin": 0.2})
    generic = cocos_batch(sim, pos, "generic", {"margin": 0.2}, objective=name)
    assert {k: v for k, v in generic.items() if "CB_pos" not in k} == pytest.approx(own)
    # the positive of every contributing query is pulled (duplicates are masked: no gradient)
    for d in ("i2t", "t2i"):
        assert generic[f"{d}_CB_pos"] == 8 - own[f"{d}_C0"]


def test_generic_threshold_is_scale_free():
    class Scaled(Triplet):  # the same objective x 1000 (a sum vs a mean reduction, say)
        def terms(self, sim, pos):
            return {k: 1000.0 * v for k, v in super().terms(sim, pos).items()}

    sim, pos = caption_level(3, 0.3)
    assert cocos_batch(sim, pos, "generic", objective=Scaled()) == cocos_batch(
        sim, pos, "generic", objective="triplet"
    )


@pytest.mark.parametrize("name", sorted(load_all()))
def test_generic_runs_for_every_objective(name):
    sampling = build_loss(name).sampling
    sim, pos = image_level(0, 0.3) if sampling == "image" else caption_level(0, 0.3)
    out = cocos_batch(sim, pos, "generic", objective=name)
    n_img, n_cap = sim.shape
    assert set(out) == {f"{d}_{k}" for d in ("i2t", "t2i") for k in ("Cq", "CB", "C0", "CB_pos")}
    assert 0 <= out["i2t_C0"] <= n_img and 0 <= out["t2i_C0"] <= n_cap
    assert out["i2t_CB"] + out["t2i_CB"] > 0  # a random batch: some negative always counts


def test_counter_for():
    assert [counter_for(n) for n in ("triplet", "triplet_hardest", "ntxent", "smoothap", "goal", "snm")] == [
        "triplet",
        "triplet_hardest",
        "ntxent",
        "smoothap",
        "generic",
        "generic",
    ]
    with pytest.raises(ValueError, match="unknown COCOS counter"):
        cocos_batch(HAND, EYE3, "bogus")
    with pytest.raises(ValueError, match="needs objective"):
        cocos_batch(HAND, EYE3, "generic")


# --- a tiny checkpoint end to end ------------------------------------------------------------------
TINY_MODEL = [
    "model.embed_dim=16",
    'model.image.kind="cnn"',
    "model.image.width=4",
    "model.image.image_size=32",
    'model.text.kind="gru"',
    "model.text.word_dim=8",
    "model.text.hidden=16",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """(data, checkpoint): 12 synthetic images, an untrained tiny model saved as a triplet checkpoint."""
    from icr.training.train import Trainer

    root = tmp_path_factory.mktemp("cocos")
    write_dataset(root / "data", train=12, val=2, test=2, image_size=32, seed=0)
    cfg = load_config(
        None,
        [
            f'data.path="{root / "data"}"',
            f'train.out="{root / "run"}"',
            "train.threads=1",
            'loss.name="triplet"',
            "train.val_every=0",
            *TINY_MODEL,
        ],
    )
    trainer = Trainer(cfg, progress=False)
    save_checkpoint(root / "ckpt", trainer.model, trainer.checkpoint_meta())
    return root / "data", root / "ckpt"


def test_run_cocos_matches_cocos_batch_on_the_planned_batch(tiny):
    data, ckpt = tiny
    result = run_cocos(ckpt, data, batch_size=8, max_batches=1, progress=False)
    assert (result["objective"], result["counter"], result["batches"], result["sampling"]) == (
        "triplet",
        "triplet",
        1,
        "caption",
    )
    # the oracle: the first planned caption batch embedded by hand
    model, _ = load_checkpoint(ckpt)
    split = open_split(data, "train")
    plan = plan_epoch(split, "caption", 8, 0, 0)[0]
    img = torch.from_numpy(embed_images(model, split, plan.img_idx))  # (8, D)
    cap = torch.from_numpy(embed_captions(model, [split.captions[int(c)] for c in plan.cap_idx]))  # (8, D)
    ids = torch.from_numpy(plan.img_idx)
    expected = cocos_batch(img @ cap.T, ids[:, None] == ids[None, :], "triplet", {"margin": 0.2})
    assert {k: v["mean"] for k, v in result["metrics"].items()} == pytest.approx(
        {k: (None if math.isnan(v) else v) for k, v in expected.items()}
    )
    assert result["metrics"]["i2t_Cq"]["symbol"] == "C^q"


def test_run_cocos_other_objectives_and_counters(tiny):
    data, ckpt = tiny
    sap = run_cocos(ckpt, data, objective="smoothap", batch_size=2, max_batches=3, progress=False)
    assert (sap["counter"], sap["sampling"], sap["batches"], sap["params"]["tau"]) == (
        "smoothap",
        "image",
        3,
        0.01,
    )
    assert set(sap["metrics"]) == {"i2t_Cq", "i2t_C0", "t2i_Cq", "t2i_C0"}
    assert 0 <= sap["metrics"]["t2i_C0"]["mean"] <= 10  # 2 images x 5 captions
    gen = run_cocos(
        ckpt,
        data,
        objective="ntxent",
        params={"temperature": 0.05},
        counter="generic",
        batch_size=8,
        max_batches=2,
        progress=False,
    )
    assert gen["counter"] == "generic" and gen["params"]["temperature"] == 0.05
    assert "i2t_CB_pos" in gen["metrics"] and gen["metrics"]["i2t_CB"]["std"] >= 0
    with pytest.raises(ValueError, match="no parameter"):
        run_cocos(ckpt, data, params={"temperature": 1.0}, max_batches=1, progress=False)  # triplet's
    with pytest.raises(ValueError, match="larger than split"):
        run_cocos(ckpt, data, batch_size=1000, progress=False)


def test_cli_writes_json_and_fails_cleanly(tiny, tmp_path):
    from icr.cli import app

    data, ckpt = tiny
    out = tmp_path / "cocos.json"
    args = [
        "analyze",
        "cocos",
        "--checkpoint",
        str(ckpt),
        "--data",
        str(data),
        "--batch-size",
        "8",
        "--max-batches",
        "2",
        "--device",
        "cpu",
        "--quiet",
    ]
    run = CliRunner().invoke(app, [*args, "--set", "margin=0.1", "--json", str(out)])
    assert run.exit_code == 0, run.output
    assert "C^q" in run.output and "+-" in run.output
    result = json.loads(out.read_text())
    assert result["params"]["margin"] == 0.1 and result["batches"] == 2
    assert set(result["metrics"]) == {f"{d}_{k}" for d in ("i2t", "t2i") for k in ("Cq", "CB", "C0")}
    bad = CliRunner().invoke(app, [*args, "--set", "loss.margin=0.1"])
    assert bad.exit_code == 2 and "error:" in bad.output
    assert CliRunner().invoke(app, [*args, "--counter", "bogus"]).exit_code == 2
    assert "Examples" in CliRunner().invoke(app, ["analyze", "cocos", "--help"]).output
