"""Multi-positive symmetric InfoNCE: every positive of a query is a target, not only its own pair.

For caption query ``j`` with positive images ``P(j)`` (its own image, its image's other rows, and
any pair the batch marks relevant, e.g. the embedded benchmark's ground truth):

    L_t2i(j) = -log( sum_{i in P(j)} exp(S[i, j] / t) / sum_i exp(S[i, j] / t) )

and the same over captions for image queries (MIL-NCE's form); ``L = 0.5 mean_j L_t2i + 0.5 mean_i
L_i2t``. Where ``ntxent`` with ``mask_duplicates`` only stops pushing a known-relevant image away,
this pulls every relevant image above the irrelevant ones, which is what precision over a gallery
(P@10, thresholds) asks of a model when a caption is true of many images ("a red shape").

``sampling``: ``image`` (default) takes batches of B images with all their captions, so each image
is encoded once for its k captions (k times fewer image encodings per caption than caption-level
batches); ``caption`` takes the usual caption-level batches. With the annotations only, a caption's
positives are its own image (and that image's repeats): the loss is then NT-Xent's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from icr.training.losses.base import ContrastiveLoss, register


def _multi_positive_nll(logits: Tensor, pos: Tensor) -> Tensor:
    """Mean over rows of -log(sum of softmax over the row's positives); every row has one."""
    positive = torch.logsumexp(logits.masked_fill(~pos, float("-inf")), dim=1)  # (N,)
    return (torch.logsumexp(logits, dim=1) - positive).mean()


@register("ntxent_multi")
class NTXentMulti(ContrastiveLoss):
    """Symmetric multi-positive InfoNCE (see the module docstring)."""

    sampling = "image"  # the default; an instance may take caption-level batches
    logit_scale_param = "temperature"

    def __init__(
        self, temperature: float = 0.1, sampling: str = "image", mask_duplicates: bool = True
    ) -> None:
        super().__init__(mask_duplicates=mask_duplicates)
        if temperature <= 0:
            raise ValueError(f"ntxent_multi: temperature must be > 0, got {temperature}")
        if sampling not in ("image", "caption"):
            raise ValueError(f"ntxent_multi: sampling must be image or caption, got {sampling!r}")
        self.temperature = temperature
        self.sampling = sampling  # per instance: the trainer plans its batches from it

    def terms(self, sim: Tensor, pos: Tensor) -> dict[str, Tensor]:
        logits = self.scaled(sim)  # (Ni, Nc), S / temperature
        return {
            "i2t": 0.5 * _multi_positive_nll(logits, pos),
            "t2i": 0.5 * _multi_positive_nll(logits.T, pos.T),
        }
