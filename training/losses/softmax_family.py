"""Shared machinery of the four softmax objectives of Veit & Wilber ("Cross-Example Softmax").

All four are one formula with a different negative set ``N`` (paper Eq. 2-6)::

    L = mean over queries q of  -log( e^{l_qq} / (e^{l_qq} + sum_{l in N(q)} e^l) )
      = mean over queries q of  softplus( logsumexp(N(q)) - l_qq ),       l = scale * S

* sampled softmax: ``N(q)`` = the query's own negatives (its row or column, Eq. 2);
* SNM: the top-k of those (Eq. 3);
* cross-example softmax: one set shared by every query, all negative entries of ``S`` (Eq. 4-5);
* cross-example negative mining: the top-k of that shared set (Eq. 6).

A subclass therefore only implements :meth:`SoftmaxFamilyLoss.negative_lse`. The softplus form
never evaluates ``log(0)``: an empty negative set has ``logsumexp = -inf`` and
``softplus(-inf) = 0``, with zero (not NaN) gradients thanks to :func:`masked_logsumexp`.

Directions, in the caption layout of :mod:`icr.training.losses.base` (rows images, columns captions):
``"i2t"`` queries are images (row ``i``), ``"t2i"`` queries are captions (column ``j``; the paper's
setting: text queries retrieve images), ``"both"`` averages the two (each term carries weight 1/2,
so the returned terms sum to the average).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from icr.training.losses.base import ContrastiveLoss

DIRECTIONS: dict[str, tuple[str, ...]] = {"t2i": ("t2i",), "i2t": ("i2t",), "both": ("i2t", "t2i")}


def query_view(x: Tensor, direction: str) -> Tensor:
    """``x`` (rows images, columns captions) with one query per row: as is for i2t, transposed for t2i."""
    return x if direction == "i2t" else x.T


def masked_logsumexp(x: Tensor, mask: Tensor, dim: int) -> Tensor:
    """``log(sum(exp(x[mask])))`` along ``dim``; ``-inf`` with zero gradient where ``mask`` is empty.

    ``torch.logsumexp`` of an all ``-inf`` slice returns ``-inf`` but back-propagates
    ``exp(-inf - (-inf)) = NaN``; here the empty slices are shifted by 0 instead of by their max
    and the log is taken of 1 instead of 0, then replaced by ``-inf`` through ``torch.where``.
    """
    filled = x.masked_fill(~mask, float("-inf"))
    # The shift only stabilises exp(); detaching it leaves the value and the gradient unchanged.
    peak = filled.amax(dim=dim, keepdim=True).detach()
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = torch.exp(filled - peak).sum(dim=dim)  # >= 1 on a non-empty set: its max contributes e^0
    nonempty = mask.any(dim=dim)
    lse = torch.log(torch.where(nonempty, total, torch.ones_like(total))) + peak.squeeze(dim)
    return torch.where(nonempty, lse, torch.full_like(lse, float("-inf")))


def top_mask(x: Tensor, mask: Tensor, k: Tensor | int, dim: int = -1) -> Tensor:
    """The ``k`` largest entries of ``x[mask]`` along ``dim`` as a boolean mask shaped like ``x``.

    ``k`` (int, or a tensor broadcasting against ``x`` with size 1 along ``dim``) must not exceed
    the number of masked entries. Ties at the k-th value go to the lower index (stable sort), so
    the selection -- and hence the gradient, which flows only into selected scores -- is
    deterministic; ``torch.topk`` leaves the tie order unspecified.
    """
    order = torch.sort(x.masked_fill(~mask, float("-inf")), dim=dim, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    positions = torch.arange(x.shape[dim], device=x.device)
    shape = [1] * x.dim()
    shape[dim] = -1
    ranks.scatter_(dim, order, positions.view(shape).expand_as(order))  # rank of every entry
    return (ranks < k) & mask


def kept_count(n: Tensor, keep_fraction: float) -> Tensor:
    """``ceil(keep_fraction * n)`` (at least one kept negative whenever there is one).

    Rounded to 6 decimals first so that e.g. 0.07 * 100 keeps 7, not ``ceil(7.000000000000001) = 8``.
    """
    return torch.ceil(torch.round(n.double() * keep_fraction, decimals=6)).long()


def check_keep_fraction(keep_fraction: float) -> None:
    if not (isinstance(keep_fraction, (int, float)) and 0.0 < keep_fraction <= 1.0):
        raise ValueError(f"keep_fraction must be in (0, 1] (the paper keeps 0.5), got {keep_fraction!r}")


class SoftmaxFamilyLoss(ContrastiveLoss):
    """Base of the four softmax objectives: ``scale`` (logit scale, the paper's 20) and ``direction``."""

    sampling = "caption"
    logit_scale_param = "scale"

    def __init__(self, scale: float = 20.0, direction: str = "t2i", mask_duplicates: bool = True) -> None:
        super().__init__(mask_duplicates=mask_duplicates)
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a positive finite number (the paper uses 20), got {scale!r}")
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
        self.scale = scale
        self.direction = direction

    def negative_lse(self, logits: Tensor, neg: Tensor, direction: str) -> Tensor:
        """``logsumexp`` of each query's negative set, (N,), ``-inf`` where it is empty.

        ``logits`` (N, N) = scale * S and ``neg`` (N, N) bool are in the image-row layout; the
        query of ``direction`` is row ``q`` (i2t) or column ``q`` (t2i), see :func:`query_view`.
        """
        raise NotImplementedError

    def terms(self, sim: Tensor, pos: Tensor) -> dict[str, Tensor]:
        logits = self.scaled(sim)  # (N, N), scale * S
        neg = ~pos  # (N, N); excludes the diagonal and (with mask_duplicates) same-image pairs
        positives = logits.diagonal()  # (N,) the positive of query q is S[q, q] in both directions
        names = DIRECTIONS[self.direction]
        out: dict[str, Tensor] = {}
        for name in names:
            per_query = F.softplus(self.negative_lse(logits, neg, name) - positives)  # (N,)
            out[name] = per_query.mean() / len(names)
        return out
