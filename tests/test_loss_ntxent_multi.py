"""Multi-positive InfoNCE (`ntxent_multi`) against naive loops; known-relevant pairs via the base class."""

from __future__ import annotations

import math

import pytest
import torch
from loss_batches import caption_batch, seed_pos, value_and_grads
from torch import Tensor

from icr.training.losses import build_loss
from icr.training.losses.ntxent import NTXent
from icr.training.losses.ntxent_multi import NTXentMulti


def naive_multi(sim: Tensor, pos: Tensor, temperature: float) -> Tensor:
    """0.5 mean over image rows and 0.5 mean over caption columns of -log(sum_pos e / sum_all e)."""
    n_img, n_cap = sim.shape
    i2t = sim.new_zeros(())
    for i in range(n_img):
        num = sum(torch.exp(sim[i, c] / temperature) for c in range(n_cap) if pos[i, c])
        den = sum(torch.exp(sim[i, c] / temperature) for c in range(n_cap))
        i2t = i2t - torch.log(num / den)
    t2i = sim.new_zeros(())
    for c in range(n_cap):
        num = sum(torch.exp(sim[i, c] / temperature) for i in range(n_img) if pos[i, c])
        den = sum(torch.exp(sim[i, c] / temperature) for i in range(n_img))
        t2i = t2i - torch.log(num / den)
    return 0.5 * i2t / n_img + 0.5 * t2i / n_cap


def image_batch(seed: int, n_img: int = 6, per_image: int = 5) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    img = torch.nn.functional.normalize(torch.randn(n_img, 8, generator=g, dtype=torch.float64), dim=1)
    cap_img = torch.arange(n_img).repeat_interleave(per_image)
    cap = torch.nn.functional.normalize(
        img[cap_img] + 0.8 * torch.randn(len(cap_img), 8, generator=g, dtype=torch.float64), dim=1
    )
    return img.requires_grad_(), cap.requires_grad_(), torch.arange(n_img), cap_img


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("temperature", [0.1, 0.05])
def test_image_level_matches_naive_loops(seed: int, temperature: float) -> None:
    img, cap, img_ids, cap_img = image_batch(seed)
    g = torch.Generator().manual_seed(seed + 10)
    relevant = torch.rand(len(img_ids), len(cap_img), generator=g) < 0.15  # known extra positives
    loss = NTXentMulti(temperature=temperature)
    out = loss(img, cap, img_ids, cap_img, relevant)
    pos = (img_ids[:, None] == cap_img[None, :]) | relevant
    got = value_and_grads(out["loss"], img, cap)
    want = value_and_grads(naive_multi(img @ cap.T, pos, temperature), img, cap)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_caption_level_with_one_positive_each_is_ntxent() -> None:
    """Without duplicates or extra positives, a caption's only positive is its own image: NT-Xent."""
    g = torch.Generator().manual_seed(3)
    img = torch.nn.functional.normalize(torch.randn(7, 6, generator=g, dtype=torch.float64), dim=1)
    cap = torch.nn.functional.normalize(img + torch.randn(7, 6, generator=g, dtype=torch.float64), dim=1)
    ids = torch.arange(7)
    multi = NTXentMulti(sampling="caption")(img, cap, ids, ids)["loss"]
    torch.testing.assert_close(multi, NTXent()(img, cap, ids, ids)["loss"])


def test_caption_level_duplicates_count_as_positives() -> None:
    img, cap, ids = caption_batch(0)
    out = NTXentMulti(sampling="caption", temperature=0.1)(img, cap, ids, ids)
    want = naive_multi(img @ cap.T, seed_pos(ids, True), 0.1)
    torch.testing.assert_close(out["loss"], want)


def test_relevant_pairs_become_positives_of_every_loss() -> None:
    """The base class unites ``relevant`` with the annotated pairs: ntxent stops pushing them away."""
    img, cap, ids = caption_batch(1)
    relevant = torch.zeros(len(ids), len(ids), dtype=torch.bool)
    relevant[0, 5] = relevant[7, 2] = True
    loss = build_loss("ntxent")
    sim, pos = loss.batch_similarity(img, cap, ids, ids, relevant)
    assert (
        bool(pos[0, 5]) and bool(pos[7, 2]) and torch.equal(pos & ~relevant, seed_pos(ids, True) & ~relevant)
    )
    with pytest.raises(ValueError, match="relevant must be a bool tensor"):
        loss(img, cap, ids, ids, relevant.float())
    with pytest.raises(ValueError, match="relevant must be a bool tensor of shape"):
        loss(img, cap, ids, ids, relevant[:3])


def test_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="sampling must be image or caption"):
        NTXentMulti(sampling="pairs")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        NTXentMulti(temperature=0.0)
    assert NTXentMulti().sampling == "image" and NTXentMulti(sampling="caption").sampling == "caption"
    assert math.isclose(NTXentMulti.defaults()["temperature"], 0.1)
