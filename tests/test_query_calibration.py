"""The per-query calibration map: monotone per query, JSON round trip, what its inputs teach it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from icr.training.data.synthetic.kinds import text_kind
from icr.training.evaluation.metrics.calibration import (
    ScoreHistogram,
    fit_calibration,
    merged_from_top,
    wilson_lower_bound,
)
from icr.training.evaluation.metrics.query_calibration import (
    QueryCalibration,
    fit_query_calibration,
    fit_query_calibration_by_group,
    query_features,
    text_features,
)


def _lists(rng: np.random.Generator, q: int, depth: int) -> np.ndarray:
    return -np.sort(-rng.uniform(-0.2, 0.9, (q, depth)), axis=1)  # (Q, depth) best first


def test_features_by_hand() -> None:
    scores = np.linspace(1.0, 0.0, 200)[None, :]  # one list, best first
    f = query_features(scores)[0]
    assert f[:7] == pytest.approx(scores[0, [0, 1, 4, 9, 19, 49, 99]])
    assert f[7] == pytest.approx(scores[0, :100].mean()) and f[8] == pytest.approx(scores[0, :100].std())
    short = query_features(np.array([[0.9, 0.5, 0.4]]))[0]  # a 3-item gallery: the last score repeats
    assert short[2:7] == pytest.approx([0.4] * 5)
    t = text_features(["A red circle", "a RED circle.", "a blue circle"], buckets=64)
    assert np.array_equal(t[0], t[1]) and not np.array_equal(t[0], t[2]) and t.sum(1).min() >= 3


def test_two_kinds_of_query_with_the_same_scores_are_told_apart_by_their_words() -> None:
    """'broad' queries stay relevant to rank 40, 'narrow' ones only at rank 1; their score lists are
    drawn from one distribution, so only the words (and the per-query rank decay) can separate them."""
    rng = np.random.default_rng(0)
    q, depth = 400, 150
    scores = _lists(rng, q, depth)
    texts = ["a broad query" if i % 2 == 0 else "three narrow things" for i in range(q)]
    relevant = np.zeros((q, depth), bool)
    relevant[0::2, :40] = True
    relevant[1::2, 0] = True
    fitted = fit_query_calibration(scores, relevant, texts=texts, steps=300, sampled=40)
    test = np.repeat(_lists(np.random.default_rng(1), 1, depth), 2, axis=0)  # one list, two texts
    p = fitted(test, texts=["a broad query", "three narrow things"])
    assert p[0, 20] > 0.8 and p[1, 20] < 0.2  # deep in the list: relevant for one, not the other
    assert p[0, 80] < 0.3  # past rank 40 the broad query's hits are not relevant either
    # without the words the map cannot separate them: on new lists it rates both kinds alike
    fresh = _lists(np.random.default_rng(2), 200, depth)
    blind = fit_query_calibration(scores, relevant, steps=300, sampled=40)(fresh)
    assert abs(blind[0::2, 20].mean() - blind[1::2, 20].mean()) < 0.1


def test_monotone_round_trip_and_inputs_checked() -> None:
    rng = np.random.default_rng(3)
    q, depth, dim = 60, 120, 8
    scores, emb = _lists(rng, q, depth), rng.standard_normal((q, dim))
    texts = [f"query {i % 7}" for i in range(q)]
    relevant = rng.random((q, depth)) < np.linspace(0.9, 0.05, depth)
    fitted = fit_query_calibration(scores, relevant, emb, texts, steps=50, sampled=10)
    p = fitted(scores, emb, texts)
    assert p.shape == (q, depth) and np.all(np.diff(p, axis=1) <= 1e-12) and p.min() >= 0 and p.max() <= 1
    again = QueryCalibration.from_dict(json.loads(json.dumps(fitted.to_dict())))
    np.testing.assert_allclose(again(scores, emb, texts), p, rtol=1e-12)
    assert fitted.fit["inputs"] == ["score list", "embedding", "text"] and fitted.fit["queries"] == q
    # a word no fitting query had changes nothing (its input was constant in the fit: no weight)
    seen = fitted(scores[:1], emb[:1], ["query 3"])
    unseen = fitted(scores[:1], emb[:1], ["query 3 unicorn"])
    np.testing.assert_allclose(unseen, seen, atol=0.05)
    with pytest.raises(ValueError, match="pass embeddings="):
        fitted(scores, None, texts)
    with pytest.raises(ValueError, match="pass texts="):
        fitted(scores, emb, None)
    broken = {**fitted.to_dict(), "w2": [[0.0, 0.0]]}
    with pytest.raises(ValueError, match="inconsistent shapes"):
        QueryCalibration.from_dict(broken)
    with pytest.raises(ValueError, match="this code reads format 2"):
        QueryCalibration.from_dict({**fitted.to_dict(), "format_version": 1})


def test_zero_weight_hits_teach_nothing() -> None:
    rng = np.random.default_rng(4)
    scores = _lists(rng, 50, 130)
    relevant = rng.random((50, 130)) < 0.3
    weights = np.ones((50, 130))
    weights[:, 0] = 0.0  # e.g. each caption's own image at rank 1
    a = fit_query_calibration(scores, relevant, weights=weights, steps=30, sampled=10)
    flipped = relevant.copy()
    flipped[:, 0] = ~flipped[:, 0]
    b = fit_query_calibration(scores, flipped, weights=weights, steps=30, sampled=10)
    np.testing.assert_allclose(a(scores), b(scores), rtol=1e-6)
    with pytest.raises(ValueError, match="weights must have the scores' shape"):
        fit_query_calibration(scores, relevant, weights=weights[:, :5])


def test_bins_merged_from_the_top_match_a_naive_greedy_partition() -> None:
    def naive(counts: list[int], least: int) -> list[list[int]]:
        """Walk the bins from the top, closing a group once it holds `least`; a short bottom group
        joins the one above it."""
        groups: list[list[int]] = []
        current: list[int] = []
        for b in reversed(range(len(counts))):
            current.insert(0, b)
            if sum(counts[i] for i in current) >= least and b > 0:
                groups.insert(0, current)
                current = []
        if current:
            if groups and sum(counts[i] for i in current) < least:
                groups[0] = current + groups[0]
            else:
                groups.insert(0, current)
        return groups

    rng = np.random.default_rng(0)
    for trial in range(200):
        bins = int(rng.integers(1, 30))
        relevant = rng.integers(0, 4, bins) * (rng.random(bins) < 0.7)
        other = rng.integers(0, 6, bins) * (rng.random(bins) < 0.7)
        least = int(rng.integers(1, 25))
        edges = np.sort(rng.random(bins + 1))
        merged = merged_from_top(ScoreHistogram(edges, relevant, other), least)
        groups = naive((relevant + other).tolist(), least)
        assert merged.edges.tolist() == [edges[g[0]] for g in groups] + [edges[-1]], trial
        assert merged.relevant.tolist() == [int(relevant[g].sum()) for g in groups], trial
        assert merged.other.tolist() == [int(other[g].sum()) for g in groups], trial
        if len(groups) > 1:
            assert min(merged.relevant + merged.other) >= least
    with pytest.raises(ValueError, match="min_count"):
        merged_from_top(ScoreHistogram(np.arange(3.0), np.ones(2, int), np.ones(2, int)), 0)


def test_wilson_lower_bound_inverts_the_score_test() -> None:
    """The bound L <= p solves (p - L)^2 = z^2 L (1 - L) / n: found here by bisection."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 500))
        k = int(rng.integers(0, n + 1))
        z = float(rng.choice([1.0, 1.645, 2.326]))
        p = k / n
        lo, hi = 0.0, p
        for _ in range(100):  # the test statistic falls from > z at 0 (when p > 0) to 0 at p
            mid = (lo + hi) / 2
            if (p - mid) > z * np.sqrt(mid * (1 - mid) / n):
                lo = mid
            else:
                hi = mid
        got = float(wilson_lower_bound(np.array([k]), np.array([n]), z)[0])
        assert got == pytest.approx(lo, abs=1e-9), (n, k, z)
    assert wilson_lower_bound(np.array([0]), np.array([0]), 1.645)[0] == 0.0


