"""COCOS: counting the candidates that contribute to each query's gradient (Bleeker & de Rijke, ECIR 2022).

For a batch with similarity matrix ``S`` (Ni images x Nc captions, rows images, columns captions) and
positive mask ``pos``, i2t queries are the image rows (candidates: the captions) and t2i queries are the
caption columns (candidates: the images). Every counter returns ``{f"{direction}_{key}": value}``:

==========  ===========  =================================  ===========================================
key         paper        counters                           meaning (per batch)
==========  ===========  =================================  ===========================================
``Cq``      C^q          triplet, triplet_hardest,          mean over the queries with >= 1 contributing
                         smoothap, generic                  negative of how many contribute
``CB``      C^B          triplet, triplet_hardest, generic  contributing (query, negative) pairs in total
``C0``      C^0          triplet, triplet_hardest,          queries with nothing contributing
                         smoothap, generic
``Cqv_neg`` C^{qv-}      ntxent                             mean over queries of # negatives with p > eps
``Wqv_neg`` W^{qv-}      ntxent                             mean over queries of sum p over those
``Wqv_pos`` W^{qv+}      ntxent                             mean over queries of 1 - p(positives)
``CB_pos``  (C^B on P)   generic                            positive entries whose gradient counts
==========  ===========  =================================  ===========================================

Counters (``counter_for`` maps an objective to its counter):

* ``triplet`` / ``triplet_hardest`` (paper eq. 9-10; parameter ``margin``, default 0.2): a negative
  contributes when its hinge cost ``margin + S_neg - S_pos`` is > 0 (costs from
  :func:`icr.training.losses.triplet.hinge_costs`, so masked duplicates are never negatives). The hardest
  variant takes, like :mod:`icr.training.losses.triplet_hardest`, the max cost over the query's negatives:
  a query contributes one triplet when that max is > 0. ``Cq`` is NaN in a batch where no query
  contributes (undefined, as in the seed, which divides by zero); ``epsilon`` is not used. Needs a
  caption-level batch (square, positive of query ``i`` at ``[i, i]``).
* ``ntxent`` (paper eq. 11; ``temperature``, default 0.1): ``p = softmax(S / temperature)`` over each
  query's candidates (row for i2t, column for t2i) is the weight of each candidate in ``dL/dq``. With
  several positives (duplicate images in a caption-level batch, image-level batches) the denominator
  holds all of them and ``Wqv_pos = 1 - sum of p over the positives`` (= the mass on the negatives).
  The project's NT-Xent (``mask_duplicates``) drops duplicate positives from its denominator instead,
  so its true negative weights are slightly larger in the rare batches with a duplicate; the
  ``generic`` counter follows the loss exactly.
* ``smoothap`` (paper eq. 13; ``tau``, default 0.01): for query ``q``, each positive ``i`` and every
  other candidate ``j`` (negatives and the other positives), ``D_ij = s_j - s_i``,
  ``G = sigmoid(D / tau)``, ``R(i) = 1 + sum_{j != i} G(D_ij)``; the pair counts when
  ``G (1 - G) / R(i)^2 > epsilon`` (without the derivative's ``1 / tau``, as the seed code and the
  paper's reported values). ``Cq`` of a query is its count divided by ``|P|``; the batch value is the
  mean over queries with a count > 0. Queries are chunked so no (Q, |P|, m) tensor exceeds
  ``SMOOTHAP_CHUNK_ELEMENTS``.
* ``generic`` (any registered objective): ``g_d = d terms[d] / d S`` by autograd for the loss's
  ``"i2t"`` and ``"t2i"`` terms (a loss with other term names: the gradient of their sum, for both
  directions), i.e. the weight of every candidate in each direction's gradient w.r.t. the query. An
  entry counts when ``|g_d[i, j]| > epsilon * max |g[negative entries]|``, the max over both
  directions. The threshold is relative because losses differ in reduction (sum vs mean over the
  batch), scale and temperature: any fixed absolute threshold would count a different set for the
  same ranking behaviour, while the relative one does not change when the loss is multiplied by a
  constant. The max is over negative entries because a positive's gradient is the sum of all its
  query's pushes (e.g. ``-C^q`` for VSE0); a reference including it would grow with the number of
  contributing negatives and, at batch 128, could exceed a single negative's weight. Entry ``(i, j)``
  of the t2i term is attributed to caption query ``j`` (for cross-example objectives, whose negatives
  are shared by all queries, this is a convention). For the triplet losses it reproduces the
  dedicated counters exactly, and at epsilon > 0 it says nothing about absolute magnitudes.

Queries without any positive are left out of ntxent and smoothap (the losses ignore them too).

Deviations from the seed (ECIR ``shared/losses.py``, see the seed-code notes 1.3) on purpose: VSE0 t2i
counts per caption column (the seed sums each image row of the t2i cost matrix), SmoothAP t2i uses the
caption queries' own positive image (the seed's ``5i:5i+5`` slice makes t2i ``C^0`` ~ all queries).

:func:`run_cocos` evaluates a checkpoint over the batches the trainer would draw (eval transforms,
no gradients for the encoders) and reports mean and population standard deviation over batches;
NaN values (undefined ``Cq``) are left out and ``n`` says over how many batches a value is defined.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from icr.training.checkpoint import load_checkpoint
from icr.training.data.training_data import open_split, plan_epoch
from icr.training.embedding import embed_captions, embed_images
from icr.training.losses import build_loss
from icr.training.losses.base import ContrastiveLoss
from icr.training.losses.triplet import hinge_costs

COUNTERS = ("triplet", "triplet_hardest", "ntxent", "smoothap", "generic")
DIRECTIONS = ("i2t", "t2i")
SYMBOLS: dict[str, str] = {
    "Cq": "C^q",
    "CB": "C^B",
    "C0": "C^0",
    "Cqv_neg": "C^{qv-}",
    "Wqv_neg": "W^{qv-}",
    "Wqv_pos": "W^{qv+}",
    "CB_pos": "C^B_+",
}
DEFAULT_MARGIN = 0.2
DEFAULT_TEMPERATURE = 0.1
DEFAULT_TAU = 0.01
# Largest (queries, positives, candidates) block the SmoothAP counter builds at once (float64: 8 MiB).
SMOOTHAP_CHUNK_ELEMENTS = 1 << 20


def counter_for(objective: str) -> str:
    """The COCOS counter of an objective: its own definition for the four ECIR losses, else generic."""
    return objective if objective in ("triplet", "triplet_hardest", "ntxent", "smoothap") else "generic"


def cocos_batch(
    sim: Tensor,
    pos: Tensor,
    counter: str,
    params: Mapping[str, Any] | None = None,
    epsilon: float = 0.01,
    *,
    objective: str | ContrastiveLoss | None = None,
) -> dict[str, float]:
    """COCOS of one batch: ``{"i2t_Cq": ..., "t2i_Cq": ..., ...}`` (keys: module docstring).

    ``sim``: (Ni, Nc) similarities (rows images), ``pos``: (Ni, Nc) bool relevance. ``params``: the
    objective's parameters (``margin``, ``temperature``, ``tau``; others are ignored by the dedicated
    counters). ``objective``: only for ``counter="generic"``, a registered loss name (built with
    ``params``, at epoch 0) or a built loss.
    """
    if sim.dim() != 2 or tuple(pos.shape) != tuple(sim.shape):
        raise ValueError(
            f"cocos: expected sim and pos of one (Ni, Nc) shape, got {tuple(sim.shape)} "
            f"and {tuple(pos.shape)}"
        )
    if counter not in COUNTERS:
        raise ValueError(f"unknown COCOS counter {counter!r}; choose one of: {', '.join(COUNTERS)}")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"cocos: epsilon must be a finite number >= 0 (the paper uses 0.01), got {epsilon}")
    params = dict(params or {})
    pos = pos.to(device=sim.device, dtype=torch.bool)
    # float64: sigmoid(D / 0.01) and the thresholds on small weights are then far from rounding noise
    sim = sim.detach().to(torch.float64)  # (Ni, Nc)
    if counter == "generic":
        return _generic(sim, pos, _as_loss(objective, params), epsilon)
    if counter in ("triplet", "triplet_hardest"):
        return _triplet(sim, pos, float(params.get("margin", DEFAULT_MARGIN)), counter == "triplet_hardest")
    out: dict[str, float] = {}
    for direction in DIRECTIONS:
        scores, relevant = _query_view(sim, direction), _query_view(pos, direction)  # (Q, m) each
        if counter == "ntxent":
            stats = _ntxent(scores, relevant, float(params.get("temperature", DEFAULT_TEMPERATURE)), epsilon)
        else:
            stats = _smoothap(scores, relevant, float(params.get("tau", DEFAULT_TAU)), epsilon)
        out.update({f"{direction}_{key}": value for key, value in stats.items()})
    return out


def _query_view(x: Tensor, direction: str) -> Tensor:
    """One query per row: images as is (i2t), captions by transposing (t2i)."""
    return x if direction == "i2t" else x.T


def _count_stats(direction: str, per_query: Tensor) -> dict[str, float]:
    """C^q, C^B, C^0 from the number of contributing negatives of each query, (Q,)."""
    active = per_query > 0  # (Q,)
    total = float(per_query.sum())
    n_active = int(active.sum())
    return {
        f"{direction}_Cq": total / n_active if n_active else math.nan,
        f"{direction}_CB": total,
        f"{direction}_C0": float((~active).sum()),
    }


# --- the four ECIR definitions ---------------------------------------------------------------------
def _triplet(sim: Tensor, pos: Tensor, margin: float, hardest: bool) -> dict[str, float]:
    n = sim.shape[0]
    if sim.shape[1] != n or not bool(pos.diagonal().all()):
        raise ValueError(
            "the triplet COCOS counters need a caption-level batch: (N, N) with the positive "
            f"of query i at [i, i], got {tuple(sim.shape)}; use counter='generic' otherwise"
        )
    cost_i2t, cost_t2i = hinge_costs(sim, pos, margin)  # (N, N) each, [image, caption], 0 off negatives
    out: dict[str, float] = {}
    # t2i: caption query j is column j of cost_t2i (the seed summed rows here, i.e. per image)
    for direction, cost in (("i2t", cost_i2t), ("t2i", cost_t2i.T)):  # (N, N) one query per row
        if hardest:
            # as TripletHardest: max after the hinge, so one triplet per query and only if it violates
            per_query = (cost.max(dim=1).values > 0).long()  # (N,)
        else:
            per_query = (cost > 0).sum(dim=1)  # (N,)
        out.update(_count_stats(direction, per_query))
    return out


def _ntxent(scores: Tensor, relevant: Tensor, temperature: float, epsilon: float) -> dict[str, float]:
    """``scores``, ``relevant``: (Q, m), one query per row."""
    keep = relevant.any(dim=1)  # (Q,) the loss needs a positive
    scores, relevant = scores[keep], relevant[keep]  # (Q', m)
    if scores.shape[0] == 0:
        return {"Cqv_neg": math.nan, "Wqv_neg": math.nan, "Wqv_pos": math.nan}
    p = torch.softmax(scores / temperature, dim=1)  # (Q', m) weight of each candidate in dL/dq, x 1/tau
    negative = ~relevant  # (Q', m)
    heavy = (p > epsilon) & negative  # (Q', m) negatives that count
    return {
        "Cqv_neg": float(heavy.sum(dim=1).double().mean()),
        "Wqv_neg": float((p * heavy).sum(dim=1).mean()),
        # 1 - sum of p over the positives, summed over the negatives instead: no cancellation near 1
        "Wqv_pos": float((p * negative).sum(dim=1).mean()),
    }


def _smoothap(scores: Tensor, relevant: Tensor, tau: float, epsilon: float) -> dict[str, float]:
    """``scores``, ``relevant``: (Q, m), one query per row; any number of positives per query."""
    keep = relevant.any(dim=1)  # (Q,) queries without positives are not in the loss
    scores, relevant = scores[keep], relevant[keep]  # (Q', m)
    n_query, n_cand = scores.shape
    if n_query == 0:
        return {"Cq": math.nan, "C0": 0.0}
    n_pos = relevant.sum(dim=1)  # (Q',)
    p_max = int(n_pos.max())
    # positives first in every row (stable: candidate order), padded to Pmax, as smooth_ap_loss
    anchor_idx = torch.argsort(relevant.to(torch.uint8), dim=1, descending=True, stable=True)[:, :p_max]
    anchor_ok = torch.arange(p_max, device=scores.device)[None, :] < n_pos[:, None]  # (Q', P) not padding
    cand = torch.arange(n_cand, device=scores.device)  # (m,)
    counts = torch.zeros(n_query, dtype=torch.float64, device=scores.device)  # (Q',)
    step = max(1, SMOOTHAP_CHUNK_ELEMENTS // (p_max * n_cand))
    for start in range(0, n_query, step):
        rows = slice(start, start + step)
        s, idx = scores[rows], anchor_idx[rows]  # (q, m), (q, P)
        anchor = s.gather(1, idx)  # (q, P) s_i of each positive i
        other = cand[None, None, :] != idx[:, :, None]  # (q, P, m) j != i
        g = torch.sigmoid((s[:, None, :] - anchor[:, :, None]) / tau) * other  # (q, P, m) G(D_ij), 0 at j = i
        rank = 1.0 + g.sum(dim=2)  # (q, P) R(i)
        weight = g * (1.0 - g) / rank[:, :, None] ** 2  # (q, P, m) sim(D_ij) / R(i)^2
        counted = (weight > epsilon) & other & anchor_ok[rows][:, :, None]  # (q, P, m)
        counts[rows] = counted.sum(dim=(1, 2)).double()
    per_query = counts / n_pos  # (Q',) C^q of each query: (1 / |P|) x its count
    active = per_query > 0  # (Q',)
    return {
        "Cq": float(per_query[active].mean()) if bool(active.any()) else math.nan,
        "C0": float((~active).sum()),
    }


# --- any objective: gradient magnitudes ------------------------------------------------------------
def _as_loss(objective: str | ContrastiveLoss | None, params: dict[str, Any]) -> ContrastiveLoss:
    if isinstance(objective, ContrastiveLoss):
        return objective
    if objective is None:
        raise ValueError("the generic COCOS counter needs objective= (a registered loss name or a loss)")

    return build_loss(objective, **params)


def _direction_gradients(terms: dict[str, Tensor], leaf: Tensor) -> dict[str, Tensor]:
    """d term / d S of each direction, (Ni, Nc) each; a missing direction has a zero gradient."""

    def grad(value: Tensor) -> Tensor:
        if not value.requires_grad:
            return torch.zeros_like(leaf)
        (g,) = torch.autograd.grad(value, leaf, retain_graph=True, allow_unused=True)
        return torch.zeros_like(leaf) if g is None else g.detach()

    if terms and set(terms) <= set(DIRECTIONS):
        zero = torch.zeros_like(leaf)
        return {d: grad(terms[d]) if d in terms else zero for d in DIRECTIONS}
    # terms not named by direction: the gradient of the loss (as ContrastiveLoss.forward sums them)
    total = grad(torch.stack(list(terms.values())).sum())
    return dict.fromkeys(DIRECTIONS, total)


def _generic(sim: Tensor, pos: Tensor, loss: ContrastiveLoss, epsilon: float) -> dict[str, float]:
    leaf = sim.clone().requires_grad_(True)  # (Ni, Nc)
    with torch.enable_grad():
        terms = loss.terms(leaf, pos)
    grads = _direction_gradients(terms, leaf)
    negative = ~pos  # (Ni, Nc)
    reference = 0.0
    if bool(negative.any()):
        reference = max(float(g.abs()[negative].max()) for g in grads.values())
    threshold = epsilon * reference
    out: dict[str, float] = {}
    for direction, g in grads.items():
        counted = g.abs() > threshold  # (Ni, Nc)
        per_query = _query_view(counted & negative, direction).sum(dim=1)  # (Q,)
        out.update(_count_stats(direction, per_query))
        out[f"{direction}_CB_pos"] = float((counted & pos).sum())
    return out


# --- a checkpoint over a split ---------------------------------------------------------------------
def summarize(rows: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Per metric over batches: mean, population std (None if never defined), symbol, n defined."""
    out: dict[str, dict[str, Any]] = {}
    for name in rows[0] if rows else ():
        values = np.array([row[name] for row in rows], dtype=np.float64)  # (batches,)
        defined = values[~np.isnan(values)]
        out[name] = {
            "mean": float(defined.mean()) if len(defined) else None,
            "std": float(defined.std()) if len(defined) else None,
            "symbol": SYMBOLS[name.split("_", 1)[1]],
            "n": len(defined),
        }
    return out


