"""The t tests of the findings (training/analysis/significance.py) against a naive implementation
written here: loops for means and sample variances, and the t distribution's CDF integrated from its
density by Simpson's rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from icr.training.analysis.significance import one_sample, paired, welch


def t_cdf(x: float, df: float, steps: int = 20_000) -> float:
    """P(T <= x) for Student's t with ``df`` degrees of freedom: 1/2 plus the density's integral on [0, x]."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(u: float) -> float:
        return math.exp(log_c - (df + 1) / 2 * math.log1p(u * u / df))

    h = x / steps
    total = density(0.0) + density(x)
    for i in range(1, steps):
        total += (4 if i % 2 else 2) * density(i * h)
    return 0.5 + total * h / 3


def mean(xs: list[float]) -> float:
    total = 0.0
    for x in xs:
        total += x
    return total / len(xs)


def sample_var(xs: list[float]) -> float:
    m = mean(xs)
    total = 0.0
    for x in xs:
        total += (x - m) ** 2
    return total / (len(xs) - 1)


SAMPLES = [
    ([351.7, 340.2, 363.1], [334.8, 310.1, 359.5]),
    ([38.4, 42.1, 34.7, 39.9, 37.0], [230.9, 250.2, 211.6, 228.0, 234.4]),
    ([0.25, 0.26, 0.24, 0.27], [0.22, 0.18, 0.26, 0.21]),
    ([1.0, 2.0], [1.5, 1.7]),
]


@pytest.mark.parametrize(("a", "b"), SAMPLES)
def test_welch_matches_the_naive_test(a: list[float], b: list[float]) -> None:
    qa, qb = sample_var(a) / len(a), sample_var(b) / len(b)
    se = math.sqrt(qa + qb)
    df = (qa + qb) ** 2 / (qa**2 / (len(a) - 1) + qb**2 / (len(b) - 1))
    t = (mean(a) - mean(b)) / se
    test = welch(a, b)
    assert (test.estimate, test.se, test.df) == pytest.approx((mean(a) - mean(b), se, df))
    assert test.n == (len(a), len(b))
    assert test.p_greater() == pytest.approx(1 - t_cdf(t, df), abs=1e-7)
    assert test.p_less() == pytest.approx(t_cdf(t, df), abs=1e-7)
    assert test.p_two_sided() == pytest.approx(2 * min(t_cdf(t, df), 1 - t_cdf(t, df)), abs=1e-7)


@pytest.mark.parametrize(("a", "b"), SAMPLES)
def test_paired_is_the_one_sample_test_of_the_differences(a: list[float], b: list[float]) -> None:
    n = min(len(a), len(b))
    d = [a[i] - b[i] for i in range(n)]
    se = math.sqrt(sample_var(d) / n)
    test = paired(a[:n], b[:n])
    assert (test.name, test.estimate, test.se, test.df) == (
        "paired t",
        pytest.approx(mean(d)),
        pytest.approx(se),
        n - 1,
    )
    assert test.p_greater() == pytest.approx(1 - t_cdf(mean(d) / se, n - 1), abs=1e-7)


def test_one_sample_against_a_target_and_the_equivalence_test() -> None:
    x = [1.21, 1.39, 1.15, 1.30]
    se = math.sqrt(sample_var(x) / len(x))
    test = one_sample(x, 1.0)
    assert (test.estimate, test.se, test.df) == pytest.approx((mean(x) - 1.0, se, 3))
    for bound in (0.1, 0.3, 0.5):  # TOST: the larger of the two one-sided p-values
        lower = 1 - t_cdf((mean(x) - 1.0 + bound) / se, 3)  # "true value > -bound"
        upper = t_cdf((mean(x) - 1.0 - bound) / se, 3)  # "true value < +bound"
        assert test.p_equivalent(bound) == pytest.approx(max(lower, upper), abs=1e-7)


def test_the_interval_has_the_stated_coverage_under_the_naive_cdf() -> None:
    test = welch(*SAMPLES[0])
    lo, hi = test.interval(0.95)
    assert (lo + hi) / 2 == pytest.approx(test.estimate)
    assert t_cdf((hi - test.estimate) / test.se, test.df) == pytest.approx(0.975, abs=1e-6)


def test_against_scipys_own_tests() -> None:
    stats = pytest.importorskip("scipy.stats")
    a, b = SAMPLES[1]
    assert welch(a, b).p_two_sided() == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    assert paired(a, b).p_two_sided() == pytest.approx(stats.ttest_rel(a, b).pvalue)


def test_constant_sides_have_an_exact_difference() -> None:
    test = welch([1.0, 1.0, 1.0], [0.5, 0.5, 0.5])
    assert (test.se, test.p_greater(), test.p_less(), test.p_two_sided()) == (0.0, 0.0, 1.0, 0.0)
    assert test.interval() == (0.5, 0.5)
    same = paired([2.0, 3.0], [2.0, 3.0])
    assert (same.p_greater(), same.p_less(), same.p_equivalent(0.1)) == (1.0, 1.0, 0.0)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="at least two values"):
        welch([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        one_sample([1.0, float("nan")])
    with pytest.raises(ValueError, match="3 values of A against 2"):
        paired([1.0, 2.0, 3.0], [1.0, 2.0])
    assert np.isfinite(one_sample([1.0, 2.0]).p_two_sided())