def test_lower_bound_isotonic_promises_less_on_few_pairs() -> None:
    """``lower_z``: PAV over the bins' Wilson bounds; a bin of 10 pairs at 0.7 falls below 0.5,
    one of 10,000 at 0.6 stays within 0.01 of it."""
    edges = np.array([0.0, 0.25, 0.5, 0.75, 1.0])
    relevant, other = np.array([1, 50, 6000, 7]), np.array([99, 50, 4000, 3])
    hist = ScoreHistogram(edges, relevant, other)
    plain, bound = fit_calibration(hist), fit_calibration(hist, lower_z=1.645)
    n = relevant + other
    naive = wilson_lower_bound(relevant, n, 1.645)
    # PAV by hand: the last bin's bound (~0.44) is below the third's (~0.59): the two pool
    pooled = (naive[2] * n[2] + naive[3] * n[3]) / (n[2] + n[3])
    np.testing.assert_allclose(bound(hist.centres), [naive[0], naive[1], pooled, pooled])
    assert bound(0.875) < 0.6 < plain(0.875) and abs(bound(0.625) - 0.6) < 0.01
    assert bound.fit["lower_z"] == 1.645
    with pytest.raises(ValueError, match="isotonic"):
        fit_calibration(hist, "platt", lower_z=1.0)


