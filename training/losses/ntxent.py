"""Symmetric NT-Xent / InfoNCE over the in-batch similarity matrix.

``L = 0.5 * mean_i CE(S[i, :] / temperature, i) + 0.5 * mean_j CE(S[:, j] / temperature, j)``
(ECIR ``NTXent(tau=0.1)``): image queries score all captions of the batch, caption queries all
images, the positive is the diagonal. With ``mask_duplicates`` the other captions (images) of the same
image are removed from the softmax denominator instead of being treated as negatives; the terms are
returned already weighted by 0.5, so ``i2t + t2i`` is the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from icr.training.losses.base import ContrastiveLoss, register


@register("ntxent")
class NTXent(ContrastiveLoss):
    """Symmetric InfoNCE with temperature ``temperature`` (see the module docstring)."""

    logit_scale_param = "temperature"

    def __init__(self, temperature: float = 0.1, mask_duplicates: bool = True) -> None:
        super().__init__(mask_duplicates=mask_duplicates)
        if temperature <= 0:
            raise ValueError(f"ntxent: temperature must be > 0 (ECIR uses 0.1), got {temperature}")
        self.temperature = temperature

    def terms(self, sim: Tensor, pos: Tensor) -> dict[str, Tensor]:
        n = sim.shape[0]
        eye = torch.eye(n, dtype=torch.bool, device=sim.device)  # (N, N)
        # -inf, not a large negative: exp gives exactly 0, and the diagonal keeps every row non-empty
        logits = self.scaled(sim).masked_fill(pos & ~eye, float("-inf"))  # (N, N), S / temperature
        target = torch.arange(n, device=sim.device)  # (N,)
        return {"i2t": 0.5 * F.cross_entropy(logits, target), "t2i": 0.5 * F.cross_entropy(logits.T, target)}
