"""Per-query honesty and the out-of-domain figures against naive loops."""

from __future__ import annotations

import numpy as np
import pytest

from icr.training.evaluation.metrics.query_honesty import (
    ood_figures,
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