ONE_OBJECT = ["there is a blue box", "a small red star", "there is a big green disc"]
COUNT = ["three shapes: a small blue box, a big red star and a tiny green disc"]


def _grouped_queries(seed: int, q: int, depth: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """One query in eight a count caption, the others one-object captions; score lists drawn alike.
    A one-object caption's top 30 are relevant, a count caption's top 30 only at random (30 %)."""
    rng = np.random.default_rng(seed)
    scores = _lists(rng, q, depth)
    texts = [COUNT[0] if i % 8 == 0 else ONE_OBJECT[i % 3] for i in range(q)]
    hard = np.array([t == COUNT[0] for t in texts])
    relevant = np.zeros((q, depth), bool)
    relevant[~hard, :30] = True
    relevant[hard, :30] = rng.random((int(hard.sum()), 30)) < 0.3
    return scores, relevant, texts


def test_group_corrections_keep_the_promise_for_a_rare_hard_kind_on_fresh_queries() -> None:
    assert text_kind(COUNT[0]) == "count" and {text_kind(t) for t in ONE_OBJECT} == {"one_object"}
    scores, relevant, texts = _grouped_queries(0, 480, 120)
    fitted = fit_query_calibration_by_group(scores, relevant, texts=texts, steps=150, sampled=20, min_hits=50)
    assert set(fitted.group_maps) == {"count", "one_object"} and fitted.fit["group_folds"] == 5
    fresh, truth, fresh_texts = _grouped_queries(1, 480, 120)
    hard = np.array([t == COUNT[0] for t in fresh_texts])
    # one map for every query promises the rare kind the common kind's precision
    plain = fit_query_calibration(scores, relevant, texts=texts, steps=150, sampled=20)
    plain = plain(fresh, texts=fresh_texts)
    assert (plain[hard] >= 0.5).sum() > 20 and truth[hard][plain[hard] >= 0.5].mean() < 0.4
    p = fitted(fresh, texts=fresh_texts)
    assert np.all(np.diff(p, axis=1) <= 1e-12)  # still non-increasing down every list
    # the hard kind: its relevance is its true rate on average, and what passes 0.5 is honest
    assert abs(p[hard].mean() - truth[hard].mean()) < 0.08
    passing = p[hard] >= 0.5
    assert not passing.any() or truth[hard][passing].mean() >= 0.45
    # the easy kind keeps its confident, correct hits
    sure = p[~hard] >= 0.8
    assert sure.sum() > 20 * (~hard).sum() and truth[~hard][sure].mean() >= 0.75
    # JSON round trip; a text in no group keeps the uncorrected per-query value
    again = QueryCalibration.from_dict(json.loads(json.dumps(fitted.to_dict())))
    assert np.allclose(again(fresh, texts=fresh_texts), p, rtol=0, atol=1e-12)
    odd = again(fresh[:2], texts=["a purple elephant", "a purple elephant"])
    assert np.allclose(odd, 1.0 / (1.0 + np.exp(-again.logits(fresh[:2], texts=["a purple elephant"] * 2))))
    with pytest.raises(ValueError, match="texts="):
        fit_query_calibration_by_group(scores, relevant)
    # a kind none of whose held-out hits was relevant is promised nothing
    hard_fit = np.array([t == COUNT[0] for t in texts])
    never = fit_query_calibration_by_group(
        scores, relevant & ~hard_fit[:, None], texts=texts, steps=20, sampled=20, min_hits=50
    )
    assert never.group_maps["count"].y == (0.0, 0.0) and never(fresh, texts=fresh_texts)[hard].max() == 0.0
    broken = {**fitted.to_dict(), "group_by": "mood"}
    with pytest.raises(ValueError, match="unknown query grouping"):
        QueryCalibration.from_dict(broken)
