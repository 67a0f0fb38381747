"""Relevance from a user's labels: Clopper-Pearson lower bounds against a naive binomial search, the
step map's shape, its coverage in repeated draws, and judging out of fold."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icr.training.evaluation.metrics.label_bounds import (
    clopper_pearson_lower,
    fit_label_map,
    label_blocks,
    labels_for_half_width,
    out_of_fold,
)


def naive_lower(k: int, n: int, confidence: float) -> float:
    """The smallest p on a 1e-5 grid at which k or more successes of n have probability >= 1 - confidence."""
    if k == 0:
        return 0.0
    for step in range(100_001):
        p = step / 100_000
        tail = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))
        if tail >= 1 - confidence:
            return p
    return 1.0


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), data=st.data(), confidence=st.sampled_from([0.9, 0.95, 0.99]))
def test_clopper_pearson_lower_bound_matches_a_naive_search(n: int, data, confidence: float) -> None:
    k = data.draw(st.integers(0, n))
    assert clopper_pearson_lower(k, n, confidence) == pytest.approx(naive_lower(k, n, confidence), abs=1.1e-5)


def test_known_values_and_bad_arguments() -> None:
    # 10 of 10: (1 - confidence)^(1/n); 0 of n: 0
    assert clopper_pearson_lower(10, 10, 0.95) == pytest.approx(0.05 ** (1 / 10), abs=1e-12)
    assert clopper_pearson_lower(0, 50) == 0.0
    for k, n, c in ((3, 2, 0.95), (1, 0, 0.95), (1, 5, 1.0), (-1, 5, 0.95)):
        with pytest.raises(ValueError):
            clopper_pearson_lower(k, n, c)
    assert labels_for_half_width(0.5) == 385  # 1.96^2 * 0.25 / 0.05^2
    assert labels_for_half_width(1.0) == labels_for_half_width(0.95) > 0  # never "no labels needed"


def test_the_bound_covers_the_true_fraction_as_often_as_it_says() -> None:
    rng = np.random.default_rng(0)
    for p, n in ((0.3, 20), (0.7, 30), (0.95, 60)):
        draws = rng.binomial(n, p, size=2000)
        covered = np.mean([clopper_pearson_lower(int(k), n, 0.95) <= p for k in draws])
        assert covered >= 0.95 - 3 * math.sqrt(0.95 * 0.05 / 2000)  # at least 95 %, up to sampling noise


def naive_blocks(scores: np.ndarray, relevant: np.ndarray, min_block: int) -> list[tuple[int, int]]:
    """(labels, relevant) per block, lowest first: runs of min_block from the top (a short rest joins the
    lowest run), then neighbours pooled while the lower one's fraction is at least the upper one's."""
    r = relevant[np.argsort(scores, kind="stable")]
    n = len(r)
    runs = []
    hi = n
    while hi - min_block >= min_block:
        runs.append((hi - min_block, hi))
        hi -= min_block
    runs.append((0, hi))
    blocks = [[int(b - a), int(r[a:b].sum())] for a, b in reversed(runs)]
    changed = True
    while changed:
        changed = False
        for j in range(len(blocks) - 1):
            (n0, k0), (n1, k1) = blocks[j], blocks[j + 1]
            if k0 / n0 >= k1 / n1:
                blocks[j : j + 2] = [[n0 + n1, k0 + k1]]
                changed = True
                break
    return [(b[0], b[1]) for b in blocks]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 120), min_block=st.integers(1, 15))
def test_blocks_and_map_against_a_naive_fit(seed: int, n: int, min_block: int) -> None:
    rng = np.random.default_rng(seed)
    scores = rng.random(n)
    relevant = rng.random(n) < scores
    if not relevant.any():
        relevant[int(np.argmax(scores))] = True
    blocks = label_blocks(scores, relevant, 0.95, min_block)
    assert [(b.n, b.relevant) for b in blocks] == naive_blocks(scores, relevant, min_block)
    bounds = [b.bound for b in blocks]
    raw = [clopper_pearson_lower(b.relevant, b.n, 0.95) for b in blocks]
    assert bounds == list(np.maximum.accumulate(raw))  # each raised to the bounds below it
    relevance_map, _ = fit_label_map(scores, relevant, 0.95, min_block)
    # a score in a block gets that block's bound, a score below every label gets 0, the map never falls
    for b in blocks:
        assert relevance_map(b.low) == pytest.approx(b.bound) and relevance_map(b.high) == pytest.approx(
            b.bound
        )
    assert relevance_map(scores.min() - 1e-3) == 0.0
    grid = np.linspace(scores.min() - 0.1, scores.max() + 0.1, 500)
    assert np.all(np.diff(relevance_map(grid)) >= 0)


def test_out_of_fold_judges_every_pair_by_a_map_that_never_saw_its_query_or_image() -> None:
    from icr.training.evaluation.metrics import label_bounds

    # the folds: one per distinct key, so a query (or an image) never sits in two
    keys = [f"q{i % 7}" for i in range(50)]
    folds = label_bounds._folds(keys, 4, 0)
    assert all(len({f for k2, f in zip(keys, folds, strict=True) if k2 == k}) == 1 for k in set(keys))
    assert set(folds.tolist()) == {0, 1, 2, 3}

    rng = np.random.default_rng(1)
    queries = [f"q{i % 30}" for i in range(600)]
    images = [int(i) for i in rng.integers(0, 200, 600)]
    scores = rng.random(600)
    relevant = rng.random(600) < scores
    report = out_of_fold(queries, images, scores, relevant, (0.5, 0.8))
    assert report["judged"] == 600
    for t in ("0.5", "0.8"):
        got = report["targets"][t]
        assert got["passed"] > 0 and got["promised_mean"] >= float(t)
        # a lower bound: on fresh pairs the map delivers at least what it promised, here by a margin
        assert got["delivered"] >= got["promised_mean"]
