"""Cross-example negative mining (Veit & Wilber Eq. 6): the shared negative set cut to its top scores."""

from __future__ import annotations

from torch import Tensor

from icr.training.losses.base import register
from icr.training.losses.softmax_family import (
    SoftmaxFamilyLoss,
    check_keep_fraction,
    kept_count,
    masked_logsumexp,
    top_mask,
)


@register("cross_example_mining")
class CrossExampleMiningLoss(SoftmaxFamilyLoss):
    """Cross-example softmax over the ``ceil(keep_fraction * |N_B|)`` largest negatives of the whole batch.

    Mined over the batch, not per query: some queries may contribute all their negatives and
    others none (paper Fig. 2). Ties are broken by the flat index of S (rows images), so the
    selection does not depend on ``direction`` (which, as for cross-example softmax, only names
    the term).
    """

    def __init__(
        self,
        keep_fraction: float = 0.5,
        scale: float = 20.0,
        direction: str = "t2i",
        mask_duplicates: bool = True,
    ) -> None:
        super().__init__(scale=scale, direction=direction, mask_duplicates=mask_duplicates)
        check_keep_fraction(keep_fraction)
        self.keep_fraction = keep_fraction

    def negative_lse(self, logits: Tensor, neg: Tensor, direction: str) -> Tensor:  # noqa: ARG002 (shared set)
        flat, valid = logits.flatten(), neg.flatten()  # (N*N,)
        mined = top_mask(flat, valid, kept_count(valid.sum(), self.keep_fraction), dim=0)  # (N*N,)
        return masked_logsumexp(flat, mined, dim=0).expand(logits.shape[0])  # (N,)
