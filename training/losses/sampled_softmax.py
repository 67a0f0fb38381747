"""Sampled softmax (Veit & Wilber Eq. 2): each query's negatives are its own row or column of S."""

from __future__ import annotations

from torch import Tensor

from icr.training.losses.base import register
from icr.training.losses.softmax_family import SoftmaxFamilyLoss, masked_logsumexp, query_view


@register("sampled_softmax")
class SampledSoftmaxLoss(SoftmaxFamilyLoss):
    """``mean_q softplus(logsumexp_{j in N(q)} l_qj - l_qq)``, ``l = scale * S``, ``N(q)`` = q's negatives."""

    def negative_lse(self, logits: Tensor, neg: Tensor, direction: str) -> Tensor:
        return masked_logsumexp(query_view(logits, direction), query_view(neg, direction), dim=1)  # (N,)
