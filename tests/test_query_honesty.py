"""Per-query honesty and the out-of-domain figures against naive loops."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from icr.training.evaluation.metrics.query_honesty import (
    chance_figures,
    ood_figures,
    poisson_binomial,
    promised_delivered,
    query_honesty,
)


def _lists(seed: int = 0, q: int = 60, depth: int = 30) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    relevance = np.sort(rng.random((q, depth)), axis=1)[:, ::-1].copy()
    relevant = rng.random((q, depth)) < relevance
    relevance[rng.random(q) < 0.2] = np.nan  # queries given no promise
    kinds = rng.choice(["count", "relation", "one_object"], size=q)
    return relevant, relevance, kinds


def test_promised_and_delivered_match_a_loop() -> None:
    relevant, relevance, _ = _lists()
    for k in (1, 5, 20, 30, 50):
        promised, delivered, withheld = promised_delivered(relevant, relevance, k)
        for i in range(len(relevant)):
            top = min(k, relevance.shape[1])
            no_promise = all(np.isnan(relevance[i, j]) for j in range(top))
            want = 0.0 if no_promise else sum(relevance[i, j] for j in range(top)) / top
            assert withheld[i] == no_promise
            assert promised[i] == pytest.approx(want)
            assert delivered[i] == pytest.approx(sum(relevant[i, j] for j in range(top)) / top)


def test_figures_per_kind_match_a_loop() -> None:
    relevant, relevance, kinds = _lists(1)
    report = query_honesty(relevant, relevance, kinds, k=10, slack=0.2)
    promised, delivered, withheld = promised_delivered(relevant, relevance, 10)
    for kind in ["count", "relation", "one_object", None]:
        rows = [i for i in range(len(kinds)) if kind is None or kinds[i] == kind]
        got = report["pooled"] if kind is None else report["by_kind"][kind]
        assert got["queries"] == len(rows)
        assert got["mae"] == pytest.approx(sum(abs(promised[i] - delivered[i]) for i in rows) / len(rows))
        assert got["over"] == pytest.approx(sum(promised[i] - delivered[i] > 0.2 for i in rows) / len(rows))
        assert got["under"] == pytest.approx(sum(delivered[i] - promised[i] > 0.2 for i in rows) / len(rows))
        assert got["withheld"] == pytest.approx(sum(bool(withheld[i]) for i in rows) / len(rows))
        chance, p_value = chance_figures(relevant, relevance, 10)
        assert got["chance_mae"] == pytest.approx(sum(chance[i] for i in rows) / len(rows))
        assert got["outside"] == pytest.approx(sum(p_value[i] < 0.05 for i in rows) / len(rows))
    assert report["k"] == 10 and set(report["by_kind"]) == {"count", "relation", "one_object"}


def test_an_honest_map_has_no_gap_and_a_flat_one_does() -> None:
    relevant = np.zeros((2, 20), bool)
    relevant[0] = True  # "three shapes": all 20 right
    honest = relevant.astype(float)
    flat = np.full((2, 20), 0.482)  # one value for the whole kind
    assert query_honesty(relevant, honest)["pooled"]["mae"] == 0.0
    figures = query_honesty(relevant, flat)["pooled"]
    assert figures["over"] == 0.5 and figures["under"] == 0.5
    assert figures["mae"] == pytest.approx((0.518 + 0.482) / 2)


def test_ood_figures_match_a_loop() -> None:
    _, relevance, _ = _lists(2)
    got = ood_figures(relevance, (0.5, 0.9))
    n = len(relevance)
    assert got["queries"] == n
    assert got["withheld"] == pytest.approx(sum(np.isnan(r).all() for r in relevance) / n)
    for t in (0.5, 0.9):
        passing = sum(any(v >= t for v in r if not np.isnan(v)) for r in relevance)
        assert got["passing_any"][str(t)] == pytest.approx(passing / n)
    assert ood_figures(np.zeros((0, 5)))["queries"] == 0


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError):
        promised_delivered(np.zeros((2, 3), bool), np.zeros((2, 4)))
    with pytest.raises(ValueError):
        promised_delivered(np.zeros((2, 3), bool), np.zeros((2, 3)), k=0)


def _outcomes(p: list[float]) -> list[tuple[int, float]]:
    """Every outcome of independent events with probabilities p: (how many occur, its probability)."""
    out = []
    for bits in itertools.product((0, 1), repeat=len(p)):
        prob = 1.0
        for b, pi in zip(bits, p, strict=True):
            prob *= pi if b else 1.0 - pi
        out.append((sum(bits), prob))
    return out


def test_poisson_binomial_matches_every_outcome_enumerated() -> None:
    rng = np.random.default_rng(3)
    p = rng.random((6, 8))
    p[0, :3], p[1, 2:5] = 0.0, 1.0  # certain events both ways
    dist = poisson_binomial(p)
    for q in range(len(p)):
        want = np.zeros(p.shape[1] + 1)
        for count, prob in _outcomes(list(p[q])):
            want[count] += prob
        np.testing.assert_allclose(dist[q], want, atol=1e-12)
    with pytest.raises(ValueError):
        poisson_binomial(np.zeros(3))


def test_chance_figures_match_every_outcome_enumerated() -> None:
    relevant, relevance, _ = _lists(4, q=12, depth=9)
    k = 7
    chance, p_value = chance_figures(relevant, relevance, k)
    for q in range(len(relevant)):
        p = [0.0 if np.isnan(v) else float(v) for v in relevance[q, :k]]  # no promise = 0
        promised, seen = sum(p) / k, int(relevant[q, :k].sum())
        outcomes = _outcomes(p)
        assert chance[q] == pytest.approx(sum(prob * abs(c / k - promised) for c, prob in outcomes))
        low = sum(prob for c, prob in outcomes if c <= seen)
        high = sum(prob for c, prob in outcomes if c >= seen)
        assert p_value[q] == pytest.approx(min(1.0, 2 * min(low, high)))


def test_an_honest_map_is_inside_its_range_and_a_miscalibrated_one_is_not() -> None:
    rng = np.random.default_rng(5)
    relevance = np.sort(rng.uniform(0.2, 0.9, (4000, 20)), axis=1)[:, ::-1].copy()
    relevant = rng.random(relevance.shape) < relevance  # each value exactly right, hits independent
    honest = query_honesty(relevant, relevance)["pooled"]
    assert honest["outside"] <= 0.05  # the two-sided test of a discrete count is conservative
    assert honest["mae"] == pytest.approx(honest["chance_mae"], abs=0.005)  # the whole gap is chance
    # the same hits promised 0.2 higher: the gap is now mostly not chance, and many queries are outside
    shifted = query_honesty(relevant, np.clip(relevance + 0.2, 0, 1))["pooled"]
    assert shifted["outside"] > 0.3 and shifted["mae"] > shifted["chance_mae"] + 0.1
    # a certain promise (0 or 1 per hit) that is right has no chance gap and no query outside
    certain = query_honesty(relevant, relevant.astype(float))["pooled"]
    assert certain["chance_mae"] == 0.0 and certain["outside"] == 0.0 and certain["mae"] == 0.0
