"""VSE++ triplet loss: hinge on the hardest in-batch negative of each query, both directions, summed.

For image query ``i`` the cost is ``max_j [margin + S_ij - S_ii]_+`` over its negative captions, for
caption query ``j`` it is ``max_i [margin + S_ij - S_jj]_+`` over its negative images (max after the
hinge, as in the seeds); the loss is the sum over all queries. A query without negatives costs 0.

Hardest-negative training can collapse (loss stuck at ``2 * B * margin``, all similarities equal;
vsepp issue #27). VSE-infinity's mitigation is ``warmup_epochs``: while ``self.epoch < warmup_epochs``
the loss is exactly the VSE0 sum over all negatives (:mod:`icr.training.losses.triplet`).
"""

from __future__ import annotations

from torch import Tensor

from icr.training.losses.base import ContrastiveLoss, register
from icr.training.losses.triplet import hinge_costs, vse0_terms


@register("triplet_hardest")
class TripletHardest(ContrastiveLoss):
    """VSE++ max-violation triplet loss with an optional VSE0 warm-up (see the module docstring)."""

    def __init__(self, margin: float = 0.2, warmup_epochs: int = 0, mask_duplicates: bool = True) -> None:
        super().__init__(mask_duplicates=mask_duplicates)
        if warmup_epochs < 0:
            raise ValueError(
                f"triplet_hardest: warmup_epochs must be >= 0 (epochs of VSE0 first), got {warmup_epochs}"
            )
        self.margin = margin
        self.warmup_epochs = warmup_epochs

    def terms(self, sim: Tensor, pos: Tensor) -> dict[str, Tensor]:
        if self.epoch < self.warmup_epochs:
            return vse0_terms(sim, pos, self.margin)
        cost_i2t, cost_t2i = hinge_costs(sim, pos, self.margin)  # (N, N) each, 0 off the negatives
        # max over dim with indices: the gradient goes to one hardest negative (the first on ties)
        return {"i2t": cost_i2t.max(dim=1).values.sum(), "t2i": cost_t2i.max(dim=0).values.sum()}
