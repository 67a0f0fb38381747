"""Smooth-AP (Brown et al. 2020) as used by ECIR 2022: 1 - smoothed average precision per query.

For a query with candidate scores ``s_1 .. s_m`` and positive set ``P``, with
``g(x) = sigmoid(x / tau)`` standing in for the Heaviside step,

    R(i)  = 1 + sum_{j != i}        g(s_j - s_i)    (smooth rank of candidate i among all)
    R+(i) = 1 + sum_{j in P, j != i} g(s_j - s_i)   (smooth rank among the positives)
    AP    = (1 / |P|) sum_{i in P} R+(i) / R(i)

i2t: each image (row of ``S``) queries all captions of the batch; t2i: each caption (column) queries
all images. ``loss = 0.5 * mean_q (1 - AP_q) [i2t] + 0.5 * mean_q (1 - AP_q) [t2i]``; the terms are
returned already weighted by 0.5. Queries without any positive are left out of the mean.

Differences from the seed code, on purpose:

* Memory. The seed builds the (Q, m, m) difference matrix of every candidate pair (128 x 640 x 640
  floats at B = 128, several copies kept for autograd: GBs). Only the rows of the positives enter AP,
  so we gather the positives of each query into a padded (Q, Pmax) tensor and build (Q, Pmax, m)
  differences: Pmax = 5 for i2t, 1 for t2i (``python -m bench.smoothap_memory`` measures both).
* ``torch.sigmoid`` instead of the seed's ``1 / (1 + exp(clamp(-x / tau, -50, 50)))``: same values,
  but the clamp zeroed gradients for |x| > 50 tau and the hand-written exp overflows in half precision.
  The loss is computed in fp32 (the base class casts ``S``).

Batches are image-level (``sampling = "image"``): B images and their captions, ``pos`` general (any
number of positives per query). A caption-level batch also works, it is just another ``pos``.
``mask_duplicates`` is accepted for the common interface but has no effect here: ``pos`` from the
image ids already is the true relevance.
"""

from __future__ import annotations

import torch
from torch import Tensor

from icr.training.losses.base import ContrastiveLoss, register


def smooth_ap_loss(scores: Tensor, pos: Tensor, tau: float) -> Tensor:
    """Mean over queries with >= 1 positive of ``1 - SmoothAP``; 0 (with a graph) when there is none.

    ``scores``: (Q, m) query x candidate scores, ``pos``: (Q, m) bool relevance.
    """
    n_query, n_cand = scores.shape
    n_pos = pos.sum(dim=1)  # (Q,)
    has_pos = n_pos > 0  # (Q,)
    p_max = int(n_pos.max()) if n_query else 0
    if p_max == 0:
        return scores.sum() * 0.0  # keeps the graph: zero gradients, not a missing one
    # Positives first in every row (stable: in candidate order), then keep the first Pmax columns.
    anchor_idx = torch.argsort(pos.to(torch.uint8), dim=1, descending=True, stable=True)[:, :p_max]  # (Q, P)
    anchor_ok = torch.arange(p_max, device=scores.device)[None, :] < n_pos[:, None]  # (Q, P) not padding
    anchor_score = scores.gather(1, anchor_idx)  # (Q, P) s_i of each positive i
    diff = scores[:, None, :] - anchor_score[:, :, None]  # (Q, P, m) s_j - s_i
    cand = torch.arange(n_cand, device=scores.device)
    other = cand[None, None, :] != anchor_idx[:, :, None]  # (Q, P, m) j != i
    step = torch.sigmoid(diff / tau) * other  # (Q, P, m) smoothed [s_j > s_i]
    rank_all = 1.0 + step.sum(dim=2)  # (Q, P) R(i) >= 1
    rank_pos = 1.0 + (step * pos[:, None, :]).sum(dim=2)  # (Q, P) R+(i)
    ratio = torch.where(anchor_ok, rank_pos / rank_all, torch.zeros_like(rank_all))  # (Q, P)
    ap = ratio.sum(dim=1) / n_pos.clamp(min=1)  # (Q,)
    return ((1.0 - ap) * has_pos).sum() / has_pos.sum()


@register("smoothap")
class SmoothAP(ContrastiveLoss):
    """1 - Smooth-AP, both directions, over image-level batches (see the module docstring)."""

    sampling = "image"

    def __init__(self, tau: float = 0.01, mask_duplicates: bool = True) -> None:
        super().__init__(mask_duplicates=mask_duplicates)
        if tau <= 0:
            raise ValueError(f"smoothap: tau must be > 0 (ECIR uses 0.01), got {tau}")
        self.tau = tau

    def terms(self, sim: Tensor, pos: Tensor) -> dict[str, Tensor]:
        # sigmoid(x / 0.01) needs at least fp32; forward() already passes fp32, float64 stays float64
        sim = sim.to(torch.promote_types(sim.dtype, torch.float32))
        return {
            "i2t": 0.5 * smooth_ap_loss(sim, pos, self.tau),  # image queries over captions
            "t2i": 0.5 * smooth_ap_loss(sim.T, pos.T, self.tau),  # caption queries over images
        }
