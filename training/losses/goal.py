"""GOAL (Xuan & Chen, WACV 2023): objectives defined by their gradient, one hardest negative per anchor.

Per direction (i2t: image anchor ``i``, positive caption ``i``; t2i: caption anchor ``j``, positive image
``j``) the hardest in-batch negative is mined over the negatives (``~pos``), giving ``s_p = S_ii`` and
``s_n``. The paper prescribes the gradient ``dL/ds_n = T * P-``, ``dL/ds_p = -T * P+`` with a triplet
weight ``T`` and pair weights ``(P+, P-)``:

=============  ==============================================================================
``T`` con      Heaviside(margin + s_n - s_p > 0)  (paper eq. 5: con/con is the VSE++ gradient)
``T`` nca      sigmoid(tau (s_n - s_p))
``T`` cir      1 / (1 + exp(tau (s_p (2 - s_p) - s_n^2 - cir_relaxation)))
``P`` con      (1, 1)
``P`` lin      (1 - s_p, s_n)
``P`` sig      (1 / (exp(alpha (s_p - lam)) + 1), 1 / (exp(-beta (s_n - lam)) + 1))
``P`` lin_ms   ((1 - m+) (1 - s_p), (1 + m-) s_n)
``P`` sig_ms   (1 / (exp(alpha (s_p - lam)) + m+), 1 / (exp(-beta (s_n - lam)) + m-))
=============  ==============================================================================

``margin`` only enters T con, ``tau`` only T nca / T cir, ``alpha``, ``beta``, ``lam`` only P sig / P sig_ms.
``m+`` / ``m-`` are means of relative similarities over MS-style sets, for anchor ``i`` (eps =
``ms_margin``): the positive set holds the other pairs' positives ``Pos_k`` (k != i) with
``Pos_k <= s_n + eps``, valued ``Pos_i - Pos_k`` (lin_ms) or ``exp(alpha (Pos_i - Pos_k))`` (sig_ms);
the negative set holds the anchor's negatives other than the hardest with ``S_ij >= min_k Pos_k - eps``,
valued ``s_n - S_ij`` (lin_ms) or ``exp(beta (S_ij - s_n))`` (sig_ms). An empty set gives 0, as in the
released code (so sig_ms with empty sets is ``exp(-alpha (s_p - lam))``, not P sig).

Implementation: an ordinary autograd loss. All weights are computed on detached similarities under
``torch.no_grad()``, and the returned value is the surrogate
``L = sum_anchors T * (P- * s_n - P+ * s_p)`` over both directions, whose autograd gradient w.r.t. the
embeddings is exactly the paper's / released code's ``G_img``, ``G_txt`` (including the terms of an
embedding used as someone's hardest negative). Unlike the released ``autograd.Function``, whose backward
ignores ``grad_output``, this respects loss weights and AMP loss scaling. **The VALUE is only a
surrogate** (it is not a loss whose minimum means anything, and it is not comparable across weight
settings); only its gradient is meaningful. Sum over anchors, like VSE++.

Defaults and deviations from ``microsoft/VSE_Gradient`` (``Gradient/gradient.py``):

* ``tau = 10``: the paper's Fig. 2 value. The released ``TripletGrad`` defaults to ``tau=1``, which makes
  T nca / T cir nearly flat over the cosine range; pass ``tau=1.0`` to reproduce it.
* T con is the paper's Heaviside of the hinge; the released code uses a constant 1. A margin above 2
  (cosine gaps are at most 2) gives the released behaviour.
* ``cir_relaxation = 0.5`` is the released code's ``- 0.5`` in T cir (paper eq. 8 has none, i.e. 0).
* ``warmup_epochs``: VSE0 (the hinge summed over all negatives, :mod:`icr.training.losses.triplet`)
  for the first epochs, then the gradient objective. GOAL is trained on VSE-infinity's code, whose
  region-feature runs use ``--vse_mean_warmup_epochs 1``; GOAL's Table 2 (T con / P con reproduces
  VSE-infinity's triplet numbers) holds only with the same warm-up (``triplet_hardest`` has it too).
* Fixed reference bugs: set membership of lin_ms counted by the set rule, not by ``value != 0`` /
  ``value > 0`` (ties and negative linear differences were dropped from the counts); alpha/beta taken
  from the parameters (the released ``sig_ms_term`` reads undefined globals); in-batch duplicates of an
  image are not negatives (``mask_duplicates``); anchors without any negative contribute 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from icr.training.losses.base import ContrastiveLoss, register
from icr.training.losses.triplet import vse0_terms

TRIPLET_WEIGHTS = ("con", "nca", "cir")
PAIR_WEIGHTS = ("con", "lin", "sig", "lin_ms", "sig_ms")


def _masked_mean(values: Tensor, member: Tensor) -> Tensor:
    """Row means of ``values`` over ``member`` (both (N, M)); 0 for empty rows."""
    total = torch.where(member, values, torch.zeros_like(values)).sum(dim=1)  # (N,)
    return total / member.sum(dim=1).clamp(min=1)


@register("goal")
class Goal(ContrastiveLoss):
    """Gradient-defined triplet objective, ``triplet_weight`` x ``pair_weight`` (see the module docstring)."""

    def __init__(
        self,
        triplet_weight: str = "con",
        pair_weight: str = "con",
        margin: float = 0.2,
        tau: float = 10.0,
        alpha: float = 2.0,
        beta: float = 10.0,
        lam: float = 0.5,
        ms_margin: float = 0.1,
        cir_relaxation: float = 0.5,
        warmup_epochs: int = 0,
        mask_duplicates: bool = True,
    ) -> None:
        super().__init__(mask_duplicates=mask_duplicates)
        if warmup_epochs < 0:
            raise ValueError(f"goal: warmup_epochs must be >= 0 (epochs of VSE0 first), got {warmup_epochs}")
        if triplet_weight not in TRIPLET_WEIGHTS:
            raise ValueError(
                f"goal: unknown triplet_weight {triplet_weight!r}; "
                f"choose one of: {', '.join(TRIPLET_WEIGHTS)}"
            )
        if pair_weight not in PAIR_WEIGHTS:
            raise ValueError(
                f"goal: unknown pair_weight {pair_weight!r}; choose one of: {', '.join(PAIR_WEIGHTS)}"
            )
        self.triplet_weight = triplet_weight
        self.pair_weight = pair_weight
        self.margin = margin
        self.tau = tau
        self.alpha = alpha
        self.beta = beta
        self.lam = lam
        self.ms_margin = ms_margin
        self.cir_relaxation = cir_relaxation
        self.warmup_epochs = warmup_epochs

    def terms(self, sim: Tensor, pos: Tensor) -> dict[str, Tensor]:
        if self.epoch < self.warmup_epochs:
            return vse0_terms(sim, pos, self.margin)
        return {"i2t": self._direction(sim, pos), "t2i": self._direction(sim.T, pos.T)}

    def _direction(self, sim: Tensor, pos: Tensor) -> Tensor:
        """Surrogate of one direction: anchors are the rows of ``sim`` (N, N), positives on the diagonal."""
        negative = ~pos  # (N, N)
        has_negative = negative.any(dim=1)  # (N,)
        with torch.no_grad():
            s = sim.detach()
            s_pos = s.diagonal()  # (N,)
            hardest, neg_idx = s.masked_fill(pos, float("-inf")).max(dim=1)  # (N,), (N,)
            # anchors without negatives: any finite stand-in, their triplet weight is 0 below
            s_neg = torch.where(has_negative, hardest, torch.zeros_like(hardest))  # (N,)
            w_tri = self._triplet_weights(s_pos, s_neg) * has_negative  # (N,)
            w_pos, w_neg = self._pair_weights(s, negative, s_pos, s_neg, neg_idx)  # (N,), (N,)
        s_p = sim.diagonal()  # (N,) with grad
        s_n = sim.gather(1, neg_idx[:, None]).squeeze(1)  # (N,) with grad
        return (w_tri * (w_neg * s_n - w_pos * s_p)).sum()

    def _triplet_weights(self, s_pos: Tensor, s_neg: Tensor) -> Tensor:
        if self.triplet_weight == "con":
            return (self.margin + s_neg - s_pos > 0).to(s_pos.dtype)
        if self.triplet_weight == "nca":
            return torch.sigmoid(self.tau * (s_neg - s_pos))
        return torch.sigmoid(-self.tau * (s_pos * (2 - s_pos) - s_neg**2 - self.cir_relaxation))  # cir

    def _pair_weights(
        self, s: Tensor, negative: Tensor, s_pos: Tensor, s_neg: Tensor, neg_idx: Tensor
    ) -> tuple[Tensor, Tensor]:
        mode = self.pair_weight
        if mode == "con":
            return torch.ones_like(s_pos), torch.ones_like(s_neg)
        if mode == "lin":
            return 1 - s_pos, s_neg
        if mode == "sig":
            w_pos = torch.sigmoid(-self.alpha * (s_pos - self.lam))  # 1 / (exp(alpha (s_p - lam)) + 1)
            return w_pos, torch.sigmoid(self.beta * (s_neg - self.lam))
        pos_rs, neg_rs = self._relative_similarity(s, negative, s_pos, s_neg, neg_idx)
        if mode == "lin_ms":
            return (1 - pos_rs) * (1 - s_pos), (1 + neg_rs) * s_neg
        w_pos = 1 / (torch.exp(self.alpha * (s_pos - self.lam)) + pos_rs)  # sig_ms
        w_neg = 1 / (torch.exp(-self.beta * (s_neg - self.lam)) + neg_rs)
        return w_pos, w_neg

    def _relative_similarity(
        self, s: Tensor, negative: Tensor, s_pos: Tensor, s_neg: Tensor, neg_idx: Tensor
    ) -> tuple[Tensor, Tensor]:
        """MS relative-similarity means ``(m+, m-)`` per anchor, (N,) each; 0 for an empty set."""
        n = s.shape[0]
        others = ~torch.eye(n, dtype=torch.bool, device=s.device)  # (N, N)
        # positive set of anchor i: other pairs' positives not clearly above i's hardest negative
        in_pos_set = others & (s_pos[None, :] <= s_neg[:, None] + self.ms_margin)  # (N, N) [i, k]
        # negative set: i's negatives except the hardest, above the batch's smallest positive - eps
        in_neg_set = negative & (s >= s_pos.min() - self.ms_margin)  # (N, N) [i, j]
        in_neg_set = in_neg_set.scatter(1, neg_idx[:, None], False)
        pos_gap = s_pos[:, None] - s_pos[None, :]  # (N, N) Pos_i - Pos_k
        neg_gap = s - s_neg[:, None]  # (N, N) S_ij - s_n (<= 0 on negatives)
        if self.pair_weight == "lin_ms":
            return _masked_mean(pos_gap, in_pos_set), _masked_mean(-neg_gap, in_neg_set)
        return (
            _masked_mean(torch.exp(self.alpha * pos_gap), in_pos_set),
            _masked_mean(torch.exp(self.beta * neg_gap), in_neg_set),
        )
