"""Shared batches and helpers of the loss oracle tests (imported as ``from loss_batches import ...``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Caption-level batch: image 1 twice and image 3 three times, so off-diagonal positives exist.
IMG_IDS = [0, 1, 1, 2, 3, 3, 3, 4, 5, 6]


def caption_batch(
    seed: int,
    dtype: torch.dtype = torch.float64,
    noise: float = 0.7,
    hardest_tie: bool = False,
    redraw_tie_caption: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """L2-normalised (img, cap, ids) with duplicate images (identical rows) and exactly tied captions.

    Always: captions are their image plus ``noise`` times Gaussian noise; caption 4 equals caption 0
    (one caption embedding for two images: tied negatives) and caption 2 equals caption 1 (a duplicated
    (image, caption) pair: tied positives). ``hardest_tie``: image 9 is moved next to caption 0, so
    that caption ties with / is the hardest negative. ``redraw_tie_caption`` (with ``hardest_tie``):
    caption 9 is redrawn around the moved image 9. The random draws happen in this order, so a given
    set of flags always reproduces the same batch.
    """
    if redraw_tie_caption and not hardest_tie:
        raise ValueError("redraw_tie_caption needs hardest_tie")
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(IMG_IDS)
    images = F.normalize(torch.randn(int(ids.max()) + 1, 6, generator=g, dtype=dtype), dim=1)
    img = images[ids].clone()  # (N, D) one image, identical rows
    cap = F.normalize(img + noise * torch.randn(len(ids), 6, generator=g, dtype=dtype), dim=1)  # (N, D)
    cap[4] = cap[0]  # one caption embedding for two images: tied negatives
    cap[2] = cap[1]  # a duplicated (image, caption) pair: tied positives
    if hardest_tie:
        img[9] = F.normalize(cap[0] + 0.05 * torch.randn(6, generator=g, dtype=dtype), dim=0)  # tie = hardest
    if redraw_tie_caption:
        cap[9] = F.normalize(img[9] + noise * torch.randn(6, generator=g, dtype=dtype), dim=0)
    return img.requires_grad_(), cap.requires_grad_(), ids


def seed_pos(ids: Tensor, mask_duplicates: bool) -> Tensor:
    """The positive mask the base class passes: same image id, or only the diagonal (seed semantics)."""
    if mask_duplicates:
        return ids[:, None] == ids[None, :]
    return torch.eye(len(ids), dtype=torch.bool)


def value_and_grads(value: Tensor, img: Tensor, cap: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(value, d value / d img, d value / d cap), the value detached."""
    grad_img, grad_cap = torch.autograd.grad(value, (img, cap))
    return value.detach(), grad_img, grad_cap
