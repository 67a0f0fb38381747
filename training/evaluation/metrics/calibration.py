"""Score -> probability of relevance: fitting (isotonic or Platt) and expected calibration error.

A raw cosine threshold means something different for every model; a calibrated relevance
("probability that this image is relevant to this caption") means the same for every model and
every query. The map is fitted on every (image, caption) pair of a held-out split (validation),
with labels from the annotations or, on the embedded benchmark, from the ground truth.

Fitting reads the pairs once into a fine score histogram (``bins`` equal-width bins between the
lowest and highest score, relevant and non-relevant counts per bin), so COCO-size splits (125 M
pairs) fit in seconds and bounded memory; the bin width (1/2000 of the score range by default)
is far below any score difference that matters for a threshold.

* ``isotonic``: pool-adjacent-violators on the bins (weighted by pair counts), giving a
  non-decreasing step map; applied by linear interpolation between bin centres, clipped at the ends.
* ``platt``: ``p = sigmoid(a * score + b)`` fitted by weighted maximum likelihood (Newton steps).

ECE is the standard equal-width-bin form over predicted probability:
``sum_b (n_b / N) * |mean predicted p in b - fraction relevant in b|`` (15 bins by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from icr.training.evaluation.metrics.pair_blocks import pair_blocks
from icr.training.evaluation.metrics.relevant_pairs import Relevance

CALIBRATION_METHODS: tuple[str, ...] = ("isotonic", "platt")
CALIBRATION_FORMAT_VERSION = 1


@dataclass(frozen=True)
class ScoreHistogram:
    edges: np.ndarray  # (B + 1,) ascending
    relevant: np.ndarray  # (B,) relevant pairs per bin
    other: np.ndarray  # (B,) non-relevant pairs per bin

    @property
    def centres(self) -> np.ndarray:
        centres: np.ndarray = (self.edges[:-1] + self.edges[1:]) / 2
        return centres


def score_histogram(
    sim: np.ndarray | torch.Tensor, relevance: Relevance, *, bins: int = 2000
) -> ScoreHistogram:
    """Relevant / non-relevant pair counts in ``bins`` equal-width score bins (infinite scores clipped)."""
    lo, hi = np.inf, -np.inf
    for _, scores, _ in pair_blocks(sim, relevance):
        finite = scores[np.isfinite(scores)]
        if finite.size:
            lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
    if not np.isfinite(lo):
        raise ValueError("no finite score to calibrate: is the model producing NaN?")
    if hi <= lo:
        hi = lo + 1e-6  # a collapsed model: one bin holds everything
    edges = np.linspace(lo, hi, bins + 1)
    relevant = np.zeros(bins, dtype=np.int64)
    other = np.zeros(bins, dtype=np.int64)
    for _, scores, rel in pair_blocks(sim, relevance):
        # Arithmetic binning (not searchsorted): one pass over 125 M scores in about a second.
        scaled = np.nan_to_num((scores - lo) * (bins / (hi - lo)), posinf=bins - 1, neginf=0)
        idx = np.clip(scaled.astype(np.int64), 0, bins - 1)  # (b, N_cap)
        relevant += np.bincount(idx[rel], minlength=bins)
        other += np.bincount(idx[~rel], minlength=bins)
    return ScoreHistogram(edges, relevant, other)


@dataclass(frozen=True)
class Calibration:
    """A fitted score -> probability map; JSON round trip with :meth:`to_dict` / :meth:`from_dict`."""

    method: str
    x: tuple[float, ...] = ()  # isotonic: knots (bin centres), ascending
    y: tuple[float, ...] = ()  # isotonic: probability at each knot, non-decreasing
    a: float = 0.0  # platt slope
    b: float = 0.0  # platt intercept
    fit: dict[str, Any] = field(default_factory=dict)  # what it was fitted on (pairs, relevant, ...)

    def __call__(self, scores: np.ndarray | float) -> np.ndarray:
        s = np.asarray(scores, dtype=np.float64)
        if self.method == "isotonic":
            return np.interp(s, self.x, self.y)
        with np.errstate(over="ignore"):
            return 1.0 / (1.0 + np.exp(-(self.a * s + self.b)))

    def score_for(self, probability: float) -> float | None:
        """The lowest score whose calibrated relevance is >= ``probability`` (None if never reached)."""
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {probability}")
        if self.method == "isotonic":
            y = np.asarray(self.y)
            hit = np.flatnonzero(y >= probability)
            if hit.size == 0:
                return None
            i = int(hit[0])
            if i == 0 or y[i] == y[i - 1]:
                return float(self.x[i])
            # Inverse of the linear interpolation between knots i-1 and i.
            x0, x1, y0, y1 = self.x[i - 1], self.x[i], y[i - 1], y[i]
            return float(x0 + (probability - y0) * (x1 - x0) / (y1 - y0))
        if probability in (0.0, 1.0) or self.a <= 0:
            return None
        return float((np.log(probability / (1 - probability)) - self.b) / self.a)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format_version": CALIBRATION_FORMAT_VERSION,
            "method": self.method,
            "fit": self.fit,
        }
        if self.method == "isotonic":
            out.update(x=list(self.x), y=list(self.y))
        else:
            out.update(a=self.a, b=self.b)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        if not isinstance(d, dict) or d.get("format_version") != CALIBRATION_FORMAT_VERSION:
            raise ValueError(
                f"calibration format version {d.get('format_version') if isinstance(d, dict) else d!r}, "
                f"this code reads {CALIBRATION_FORMAT_VERSION}"
            )
        method = d.get("method")
        try:
            if method == "isotonic":
                x, y = tuple(float(v) for v in d["x"]), tuple(float(v) for v in d["y"])
                if (
                    len(x) != len(y)
                    or not x
                    or not np.all(np.isfinite(x + y))
                    or np.any(np.diff(x) < 0)
                    or np.any(np.diff(y) < 0)
                    or min(y) < 0
                    or max(y) > 1
                ):
                    raise ValueError(
                        "isotonic knots must be non-empty, finite, equal length and non-decreasing, "
                        "with probabilities in [0, 1]"
                    )
                return cls(method, x=x, y=y, fit=dict(d.get("fit", {})))
            if method == "platt":
                a, b = float(d["a"]), float(d["b"])
                if not (np.isfinite(a) and np.isfinite(b)):
                    raise ValueError("platt parameters a and b must be finite numbers")
                return cls(method, a=a, b=b, fit=dict(d.get("fit", {})))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed {method} calibration ({e!r})") from e
        raise ValueError(f"unknown calibration method {method!r}; expected one of {CALIBRATION_METHODS}")


def _pool_adjacent_violators(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted isotonic (non-decreasing) least-squares fit of ``values``."""
    means: list[float] = []
    sizes: list[float] = []
    lengths: list[int] = []
    for v, w in zip(values.tolist(), weights.tolist(), strict=True):
        means.append(v)
        sizes.append(w)
        lengths.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            w2 = sizes[-2] + sizes[-1]
            means[-2] = (means[-2] * sizes[-2] + means[-1] * sizes[-1]) / w2
            sizes[-2] = w2
            lengths[-2] += lengths[-1]
            del means[-1], sizes[-1], lengths[-1]
    return np.repeat(means, lengths)


