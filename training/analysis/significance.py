"""Student t tests over training seeds: paired by seed, Welch, one-sample, and the two one-sided
tests (TOST) of equivalence, with sample standard deviations (ddof = 1) and the t distribution's
own tail probabilities (``scipy.stats.t``), not a fixed number of standard deviations.

A :class:`TTest` holds an estimate (a mean difference, or a mean minus a target), its standard
error and degrees of freedom; its methods give one-sided p-values against a shifted null
(``p_greater(shift)`` tests "the true value > shift"), the two-sided p-value, a confidence
interval, and the equivalence p-value for a bound. Each test needs at least two values per side.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class TTest:
    """``name`` ("paired t", "Welch t", "one-sample t"), the estimate, its standard error, the
    degrees of freedom and the values per side behind them."""

    name: str
    estimate: float
    se: float
    df: float
    n: tuple[int, ...]

    def _upper_tail(self, shift: float) -> float:
        """P(estimate this large or larger | the true value is ``shift``)."""
        if self.se == 0:  # every value equal on each side: the difference is known exactly
            return 0.0 if self.estimate > shift else 1.0
        return float(stats.t.sf((self.estimate - shift) / self.se, self.df))

    def p_greater(self, shift: float = 0.0) -> float:
        """One-sided p-value of "the true value > shift" (null: <= shift)."""
        return self._upper_tail(shift)

    def p_less(self, shift: float = 0.0) -> float:
        """One-sided p-value of "the true value < shift" (null: >= shift)."""
        if self.se == 0:
            return 0.0 if self.estimate < shift else 1.0
        return float(stats.t.cdf((self.estimate - shift) / self.se, self.df))

    def p_two_sided(self) -> float:
        return min(1.0, 2 * min(self.p_greater(), self.p_less()))

    def p_equivalent(self, bound: float) -> float:
        """TOST: p-value of "the true value lies within (-bound, +bound)", the larger of two one-sided p."""
        return max(self.p_greater(-bound), self.p_less(bound))

    def interval(self, level: float = 0.95) -> tuple[float, float]:
        half = 0.0 if self.se == 0 else float(stats.t.ppf(0.5 + level / 2, self.df)) * self.se
        return self.estimate - half, self.estimate + half


def _values(x: Sequence[float], what: str) -> np.ndarray:
    v = np.asarray(x, dtype=np.float64)
    if v.ndim != 1 or v.size < 2:
        raise ValueError(f"{what}: a t test needs at least two values, got {v.size}")
    if not np.isfinite(v).all():
        raise ValueError(f"{what}: values must be finite")
    return v


def one_sample(x: Sequence[float], target: float = 0.0) -> TTest:
    """mean(x) - target, standard error sd(x, ddof=1) / sqrt(n), n - 1 degrees of freedom."""
    v = _values(x, "one-sample t")
    return TTest(
        "one-sample t",
        float(v.mean()) - target,
        float(v.std(ddof=1)) / math.sqrt(v.size),
        v.size - 1,
        (v.size,),
    )


def paired(a: Sequence[float], b: Sequence[float]) -> TTest:
    """mean(a - b) over pairs (a[i] and b[i] share seed i), a one-sample t test of the differences."""
    va, vb = _values(a, "paired t (A)"), _values(b, "paired t (B)")
    if va.size != vb.size:
        raise ValueError(f"paired t: {va.size} values of A against {vb.size} of B")
    d = one_sample(va - vb)
    return TTest("paired t", d.estimate, d.se, d.df, (va.size, vb.size))


def welch(a: Sequence[float], b: Sequence[float]) -> TTest:
    """mean(a) - mean(b) with unequal variances; Welch-Satterthwaite degrees of freedom."""
    va, vb = _values(a, "Welch t (A)"), _values(b, "Welch t (B)")
    qa, qb = va.var(ddof=1) / va.size, vb.var(ddof=1) / vb.size  # squared standard errors
    se2 = qa + qb
    # both sides constant: no variance to spread over; the pooled df is the conventional fallback
    df = se2**2 / (qa**2 / (va.size - 1) + qb**2 / (vb.size - 1)) if se2 > 0 else va.size + vb.size - 2
    return TTest("Welch t", float(va.mean() - vb.mean()), math.sqrt(se2), float(df), (va.size, vb.size))


__all__ = ["TTest", "one_sample", "paired", "welch"]
