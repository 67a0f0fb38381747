"""VSE0 triplet loss: hinge over every violating in-batch negative, both directions, summed.

Seed semantics (VSE++ ``ContrastiveLoss`` without ``--max_violation``, ECIR ``Triplet``): for image
query ``i`` the cost of caption ``j`` is ``[margin + S_ij - S_ii]_+``, for caption query ``j`` the cost
of image ``i`` is ``[margin + S_ij - S_jj]_+``; the loss is the SUM of both cost matrices (not a mean),
so the learning rate of the seeds carries over. Only negatives (``~pos``) cost anything: with
``mask_duplicates`` a second caption of the same image is not pushed away.
"""

from __future__ import annotations

from torch import Tensor

from icr.training.losses.base import ContrastiveLoss, register


def hinge_costs(sim: Tensor, pos: Tensor, margin: float) -> tuple[Tensor, Tensor]:
    """Per-(image, caption) hinge costs of both directions, zero where the pair is not a negative.

    ``sim``, ``pos``: (N, N) caption-level batch (positive of row/column ``i`` on the diagonal).
    Returns ``(cost_i2t, cost_t2i)``, both (N, N) indexed ``[image, caption]``: ``cost_i2t[i, j]`` is
    image query ``i`` against caption ``j``, ``cost_t2i[i, j]`` caption query ``j`` against image ``i``.
    Every entry is >= 0, so a max over a row or column without negatives is 0 (never -inf).
    """
    diag = sim.diagonal()  # (N,) positive similarities S_ii
    # clamp (not relu) as in the seeds: identical gradient except at exactly 0, where the seeds pass 1.
    cost_i2t = (margin + sim - diag[:, None]).clamp(min=0).masked_fill(pos, 0.0)  # (N, N) vs S_ii of row
    cost_t2i = (margin + sim - diag[None, :]).clamp(min=0).masked_fill(pos, 0.0)  # (N, N) vs S_jj of col
    return cost_i2t, cost_t2i


def vse0_terms(sim: Tensor, pos: Tensor, margin: float) -> dict[str, Tensor]:
    """VSE0's terms: every hinge cost summed per direction (also the warm-up of max-violation losses)."""
    cost_i2t, cost_t2i = hinge_costs(sim, pos, margin)  # (N, N) each, 0 off the negatives
    return {"i2t": cost_i2t.sum(), "t2i": cost_t2i.sum()}


@register("triplet")
class Triplet(ContrastiveLoss):
    """VSE0: sum of hinge costs over all negatives (see the module docstring)."""

    def __init__(self, margin: float = 0.2, mask_duplicates: bool = True) -> None:
        super().__init__(mask_duplicates=mask_duplicates)
        self.margin = margin

    def terms(self, sim: Tensor, pos: Tensor) -> dict[str, Tensor]:
        return vse0_terms(sim, pos, self.margin)