def _fit_platt(x: np.ndarray, pos: np.ndarray, neg: np.ndarray, iterations: int = 100) -> tuple[float, float]:
    """Weighted logistic regression of relevance on score, by Newton's method."""
    a, b = 0.0, float(np.log((pos.sum() + 1) / (neg.sum() + 1)))
    n = pos + neg
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-(a * x + b)))
        g = np.array([np.sum((n * p - pos) * x), np.sum(n * p - pos)])
        w = n * p * (1 - p)
        h = np.array([[np.sum(w * x * x), np.sum(w * x)], [np.sum(w * x), np.sum(w)]]) + 1e-9 * np.eye(2)
        step = np.linalg.solve(h, g)
        a, b = a - step[0], b - step[1]
        if np.abs(step).max() < 1e-10:
            break
    return float(a), float(b)


def merged_from_top(histogram: ScoreHistogram, min_count: int) -> ScoreHistogram:
    """``histogram`` with adjacent bins merged, from the highest down, until each holds at least
    ``min_count`` pairs; a short remainder at the bottom joins the bin above it.

    An isotonic map fitted on it rests no value on fewer pairs. That matters at the top, where a
    threshold acts and pairs are few: a handful of lucky relevant pairs there would otherwise
    promise a precision that fresh queries do not deliver.
    """
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    n = histogram.relevant + histogram.other
    cuts = [len(n)]  # bin edges (indices) of the merged bins, collected from the top
    held = 0
    for b in range(len(n) - 1, 0, -1):
        held += int(n[b])
        if held >= min_count:
            cuts.append(b)
            held = 0
    if len(cuts) > 1 and held + int(n[0]) < min_count:
        cuts.pop()  # the remainder at the bottom joins the lowest full bin
    cuts = [0, *reversed(cuts)]
    return ScoreHistogram(
        histogram.edges[cuts],
        np.add.reduceat(histogram.relevant, cuts[:-1]),
        np.add.reduceat(histogram.other, cuts[:-1]),
    )