def _choose_counter(counter: str | None, loss: ContrastiveLoss) -> str:
    if counter in (None, "auto"):
        chosen = counter_for(loss.name)
        # a hardest-negative checkpoint still inside its VSE0 warm-up trains on all violating negatives
        if chosen == "triplet_hardest" and loss.epoch < int(getattr(loss, "warmup_epochs", 0)):
            chosen = "triplet"
        return chosen
    if counter not in COUNTERS:
        raise ValueError(f"unknown COCOS counter {counter!r}; choose auto or one of: {', '.join(COUNTERS)}")
    return counter


def run_cocos(
    checkpoint: str | os.PathLike[str],
    data: str | os.PathLike[str],
    *,
    split: str = "train",
    objective: str | None = None,
    params: Mapping[str, Any] | None = None,
    counter: str | None = None,
    batch_size: int = 128,
    epsilon: float = 0.01,
    max_batches: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """COCOS of a checkpoint over the batches of one epoch of ``split`` (mean and std over batches).

    ``objective`` / ``params`` default to the checkpoint's (``params`` override single parameters;
    with another objective they start from its defaults). The loss is put at the checkpoint's epoch
    (``on_epoch_start``), the epoch its next step would train in. ``counter``: None or ``"auto"``
    (:func:`counter_for`; VSE0 for a triplet_hardest checkpoint inside its warm-up), ``"generic"``,
    or a counter name. Batches: ``plan_epoch(split, loss.sampling, batch_size, seed, epoch=0)``, the
    first ``max_batches`` of them; eval image transforms, no gradients for the encoders.
    """
    if batch_size < 1:
        raise ValueError(f"cocos: batch_size must be >= 1, got {batch_size}")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"cocos: max_batches must be >= 1 (or None for the whole split), got {max_batches}")
    model, config = load_checkpoint(checkpoint, device=device)
    saved = config.objective or {}
    if objective is None:
        if not saved.get("name"):
            raise ValueError(f"{checkpoint}: the checkpoint records no objective; pass one (--objective)")
        objective = str(saved["name"])
    base = dict(saved.get("params") or {}) if objective == saved.get("name") else {}
    loss = build_loss(objective, **{**base, **dict(params or {})})
    loss.on_epoch_start(config.epoch or 0)
    counter = _choose_counter(counter, loss)
    # the same captions per image as in training, so batches and positives match the trained ones
    per_image = config.captions_per_image
    # a few batches touch few images: decoding the whole split first (preload) would dominate
    split_data = open_split(
        data,
        split,
        captions_per_image=per_image,
        preload="auto" if max_batches is None else False,
        progress=progress,
    )
    plans = plan_epoch(split_data, loss.sampling, batch_size, seed, epoch=0)[:max_batches]
    if not plans:
        unit = "images" if loss.sampling == "image" else "captions"
        raise ValueError(f"cocos: batch_size={batch_size} {unit} is larger than split {split!r}; lower it")

    rows: list[dict[str, float]] = []
    for plan in tqdm(plans, desc="COCOS", unit="batch", disable=not progress):
        captions = [split_data.captions[int(c)] for c in plan.cap_idx]
        img = torch.from_numpy(embed_images(model, split_data, plan.img_idx, device=device))  # (Ni, D)
        cap = torch.from_numpy(embed_captions(model, captions, device=device))  # (Nc, D)
        img_ids = torch.from_numpy(plan.img_idx.astype(np.int64))  # (Ni,)
        cap_img_ids = torch.from_numpy(split_data.img_of_cap[plan.cap_idx].astype(np.int64))  # (Nc,)
        img, cap, img_ids, cap_img_ids = (t.to(device) for t in (img, cap, img_ids, cap_img_ids))
        with torch.no_grad():
            sim, pos = loss.batch_similarity(img, cap, img_ids, cap_img_ids)  # (Ni, Nc) each
        rows.append(cocos_batch(sim, pos, counter, loss.params(), epsilon, objective=loss))
    return {
        "objective": loss.name,
        "params": loss.params(),
        "counter": counter,
        "epsilon": epsilon,
        "batches": len(rows),
        "batch_size": batch_size,
        "sampling": loss.sampling,
        "loss_epoch": loss.epoch,
        "seed": seed,
        "split": split,
        "checkpoint": str(checkpoint),
        "metrics": summarize(rows),
    }
