"""Score -> relevance from a few hundred human labels, each value a finite-sample lower bound.

A user's labels are few: a map fitted to them as if they were the truth promises what a handful of
lucky hits showed. Here every value is a one-sided Clopper-Pearson lower confidence bound instead:

* the labelled hits are sorted by score and cut, from the top, into blocks of at least
  ``min_block`` labels (the top is where thresholds act and labels are fewest);
* adjacent blocks whose fractions relevant do not rise with score are pooled (pool adjacent
  violators, weighted by labels; equal neighbours too, since their labels together bound tighter),
  so the fractions rise with the score, as relevance does;
* each block's value is the Clopper-Pearson lower bound of its fraction relevant at ``confidence``
  (exact, from the binomial distribution: no normal approximation at small counts), then raised to
  the largest bound of any block below it. That is still a lower bound when relevance does not fall
  as the score rises: a hit scored above a block is relevant at least as often as that block's hits.

What it promises: for hits the service returns, exchangeable with the labelled ones (labels taken
on served hits, not on pairs chosen for being easy), a hit in a block is relevant with probability
at least the block's value, each with ``confidence`` (pointwise per block). Below the lowest
labelled score there is no evidence: the map gives 0 there.

:func:`out_of_fold` judges the map as a user would meet it: each labelled pair is judged by a map
fitted on labels that share neither its query nor its image.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from icr.training.evaluation.metrics.calibration import Calibration

DEFAULT_CONFIDENCE = 0.95
DEFAULT_MIN_BLOCK = 10  # labels per block at least: a value rests on no fewer
HALF_WIDTH = 0.05  # how tight "enough labels" means: the bound within 0.05 of the fraction


def _binomial_tail(log_choose: np.ndarray, k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (exact for the counts labels come in);
    ``log_choose`` (n - k + 1,): log C(n, i) for i = k..n."""
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    i = np.arange(k, n + 1, dtype=np.float64)
    log_pmf = log_choose + i * math.log(p) + (n - i) * math.log1p(-p)  # (n - k + 1,)
    top = float(log_pmf.max())
    return float(min(1.0, math.exp(top) * np.exp(log_pmf - top).sum()))


