"""The contract every registered loss keeps, through the base-class forward and two small towers.

Per loss (and per GOAL weight combination): a finite scalar ``"loss"`` that is the sum of the named
terms; finite gradients that reach both towers (non-zero on a random batch); finite values on a batch
of one image and on a collapsed model (all embeddings identical); unknown parameters rejected with the
valid ones listed; ``defaults()`` matching ``params()`` and JSON-serialisable.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from icr.training.losses import build_loss, load_all
from icr.training.losses.goal import PAIR_WEIGHTS, TRIPLET_WEIGHTS

CASES = [pytest.param(name, {}, id=name) for name in sorted(load_all())] + [
    pytest.param("goal", {"triplet_weight": tw, "pair_weight": pw}, id=f"goal-{tw}-{pw}")
    for tw, pw in itertools.product(TRIPLET_WEIGHTS, PAIR_WEIGHTS)
]
IN_DIM, EMBED_DIM = 12, 16
CAPTIONS_PER_IMAGE = 5  # image-level sampling (smoothap): B images, 5 captions each
# caption-level batch of 8 captions; image 2 twice (a duplicate that must not count as a negative)
CAPTION_IMG_IDS = [0, 1, 2, 2, 3, 4, 5, 6]


def towers(seed: int) -> tuple[nn.Linear, nn.Linear]:
    """Image and caption towers with weights drawn from ``seed`` (global RNG untouched)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        tower = nn.Linear(IN_DIM, EMBED_DIM)
        with torch.no_grad():
            tower.weight.copy_(torch.randn(EMBED_DIM, IN_DIM, generator=g) / IN_DIM**0.5)
            tower.bias.copy_(0.1 * torch.randn(EMBED_DIM, generator=g))
        out.append(tower)
    return out[0], out[1]


def layout(name: str, n: int) -> tuple[Tensor, Tensor]:
    """(img_ids, cap_img_ids) for the loss's sampling: ``n`` captions (caption-level), ``n`` images."""
    if build_loss(name).sampling == "image":
        return torch.arange(n), torch.arange(n).repeat_interleave(CAPTIONS_PER_IMAGE)
    ids = torch.tensor(CAPTION_IMG_IDS[:n]) if n > 1 else torch.tensor([0])
    return ids, ids.clone()


def embed(name: str, n: int, seed: int = 0, collapsed: bool = False):
    """(img, cap, img_ids, cap_img_ids, towers): normalised tower outputs for random inputs."""
    img_ids, cap_img_ids = layout(name, n)
    img_tower, cap_tower = towers(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if collapsed:  # one tower, one input: every image and caption embedding is the same vector
        cap_tower.load_state_dict(img_tower.state_dict())
        x = torch.randn(1, IN_DIM, generator=g)
        x_img, x_cap = x.expand(len(img_ids), -1), x.expand(len(cap_img_ids), -1)
    else:  # one input per image (duplicate rows identical), one per caption
        x_img = torch.randn(int(img_ids.max()) + 1, IN_DIM, generator=g)[img_ids]
        x_cap = torch.randn(len(cap_img_ids), IN_DIM, generator=g)
    img = F.normalize(img_tower(x_img), dim=1)
    cap = F.normalize(cap_tower(x_cap), dim=1)
    return img, cap, img_ids, cap_img_ids, (img_tower, cap_tower)


def run(name: str, params: dict, n: int, collapsed: bool = False):
    """Forward + backward through the towers: (output dict, gradients of both towers' weights)."""
    img, cap, img_ids, cap_img_ids, (img_tower, cap_tower) = embed(name, n, collapsed=collapsed)
    out = build_loss(name, **params)(img, cap, img_ids, cap_img_ids)
    out["loss"].backward()
    return out, (img_tower.weight.grad, cap_tower.weight.grad)


def check_output(out: dict[str, Tensor]) -> None:
    assert "loss" in out and len(out) >= 2, sorted(out)
    for key, value in out.items():
        assert value.dim() == 0 and value.dtype == torch.float32, (key, value.shape, value.dtype)
        assert torch.isfinite(value), (key, value)
    terms = torch.stack([value for key, value in out.items() if key != "loss"]).sum()
    torch.testing.assert_close(out["loss"], terms)


@pytest.mark.parametrize(("name", "params"), CASES)
def test_random_batch_gives_finite_nonzero_gradients_to_both_towers(name: str, params: dict) -> None:
    out, grads = run(name, params, n=len(CAPTION_IMG_IDS))
    check_output(out)
    for grad in grads:
        assert grad is not None and torch.isfinite(grad).all()
        assert grad.abs().sum() > 0, f"{name} {params}: no gradient reaches a tower"


@pytest.mark.parametrize(("name", "params"), CASES)
def test_batch_of_one_image_is_finite(name: str, params: dict) -> None:
    out, grads = run(name, params, n=1)
    check_output(out)
    for grad in grads:
        assert grad is not None and torch.isfinite(grad).all()


@pytest.mark.parametrize(("name", "params"), CASES)
def test_collapsed_model_is_finite(name: str, params: dict) -> None:
    out, grads = run(name, params, n=len(CAPTION_IMG_IDS), collapsed=True)
    check_output(out)
    for grad in grads:
        assert grad is not None and torch.isfinite(grad).all()


def test_random_batch_violates_the_margin() -> None:
    """Guard: the random batch has triplets on both sides of the margin, so T con is not all 0 or all 1."""
    img, cap, img_ids, _, _ = embed("goal", len(CAPTION_IMG_IDS))
    sim, pos = (img @ cap.T).detach(), img_ids[:, None] == img_ids[None, :]
    margin = build_loss("goal").margin
    hinges = []
    for s in (sim, sim.T):
        hardest = s.masked_fill(pos, -torch.inf).max(dim=1).values
        hinges.append(margin + hardest - s.diagonal() > 0)
    hinges = torch.cat(hinges)
    assert hinges.any() and not hinges.all()


@pytest.mark.parametrize(("name", "params"), CASES)
def test_unknown_parameter_lists_the_valid_ones(name: str, params: dict) -> None:
    with pytest.raises(ValueError, match="nonexistent") as error:
        build_loss(name, **params, nonexistent=1)
    for key in build_loss(name).defaults():
        assert key in str(error.value)


@pytest.mark.parametrize(("name", "params"), CASES)
def test_defaults_match_params_and_serialise(name: str, params: dict) -> None:
    cls = load_all()[name]
    defaults = cls.defaults()
    assert build_loss(name).params() == defaults
    json.dumps(defaults)
    instance = build_loss(name, **params)
    assert instance.params().keys() == defaults.keys()
    assert {key: instance.params()[key] for key in params} == params
    json.dumps(instance.params())
