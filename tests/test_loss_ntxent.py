"""Symmetric InfoNCE (`ntxent`) against a naive loop oracle of the ECIR formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from loss_batches import caption_batch, seed_pos, value_and_grads
from torch import Tensor

from icr.training.losses.ntxent import NTXent


def naive_ntxent(sim: Tensor, pos: Tensor, temperature: float) -> Tensor:
    """0.5 mean_q -log softmax over {positive} + negatives, for image rows and caption columns."""
    n = sim.shape[0]
    i2t, t2i = sim.new_zeros(()), sim.new_zeros(())
    for q in range(n):
        row = [torch.exp(sim[q, c] / temperature) for c in range(n) if c == q or not pos[q, c]]
        col = [torch.exp(sim[c, q] / temperature) for c in range(n) if c == q or not pos[c, q]]
        i2t = i2t - torch.log(torch.exp(sim[q, q] / temperature) / sum(row))
        t2i = t2i - torch.log(torch.exp(sim[q, q] / temperature) / sum(col))
    return 0.5 * i2t / n + 0.5 * t2i / n


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("temperature", [0.1, 0.05])
@pytest.mark.parametrize("mask_duplicates", [True, False])
def test_matches_naive_loops_float64(seed: int, temperature: float, mask_duplicates: bool) -> None:
    img, cap, ids = caption_batch(seed)
    pos = seed_pos(ids, mask_duplicates)
    terms = NTXent(temperature=temperature).terms(img @ cap.T, pos)
    got = value_and_grads(terms["i2t"] + terms["t2i"], img, cap)
    want = value_and_grads(naive_ntxent(img @ cap.T, pos, temperature), img, cap)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_unmasked_equals_the_seed_log_softmax_diagonal() -> None:
    """mask_duplicates=False is ECIR's NTXent: 0.5 (-mean diag log_softmax(S/t) + same for S^T)."""
    img, cap, ids = caption_batch(2, dtype=torch.float32)
    out = NTXent(mask_duplicates=False)(img, cap, ids, ids)
    sim = img @ cap.T / 0.1
    seed = -0.5 * F.log_softmax(sim, dim=1).diag().mean() - 0.5 * F.log_softmax(sim.T, dim=1).diag().mean()
    torch.testing.assert_close(out["loss"], seed)
    masked = NTXent()(img, cap, ids, ids)
    torch.testing.assert_close(masked["loss"], naive_ntxent(img @ cap.T, seed_pos(ids, True), 0.1))
    # duplicates no longer compete with the positive in the denominator
    assert float(masked["loss"].detach()) < float(out["loss"].detach())


def test_terms_are_the_weighted_halves() -> None:
    img, cap, ids = caption_batch(0, dtype=torch.float32)
    out = NTXent()(img, cap, ids, ids)
    sim, pos = img @ cap.T / 0.1, seed_pos(ids, True)
    eye = torch.eye(len(ids), dtype=torch.bool)
    i2t = F.cross_entropy(sim.masked_fill(pos & ~eye, -math.inf), torch.arange(len(ids)))
    torch.testing.assert_close(out["i2t"], 0.5 * i2t)
    torch.testing.assert_close(out["loss"], out["i2t"] + out["t2i"])


@pytest.mark.parametrize("ids", [[7], [3, 3, 3]], ids=["batch-of-1", "all-duplicates"])
def test_nothing_to_contrast_gives_zero_and_finite_grads(ids: list[int]) -> None:
    img = F.normalize(torch.randn(len(ids), 4), dim=1).requires_grad_()
    cap = F.normalize(torch.randn(len(ids), 4), dim=1).requires_grad_()
    out = NTXent()(img, cap, torch.tensor(ids), torch.tensor(ids))
    grad_img, grad_cap = torch.autograd.grad(out["loss"], (img, cap))
    torch.testing.assert_close(out["loss"].detach(), torch.tensor(0.0))
    assert torch.isfinite(grad_img).all() and torch.isfinite(grad_cap).all()
    torch.testing.assert_close(grad_img, torch.zeros_like(img))


def test_non_positive_temperature_is_rejected() -> None:
    with pytest.raises(ValueError, match="temperature"):
        NTXent(temperature=0.0)