def clopper_pearson_lower(relevant: int, n: int, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """One-sided Clopper-Pearson lower bound of a fraction ``relevant / n``: the smallest p at which
    ``relevant`` or more successes in ``n`` still have probability ``1 - confidence`` (0 when
    ``relevant`` is 0). Found by bisection on the binomial tail, which rises with p."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n < 1 or not 0 <= relevant <= n:
        raise ValueError(f"need 0 <= relevant <= n and n >= 1, got {relevant} of {n}")
    if relevant == 0:
        return 0.0
    alpha = 1.0 - confidence
    log_choose = np.array(
        [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in range(relevant, n + 1)]
    )
    lo, hi = 0.0, relevant / n
    for _ in range(60):  # 2^-60: far below any difference a threshold sees
        mid = (lo + hi) / 2
        if _binomial_tail(log_choose, relevant, n, mid) < alpha:
            lo = mid
        else:
            hi = mid
    return lo


def labels_for_half_width(fraction: float, half_width: float = HALF_WIDTH, confidence: float = 0.95) -> int:
    """Labels a block needs for its two-sided ``confidence`` interval to be about +-``half_width``
    (normal approximation, the fraction kept away from 0 and 1 so the answer is never 0)."""
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p = min(max(fraction, 0.05), 0.95)
    return math.ceil(z * z * p * (1 - p) / (half_width * half_width))


@dataclass(frozen=True)
class Block:
    """Labels between two scores, with their count, relevant count and lower bound."""

    low: float  # the lowest labelled score in the block
    high: float  # the highest
    n: int
    relevant: int
    bound: float  # after raising to the bounds below it

    def to_dict(self) -> dict[str, Any]:
        return {
            "low": round(self.low, 6),
            "high": round(self.high, 6),
            "labels": self.n,
            "relevant": self.relevant,
            "fraction": round(self.relevant / self.n, 4),
            "lower_bound": round(self.bound, 4),
        }


def label_blocks(
    scores: np.ndarray,
    relevant: np.ndarray,
    confidence: float = DEFAULT_CONFIDENCE,
    min_block: int = DEFAULT_MIN_BLOCK,
) -> list[Block]:
    """The blocks of :func:`fit_label_map`, lowest first. ``scores`` (n,), ``relevant`` (n,) bool."""
    scores = np.asarray(scores, dtype=np.float64)
    relevant = np.asarray(relevant, dtype=bool)
    if scores.shape != relevant.shape or scores.ndim != 1 or len(scores) == 0:
        raise ValueError("need one score and one label per labelled pair, at least one pair")
    if min_block < 1:
        raise ValueError(f"min_block must be >= 1, got {min_block}")
    order = np.argsort(scores, kind="stable")
    s, r = scores[order], relevant[order]
    # cut from the top into runs of >= min_block labels; a short rest at the bottom joins the run above
    cuts = [len(s)]
    while cuts[-1] - min_block >= min_block:
        cuts.append(cuts[-1] - min_block)
    cuts.append(0)
    spans = [(lo, hi) for hi, lo in zip(cuts, cuts[1:], strict=False)][::-1]  # lowest first
    pooled: list[list[int]] = []  # [start, end, relevant] of each pooled block
    for lo, hi in spans:
        pooled.append([lo, hi, int(r[lo:hi].sum())])
        # pool while the block below holds as large a fraction relevant as this one: a violation of
        # the rise with score, or a flat stretch, whose labels together give a tighter bound
        while len(pooled) > 1 and (
            pooled[-2][2] * (pooled[-1][1] - pooled[-1][0]) >= pooled[-1][2] * (pooled[-2][1] - pooled[-2][0])
        ):
            top = pooled.pop()
            pooled[-1] = [pooled[-1][0], top[1], pooled[-1][2] + top[2]]
    blocks, floor = [], 0.0
    for lo, hi, k in pooled:
        floor = max(floor, clopper_pearson_lower(k, hi - lo, confidence))
        blocks.append(Block(float(s[lo]), float(s[hi - 1]), hi - lo, k, floor))
    return blocks


def fit_label_map(
    scores: np.ndarray,
    relevant: np.ndarray,
    confidence: float = DEFAULT_CONFIDENCE,
    min_block: int = DEFAULT_MIN_BLOCK,
) -> tuple[Calibration, list[Block]]:
    """A step map of lower bounds (a :class:`Calibration` the service applies like any isotonic
    map): 0 below the lowest labelled score, each block's bound from its lowest score up to the next
    block's lowest score, the top block's bound above."""
    blocks = label_blocks(scores, relevant, confidence, min_block)
    x: list[float] = [math.nextafter(blocks[0].low, -math.inf), blocks[0].low]
    y: list[float] = [0.0, blocks[0].bound]
    for below, block in zip(blocks, blocks[1:], strict=False):
        # the step sits at the block's lowest score: a score between two blocks keeps the lower bound
        x += [math.nextafter(block.low, -math.inf), block.low]
        y += [below.bound, block.bound]
    x.append(blocks[-1].high)
    y.append(blocks[-1].bound)
    # tied scores across a cut could put a step's knot below the previous one: knots never decrease
    x = np.maximum.accumulate(np.asarray(x)).tolist()
    fit = {
        "labels": int(len(scores)),
        "relevant": int(np.sum(relevant)),
        "confidence": confidence,
        "min_block": min_block,
        "bound": "clopper_pearson_lower",
    }
    return Calibration("isotonic", x=tuple(x), y=tuple(y), fit=fit), blocks


def _folds(keys: Sequence[Any], folds: int, seed: int) -> np.ndarray:
    """A fold per distinct key (the same key, the same fold), shuffled by ``seed``."""
    distinct = sorted(set(keys), key=str)
    assignment = np.random.default_rng(seed).permutation(len(distinct)) % folds
    fold_of = dict(zip(distinct, assignment.tolist(), strict=True))
    return np.array([fold_of[k] for k in keys], dtype=np.int64)


def out_of_fold(
    queries: Sequence[str],
    images: Sequence[Any],
    scores: np.ndarray,
    relevant: np.ndarray,
    targets: Sequence[float],
    confidence: float = DEFAULT_CONFIDENCE,
    min_block: int = DEFAULT_MIN_BLOCK,
    folds: int = 4,
    seed: int = 0,
) -> dict[str, Any]:
    """Promised vs delivered on labels the map never saw: queries and images are each split into
    ``folds`` folds, and the pairs of query fold a and image fold b are judged by a map fitted on the
    pairs of every other query fold and every other image fold (so neither their query nor their
    image was fitted). Per target: how many judged hits the map passes at it, the fraction of them
    relevant, and the mean value it promised them."""
    scores = np.asarray(scores, dtype=np.float64)
    relevant = np.asarray(relevant, dtype=bool)
    q_fold, i_fold = _folds(queries, folds, seed), _folds(images, folds, seed + 1)
    promised = np.full(len(scores), np.nan)
    for a in range(folds):
        for b in range(folds):
            judged = (q_fold == a) & (i_fold == b)
            fitted = (q_fold != a) & (i_fold != b)
            if not judged.any() or fitted.sum() < min_block or not relevant[fitted].any():
                continue  # too few labels outside this block to fit on: its pairs stay unjudged
            fitted_map, _ = fit_label_map(scores[fitted], relevant[fitted], confidence, min_block)
            promised[judged] = fitted_map(scores[judged])
    done = ~np.isnan(promised)
    out: dict[str, Any] = {"folds": folds, "judged": int(done.sum()), "targets": {}}
    for t in targets:
        passed = done & (promised >= t)
        n = int(passed.sum())
        out["targets"][str(t)] = {
            "passed": n,
            "delivered": round(float(relevant[passed].mean()), 4) if n else None,
            "promised_mean": round(float(promised[passed].mean()), 4) if n else None,
        }
    return out