def wilson_lower_bound(relevant: np.ndarray, n: np.ndarray, z: float) -> np.ndarray:
    """One-sided Wilson score lower bound of the fraction ``relevant / n`` at ``z`` standard
    normal quantiles (1.645: 95 %); 0 where ``n`` is 0."""
    n = np.asarray(n, dtype=np.float64)
    safe = np.maximum(n, 1.0)
    p = np.asarray(relevant, dtype=np.float64) / safe
    centre = p + z * z / (2 * safe)
    margin = z * np.sqrt(p * (1 - p) / safe + z * z / (4 * safe * safe))
    return np.where(n > 0, np.maximum(0.0, (centre - margin) / (1 + z * z / safe)), 0.0)


def fit_calibration(histogram: ScoreHistogram, method: str = "isotonic", lower_z: float = 0.0) -> Calibration:
    """Fit a :class:`Calibration` to a :func:`score_histogram`.

    ``lower_z`` > 0 (isotonic only): each bin's fraction is replaced by its Wilson lower bound at
    that many standard normal quantiles before the isotonic fit, so a bin of few pairs promises
    no more than it can back up (a threshold passes its hits only where the bound clears it).
    """
    if method not in CALIBRATION_METHODS:
        raise ValueError(f"unknown calibration method {method!r}; expected one of {CALIBRATION_METHODS}")
    n = histogram.relevant + histogram.other
    used = n > 0
    if histogram.relevant.sum() == 0:
        raise ValueError("no relevant pair in the calibration split: cannot fit score -> relevance")
    x = histogram.centres[used]
    pos = histogram.relevant[used].astype(np.float64)
    neg = histogram.other[used].astype(np.float64)
    fit: dict[str, Any] = {"pairs": int(n.sum()), "relevant_pairs": int(pos.sum()), "bins": int(len(n))}
    if method == "platt":
        if lower_z:
            raise ValueError("lower_z applies to the isotonic method only")
        a, b = _fit_platt(x, pos, neg)
        return Calibration("platt", a=a, b=b, fit=fit)
    if lower_z:
        fit["lower_z"] = lower_z
    fraction = wilson_lower_bound(pos, pos + neg, lower_z) if lower_z else pos / (pos + neg)
    y = _pool_adjacent_violators(fraction, pos + neg)
    # Keep only the knots where the step map changes (plus both ends): a few hundred numbers.
    change = np.ones(len(y), dtype=bool)
    change[1:-1] = (y[1:-1] != y[:-2]) | (y[1:-1] != y[2:])
    return Calibration("isotonic", x=tuple(x[change].tolist()), y=tuple(y[change].tolist()), fit=fit)


def calibration_error(
    sim: np.ndarray | torch.Tensor, relevance: Relevance, calibration: Calibration, *, bins: int = 15
) -> dict[str, Any]:
    """ECE and the reliability table (per probability bin: pairs, mean predicted, fraction relevant)."""
    count = np.zeros(bins, dtype=np.int64)
    predicted = np.zeros(bins)
    relevant = np.zeros(bins)
    for _, scores, rel in pair_blocks(sim, relevance):
        p = calibration(scores)  # (b, N_cap)
        idx = np.minimum((p * bins).astype(np.int64), bins - 1)
        count += np.bincount(idx.ravel(), minlength=bins)
        predicted += np.bincount(idx.ravel(), weights=p.ravel(), minlength=bins)
        relevant += np.bincount(idx[rel], minlength=bins)
    return reliability_table(count, predicted, relevant)


def reliability_table(count: np.ndarray, predicted: np.ndarray, relevant: np.ndarray) -> dict[str, Any]:
    """ECE and the per-bin table from equal-width probability bins' pair counts, summed predicted
    probabilities and relevant pair counts, each (bins,)."""
    bins = len(count)
    total = max(int(count.sum()), 1)
    safe = np.maximum(count, 1)
    ece = float(np.sum(count / total * np.abs(predicted / safe - relevant / safe)))
    return {
        "ece": ece,
        "bins": [
            {
                "low": i / bins,
                "high": (i + 1) / bins,
                "pairs": int(count[i]),
                "mean_predicted": float(predicted[i] / safe[i]) if count[i] else None,
                "fraction_relevant": float(relevant[i] / safe[i]) if count[i] else None,
            }
            for i in range(bins)
        ],
    }
