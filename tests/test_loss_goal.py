"""`goal`: autograd gradients of the surrogate against the paper's G_img / G_txt, computed with loops.

The oracle follows seed-code-notes §3.1-3.2 (the released ``TripletGradFun``) literally: hardest
negative per anchor, weights from python floats, then

    G_img_i = T_it_i (P-_it_i txt_n(i) - P+_it_i txt_i) - T_ti_i P+_ti_i txt_i
              + sum_{j: n(j) = i} T_ti_j P-_ti_j txt_j

and symmetrically ``G_txt`` — with the paper's Heaviside T con and the set rules (not the released
``!= 0`` counts) for the MS sets.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from loss_batches import caption_batch as _caption_batch
from loss_batches import value_and_grads
from torch import Tensor

from icr.training.losses.goal import PAIR_WEIGHTS, TRIPLET_WEIGHTS, Goal
from icr.training.losses.triplet_hardest import TripletHardest

COMBOS = list(itertools.product(TRIPLET_WEIGHTS, PAIR_WEIGHTS))
PARAMS = {
    "margin": 0.2,
    "tau": 10.0,
    "alpha": 2.0,
    "beta": 10.0,
    "lam": 0.5,
    "ms_margin": 0.1,
    "cir_relaxation": 0.5,
}
# less noise, image 9 next to caption 0 (tied hardest negative) and caption 9 redrawn around it
caption_batch = functools.partial(_caption_batch, noise=0.6, hardest_tie=True, redraw_tie_caption=True)


def separated_batch(dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    """Near-orthogonal images, captions close to them: hinges off and empty MS sets for most anchors."""
    g = torch.Generator().manual_seed(7)
    ids = torch.tensor([0, 1, 1, 2, 3, 4])
    noise = 0.1 * torch.randn(5, 8, generator=g, dtype=dtype)
    images = F.normalize(torch.eye(5, 8, dtype=dtype) + noise, dim=1)  # (5, D)
    img = images[ids].clone()  # (N, D)
    cap = F.normalize(img + 0.15 * torch.randn(len(ids), 8, generator=g, dtype=dtype), dim=1)  # (N, D)
    return img.requires_grad_(), cap.requires_grad_(), ids


BATCHES = {
    "mixed-0": lambda: caption_batch(0),
    "mixed-1": lambda: caption_batch(1),
    "separated": separated_batch,
}


def oracle_weights(sim: list[list[float]], pos: list[list[bool]], tw: str, pw: str, p: dict) -> list:
    """Per anchor (row of ``sim``): (hardest, T, P+, P-, |P set|, |N set|), or None without negatives."""
    n = len(sim)
    positives = [sim[k][k] for k in range(n)]
    out = []
    for i in range(n):
        negatives = [j for j in range(n) if not pos[i][j]]
        if not negatives:
            out.append(None)
            continue
        hard = negatives[0]
        for j in negatives:
            if sim[i][j] > sim[i][hard]:  # first maximum on ties, like torch.max(dim)
                hard = j
        sp, sn = sim[i][i], sim[i][hard]
        if tw == "con":
            t = 1.0 if p["margin"] + sn - sp > 0 else 0.0
        elif tw == "nca":
            t = 1 / (1 + math.exp(p["tau"] * (sp - sn)))
        else:
            t = 1 / (1 + math.exp(p["tau"] * (sp * (2 - sp) - sn * sn - p["cir_relaxation"])))
        pos_set = [positives[k] for k in range(n) if k != i and positives[k] <= sn + p["ms_margin"]]
        neg_set = [sim[i][j] for j in negatives if j != hard and sim[i][j] >= min(positives) - p["ms_margin"]]
        if pw == "con":
            wp, wn = 1.0, 1.0
        elif pw == "lin":
            wp, wn = 1 - sp, sn
        elif pw == "sig":
            wp = 1 / (math.exp(p["alpha"] * (sp - p["lam"])) + 1)
            wn = 1 / (math.exp(-p["beta"] * (sn - p["lam"])) + 1)
        elif pw == "lin_ms":
            m_pos = sum(sp - v for v in pos_set) / len(pos_set) if pos_set else 0.0
            m_neg = sum(sn - v for v in neg_set) / len(neg_set) if neg_set else 0.0
            wp, wn = (1 - m_pos) * (1 - sp), (1 + m_neg) * sn
        else:
            m_pos = sum(math.exp(p["alpha"] * (sp - v)) for v in pos_set) / len(pos_set) if pos_set else 0.0
            m_neg = sum(math.exp(p["beta"] * (v - sn)) for v in neg_set) / len(neg_set) if neg_set else 0.0
            wp = 1 / (math.exp(p["alpha"] * (sp - p["lam"])) + m_pos)
            wn = 1 / (math.exp(-p["beta"] * (sn - p["lam"])) + m_neg)
        out.append((hard, t, wp, wn, len(pos_set), len(neg_set)))
    return out


def oracle_gradients(img: Tensor, cap: Tensor, pos: Tensor, tw: str, pw: str, p: dict = PARAMS):
    """(surrogate value, G_img, G_txt) of seed-code-notes §3.1, with loops over anchors."""
    img, cap = img.detach(), cap.detach()
    sim = (img @ cap.T).tolist()
    sim_t = [list(col) for col in zip(*sim, strict=True)]
    pos_l, pos_t = pos.tolist(), pos.T.tolist()
    it = oracle_weights(sim, pos_l, tw, pw, p)  # image anchors, caption negatives
    ti = oracle_weights(sim_t, pos_t, tw, pw, p)  # caption anchors, image negatives
    n = len(sim)
    value = 0.0
    g_img, g_txt = torch.zeros_like(img), torch.zeros_like(cap)
    for i in range(n):
        if it[i] is not None:
            hard, t, wp, wn, _, _ = it[i]
            value += t * (wn * sim[i][hard] - wp * sim[i][i])
            g_img[i] += t * (wn * cap[hard] - wp * cap[i])
        if ti[i] is not None:
            hard, t, wp, wn, _, _ = ti[i]
            value += t * (wn * sim[hard][i] - wp * sim[i][i])
            g_txt[i] += t * (wn * img[hard] - wp * img[i])
            g_img[i] -= t * wp * cap[i]
        if it[i] is not None:
            _, t, wp, _, _, _ = it[i]
            g_txt[i] -= t * wp * img[i]
        for j in range(n):  # i as the hardest negative of another anchor
            if ti[j] is not None and ti[j][0] == i:
                g_img[i] += ti[j][1] * ti[j][3] * cap[j]
            if it[j] is not None and it[j][0] == i:
                g_txt[i] += it[j][1] * it[j][3] * img[j]
    return torch.tensor(value, dtype=img.dtype), g_img, g_txt


def goal_value(loss: Goal, img: Tensor, cap: Tensor, pos: Tensor) -> Tensor:
    terms = loss.terms(img @ cap.T, pos)
    return terms["i2t"] + terms["t2i"]


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(("tw", "pw"), COMBOS)
def test_gradient_matches_paper_formulas_float64(tw: str, pw: str, batch: str) -> None:
    img, cap, ids = BATCHES[batch]()
    pos = ids[:, None] == ids[None, :]
    got = value_and_grads(goal_value(Goal(tw, pw), img, cap, pos), img, cap)
    want = oracle_gradients(img, cap, pos, tw, pw)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_batches_exercise_every_branch() -> None:
    """Guard for the oracle test: hinges on and off, empty and non-empty MS sets in the test batches."""
    hinge, pos_set, neg_set = set(), set(), set()
    for make_batch in BATCHES.values():
        img, cap, ids = make_batch()
        sim, pos = (img @ cap.T).tolist(), (ids[:, None] == ids[None, :]).tolist()
        sim_t, pos_t = [list(c) for c in zip(*sim, strict=True)], [list(c) for c in zip(*pos, strict=True)]
        for anchor in oracle_weights(sim, pos, "con", "lin_ms", PARAMS) + oracle_weights(
            sim_t, pos_t, "con", "lin_ms", PARAMS
        ):
            hinge.add(anchor[1])
            pos_set.add(anchor[4] > 0)
            neg_set.add(anchor[5] > 0)
    assert hinge == {0.0, 1.0} and pos_set == {True, False} and neg_set == {True, False}


@pytest.mark.parametrize(("tw", "pw"), [("con", "con"), ("nca", "sig_ms"), ("cir", "lin_ms")])
def test_unmasked_forward_matches_released_semantics(tw: str, pw: str) -> None:
    """mask_duplicates=False: only the diagonal is positive, as in the released code (float32 path)."""
    img, cap, ids = caption_batch(2, dtype=torch.float32)
    out = Goal(tw, pw, mask_duplicates=False)(img, cap, ids, ids)
    got = value_and_grads(out["loss"], img, cap)
    want = oracle_gradients(img, cap, torch.eye(len(ids), dtype=torch.bool), tw, pw)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("tw", "pw"), [("con", "con"), ("cir", "sig_ms")])
def test_scaling_the_loss_scales_the_gradient(tw: str, pw: str) -> None:
    """grad_output is respected (loss weights, AMP scaling), unlike the released autograd.Function."""
    img, cap, ids = caption_batch(0)
    pos = ids[:, None] == ids[None, :]
    loss = Goal(tw, pw)
    _, g_img, g_cap = value_and_grads(goal_value(loss, img, cap, pos), img, cap)
    _, s_img, s_cap = value_and_grads(-2.5 * goal_value(loss, img, cap, pos), img, cap)
    assert g_img.abs().sum() > 0
    torch.testing.assert_close(s_img, -2.5 * g_img)
    torch.testing.assert_close(s_cap, -2.5 * g_cap)


@pytest.mark.parametrize("mask_duplicates", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_con_con_gradient_is_vsepp(seed: int, mask_duplicates: bool) -> None:
    img, cap, ids = caption_batch(seed)
    pos = ids[:, None] == ids[None, :] if mask_duplicates else torch.eye(len(ids), dtype=torch.bool)
    _, g_img, g_cap = value_and_grads(goal_value(Goal("con", "con"), img, cap, pos), img, cap)
    terms = TripletHardest().terms(img @ cap.T, pos)
    _, h_img, h_cap = value_and_grads(terms["i2t"] + terms["t2i"], img, cap)
    torch.testing.assert_close(g_img, h_img, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_cap, h_cap, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("tw", "pw"), [("con", "con"), ("cir", "sig_ms")])
def test_warmup_is_vse0_then_the_gradient_objective(tw: str, pw: str) -> None:
    """warmup_epochs = 1: the VSE0 hinge sum in epoch 0 (VSE-infinity's warm-up), GOAL from epoch 1."""
    img, cap, ids = caption_batch(0)
    pos = ids[:, None] == ids[None, :]
    loss = Goal(tw, pw, warmup_epochs=1)
    loss.on_epoch_start(0)
    warm = value_and_grads(sum(loss.terms(img @ cap.T, pos).values()), img, cap)
    vse0 = value_and_grads(naive_vse0(img @ cap.T, pos, 0.2), img, cap)
    loss.on_epoch_start(1)
    after = value_and_grads(goal_value(loss, img, cap, pos), img, cap)
    plain = value_and_grads(goal_value(Goal(tw, pw), img, cap, pos), img, cap)
    for got, want in [*zip(warm, vse0, strict=True), *zip(after, plain, strict=True)]:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="warmup_epochs"):
        Goal(warmup_epochs=-1)


