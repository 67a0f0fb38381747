"""Stochastic negative mining, SNM (Veit & Wilber Eq. 3): sampled softmax over each query's top-k."""

from __future__ import annotations

import torch
from torch import Tensor

from icr.training.losses.base import register
from icr.training.losses.softmax_family import (
    SoftmaxFamilyLoss,
    check_keep_fraction,
    kept_count,
    masked_logsumexp,
    query_view,
    top_mask,
)


@register("snm")
class StochasticNegativeMiningLoss(SoftmaxFamilyLoss):
    """Sampled softmax whose negative set is the query's ``k`` largest negative scores.

    ``k = ceil(keep_fraction * n_q)`` with ``n_q`` the query's valid negatives (masked duplicates
    make it vary per query), or ``min(k, n_q)`` when an absolute ``k`` is given (it overrides the
    fraction). The paper keeps "the 50% largest scores from the respective negative sets".
    """

    def __init__(
        self,
        keep_fraction: float = 0.5,
        k: int | None = None,
        scale: float = 20.0,
        direction: str = "t2i",
        mask_duplicates: bool = True,
    ) -> None:
        super().__init__(scale=scale, direction=direction, mask_duplicates=mask_duplicates)
        check_keep_fraction(keep_fraction)
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k must be a positive integer, or None to use keep_fraction; got {k!r}")
        self.keep_fraction = keep_fraction
        self.k = k

    def negative_lse(self, logits: Tensor, neg: Tensor, direction: str) -> Tensor:
        scores, valid = query_view(logits, direction), query_view(neg, direction)  # (N, N) query rows
        available = valid.sum(dim=1, keepdim=True)  # (N, 1) valid negatives per query
        if self.k is None:
            keep = kept_count(available, self.keep_fraction)
        else:
            keep = torch.clamp(available, max=self.k)
        return masked_logsumexp(scores, top_mask(scores, valid, keep, dim=1), dim=1)  # (N,)
