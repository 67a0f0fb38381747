"""`smoothap` (positives-only (Q, Pmax, m) differences) against the seed's full (m, m) matrix per query."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loss_batches import value_and_grads
from torch import Tensor

from icr.training.losses.smoothap import SmoothAP

# Image-level batches: cap_img_ids per layout; image ids are 0 .. n_images - 1.
LAYOUTS = {
    # the ECIR layout: B images x k captions, captions of image i at columns k*i .. k*i + k - 1
    "seed-4x3": (4, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]),
    # variable number of positives, image 4 without any caption (a query that is skipped)
    "general": (5, [0, 0, 0, 1, 2, 2, 3, 3, 3, 3]),
}


def image_batch(n_images: int, cap_img_ids: list[int], seed: int, dtype: torch.dtype = torch.float64):
    """L2-normalised (img, cap, img_ids, cap_img_ids) with exactly tied caption scores."""
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(n_images, 6, generator=g, dtype=dtype), dim=1)  # (B, D)
    cap_ids = torch.tensor(cap_img_ids)
    cap = F.normalize(img[cap_ids] + 0.8 * torch.randn(len(cap_ids), 6, generator=g, dtype=dtype), dim=1)
    cap[2] = cap[0]  # two captions of one image tie (positive vs positive)
    cap[-1] = cap[1]  # a caption of another image ties with a positive (negative vs positive)
    return img.requires_grad_(), cap.requires_grad_(), torch.arange(n_images), cap_ids


def seed_sigmoid(x: Tensor, tau: float) -> Tensor:
    """The seed's hand-written, clamped sigmoid (values only; its gradient vanishes for |x| > 50 tau)."""
    return 1.0 / (1.0 + torch.exp(torch.clamp(-x / tau, min=-50, max=50)))


def naive_smoothap_direction(scores: Tensor, pos: Tensor, tau: float, sigmoid=None) -> Tensor:
    """Seed algorithm per query: full (m, m) difference matrix D[i, j] = s_j - s_i, AP over positives."""
    sigmoid = sigmoid or (lambda x, t: torch.sigmoid(x / t))
    losses = []
    for q in range(scores.shape[0]):
        s, p = scores[q], pos[q].to(scores.dtype)  # (m,), (m,)
        if not pos[q].any():
            continue
        m = s.shape[0]
        diff = s.repeat(m, 1) - s.repeat(m, 1).T  # (m, m)
        step = sigmoid(diff, tau) * (1 - torch.eye(m, dtype=scores.dtype))  # (m, m)
        rank = 1 + step.sum(dim=1)  # (m,)
        rank_pos = 1 + (step * p).sum(dim=1)  # (m,)
        ap = sum(rank_pos[i] / rank[i] for i in range(m) if pos[q, i]) / p.sum()
        losses.append(1 - ap)
    return sum(losses) / len(losses) if losses else scores.sum() * 0


def naive_smoothap(sim: Tensor, pos: Tensor, tau: float, sigmoid=None) -> Tensor:
    return 0.5 * naive_smoothap_direction(sim, pos, tau, sigmoid) + 0.5 * naive_smoothap_direction(
        sim.T, pos.T, tau, sigmoid
    )


@pytest.mark.parametrize("tau", [0.01, 0.1])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_matches_full_difference_matrix_float64(layout: str, seed: int, tau: float) -> None:
    img, cap, img_ids, cap_ids = image_batch(*LAYOUTS[layout], seed)
    pos = img_ids[:, None] == cap_ids[None, :]  # (B, Nc)
    terms = SmoothAP(tau=tau).terms(img @ cap.T, pos)
    got = value_and_grads(terms["i2t"] + terms["t2i"], img, cap)
    want = value_and_grads(naive_smoothap(img @ cap.T, pos, tau), img, cap)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert got[1].abs().sum() > 0  # ties keep the gradient alive even at tau = 0.01


def test_value_equals_the_seed_clamped_sigmoid() -> None:
    img, cap, img_ids, cap_ids = image_batch(*LAYOUTS["seed-4x3"], seed=3)
    sim = (img @ cap.T).detach()
    gt = torch.eye(4, dtype=torch.bool).repeat_interleave(3, dim=1)  # the seed's ground truth
    terms = SmoothAP().terms(sim, img_ids[:, None] == cap_ids[None, :])
    torch.testing.assert_close(terms["i2t"] + terms["t2i"], naive_smoothap(sim, gt, 0.01, seed_sigmoid))
    torch.testing.assert_close(terms["i2t"], 0.5 * naive_smoothap_direction(sim, gt, 0.01, seed_sigmoid))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_forward_float32(layout: str) -> None:
    img, cap, img_ids, cap_ids = image_batch(*LAYOUTS[layout], seed=4, dtype=torch.float32)
    out = SmoothAP(tau=0.05)(img, cap, img_ids, cap_ids)
    want = naive_smoothap(img @ cap.T, img_ids[:, None] == cap_ids[None, :], 0.05)
    torch.testing.assert_close(out["loss"], want)


def test_caption_level_layout_is_a_general_pos() -> None:
    """Ni == Nc with repeated images: t2i queries then have several positive (identical) image rows."""
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([0, 1, 1, 2, 3, 3, 3])
    img = F.normalize(torch.randn(4, 6, generator=g, dtype=torch.float64), dim=1)[ids].requires_grad_()
    cap = F.normalize(torch.randn(7, 6, generator=g, dtype=torch.float64), dim=1).requires_grad_()
    loss = SmoothAP(tau=0.1)
    out = loss(img.float(), cap.float(), ids, ids)
    assert torch.isfinite(out["loss"]).all()
    pos = ids[:, None] == ids[None, :]
    got = value_and_grads(sum(loss.terms(img @ cap.T, pos).values()), img, cap)
    want = value_and_grads(naive_smoothap(img @ cap.T, pos, 0.1), img, cap)
    for g_, w in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n_captions", [1, 3])
def test_single_image_gives_finite_loss_and_grads(n_captions: int) -> None:
    img = F.normalize(torch.randn(1, 4), dim=1).requires_grad_()
    cap = F.normalize(torch.randn(n_captions, 4), dim=1).requires_grad_()
    out = SmoothAP()(img, cap, torch.tensor([0]), torch.zeros(n_captions, dtype=torch.long))
    grads = torch.autograd.grad(out["loss"], (img, cap))
    torch.testing.assert_close(out["loss"].detach(), torch.tensor(0.0))  # every caption is relevant: AP = 1
    assert all(torch.isfinite(g).all() for g in grads)


def test_queries_without_positives_are_skipped_without_nan() -> None:
    sim = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    pos = torch.zeros(3, 5, dtype=torch.bool)
    terms = SmoothAP().terms(sim, pos)
    (grad,) = torch.autograd.grad(terms["i2t"] + terms["t2i"], sim)
    assert float(terms["i2t"].detach()) == 0.0 and float(terms["t2i"].detach()) == 0.0
    assert torch.equal(grad, torch.zeros_like(sim))


def test_non_positive_tau_is_rejected() -> None:
    with pytest.raises(ValueError, match="tau"):
        SmoothAP(tau=-0.01)