def naive_vse0(sim: Tensor, pos: Tensor, margin: float) -> Tensor:
    """VSE0 with loops: the hinge of every (query, negative) pair, both directions, summed."""
    total = sim.new_zeros(())
    n = sim.shape[0]
    for i in range(n):
        for j in range(n):
            if not pos[i, j]:
                total = total + (margin + sim[i, j] - sim[i, i]).clamp(min=0)  # image i, caption j
                total = total + (margin + sim[i, j] - sim[j, j]).clamp(min=0)  # caption j, image i
    return total


@pytest.mark.parametrize("ids", [[7], [3, 3, 3]], ids=["batch-of-1", "all-duplicates"])
@pytest.mark.parametrize(("tw", "pw"), COMBOS)
def test_nothing_to_contrast_gives_zero_and_finite_grads(ids: list[int], tw: str, pw: str) -> None:
    img = F.normalize(torch.randn(len(ids), 4), dim=1).requires_grad_()
    cap = F.normalize(torch.randn(len(ids), 4), dim=1).requires_grad_()
    out = Goal(tw, pw)(img, cap, torch.tensor(ids), torch.tensor(ids))
    grad_img, grad_cap = torch.autograd.grad(out["loss"], (img, cap))
    assert float(out["loss"].detach()) == 0.0
    assert torch.equal(grad_img, torch.zeros_like(img)) and torch.equal(grad_cap, torch.zeros_like(cap))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"triplet_weight": "hinge"}, "con, nca, cir"),
        ({"pair_weight": "ms"}, "con, lin, sig, lin_ms, sig_ms"),
    ],
)
def test_unknown_weight_names_list_the_valid_ones(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Goal(**kwargs)
