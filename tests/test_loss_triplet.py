"""VSE0 (`triplet`) and VSE++ (`triplet_hardest`) against a naive loop oracle of the seed formulas."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from loss_batches import caption_batch as _caption_batch
from loss_batches import seed_pos, value_and_grads
from torch import Tensor

from icr.training.losses.triplet import Triplet
from icr.training.losses.triplet_hardest import TripletHardest

# image 9 next to caption 0: a tied hardest negative
caption_batch = functools.partial(_caption_batch, hardest_tie=True)


def naive_triplet(sim: Tensor, pos: Tensor, margin: float, hardest: bool) -> Tensor:
    """Seed formulas with loops: [m + S_ic - S_ii]_+ (image query i), [m + S_cj - S_jj]_+ (caption j)."""
    n = sim.shape[0]
    total = sim.new_zeros(())
    for q in range(n):
        i2t = [torch.clamp(margin + sim[q, c] - sim[q, q], min=0) for c in range(n) if not pos[q, c]]
        t2i = [torch.clamp(margin + sim[c, q] - sim[q, q], min=0) for c in range(n) if not pos[c, q]]
        for costs in (i2t, t2i):
            if not costs:
                continue
            if hardest:
                best = costs[0]
                for cost in costs[1:]:
                    if cost > best:  # first maximum on ties
                        best = cost
                total = total + best
            else:
                for cost in costs:
                    total = total + cost
    return total


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mask_duplicates", [True, False])
@pytest.mark.parametrize("hardest", [False, True])
def test_matches_naive_loops_float64(seed: int, mask_duplicates: bool, hardest: bool) -> None:
    img, cap, ids = caption_batch(seed)
    pos = seed_pos(ids, mask_duplicates)
    loss = TripletHardest() if hardest else Triplet()
    got = value_and_grads(sum(loss.terms(img @ cap.T, pos).values()), img, cap)
    want = value_and_grads(naive_triplet(img @ cap.T, pos, 0.2, hardest), img, cap)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mask_duplicates", [True, False])
@pytest.mark.parametrize("cls", [Triplet, TripletHardest])
def test_forward_builds_the_seed_or_masked_positives(mask_duplicates: bool, cls: type) -> None:
    img, cap, ids = caption_batch(3, dtype=torch.float32)
    out = cls(mask_duplicates=mask_duplicates)(img, cap, ids, ids)
    want = naive_triplet(img @ cap.T, seed_pos(ids, mask_duplicates), 0.2, cls is TripletHardest)
    torch.testing.assert_close(out["loss"], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["loss"], out["i2t"] + out["t2i"])


def test_duplicates_are_not_negatives() -> None:
    img, cap, ids = caption_batch(0)
    sim = (img @ cap.T).detach()
    masked, seed = Triplet().terms(sim, seed_pos(ids, True)), Triplet().terms(sim, seed_pos(ids, False))
    # the seed pushes a second caption of the same image away; the masked loss does not
    assert float(masked["i2t"]) < float(seed["i2t"])


def test_hardest_warmup_is_vse0_then_max_violation() -> None:
    img, cap, ids = caption_batch(1)
    pos = seed_pos(ids, True)
    loss = TripletHardest(warmup_epochs=1)
    loss.on_epoch_start(0)
    warm = value_and_grads(sum(loss.terms(img @ cap.T, pos).values()), img, cap)
    vse0 = value_and_grads(sum(Triplet().terms(img @ cap.T, pos).values()), img, cap)
    loss.on_epoch_start(1)
    after = value_and_grads(sum(loss.terms(img @ cap.T, pos).values()), img, cap)
    vsepp = value_and_grads(naive_triplet(img @ cap.T, pos, 0.2, hardest=True), img, cap)
    for got, want in [*zip(warm, vse0, strict=True), *zip(after, vsepp, strict=True)]:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert float(warm[0]) > float(after[0])


@pytest.mark.parametrize("ids", [[7], [3, 3, 3]], ids=["batch-of-1", "all-duplicates"])
@pytest.mark.parametrize("cls", [Triplet, TripletHardest])
def test_nothing_to_contrast_gives_zero_and_finite_grads(ids: list[int], cls: type) -> None:
    img = F.normalize(torch.randn(len(ids), 4), dim=1).requires_grad_()
    cap = F.normalize(torch.randn(len(ids), 4), dim=1).requires_grad_()
    out = cls()(img, cap, torch.tensor(ids), torch.tensor(ids))
    grad_img, grad_cap = torch.autograd.grad(out["loss"], (img, cap))
    assert float(out["loss"].detach()) == 0.0
    assert torch.equal(grad_img, torch.zeros_like(img)) and torch.equal(grad_cap, torch.zeros_like(cap))


def test_negative_warmup_is_rejected() -> None:
    with pytest.raises(ValueError, match="warmup_epochs"):
        TripletHardest(warmup_epochs=-1)
