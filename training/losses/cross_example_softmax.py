"""Cross-example softmax (Veit & Wilber Eq. 4-5): one negative set, every negative score of the batch."""

from __future__ import annotations

from torch import Tensor

from icr.training.losses.base import register
from icr.training.losses.softmax_family import SoftmaxFamilyLoss, masked_logsumexp


@register("cross_example_softmax")
class CrossExampleSoftmaxLoss(SoftmaxFamilyLoss):
    """``mean_q softplus(logsumexp(scale * N_B) - scale * s_qq)``, ``N_B`` = all negative entries of S.

    Every positive must beat every negative of the batch (a global threshold, hence calibrated
    scores). The set is shared, and in the caption layout both directions have the same positives
    (the diagonal), so ``direction`` only names the term ("both" gives two equal halves); it is
    kept for a uniform interface with the other softmax losses.
    """

    def negative_lse(self, logits: Tensor, neg: Tensor, direction: str) -> Tensor:  # noqa: ARG002 (shared set)
        shared = masked_logsumexp(logits.flatten(), neg.flatten(), dim=0)  # () over the N*N - N* negatives
        return shared.expand(logits.shape[0])  # (N,)
