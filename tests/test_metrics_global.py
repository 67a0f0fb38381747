"""Global metrics over every (image, caption) pair, against brute-force references written here.

* PR curve (icr.training.evaluation.metrics.global_pr): average precision and the trapezoidal area against a
  flatten-sort-group reference (and scikit-learn when installed), with ties, annotation and dense
  relevance, NaN scores, and pair blocks that split the matrix; threshold metrics, best F1 and
  threshold_for_precision against a walk over every distinct threshold.
* Calibration (icr.training.evaluation.metrics.calibration): isotonic fits are non-decreasing and
  recover a known
  p(relevant | score); Platt recovers a known logistic model; score_for inverts the map; JSON round
  trip and malformed dicts; ECE against a naive per-pair loop.
* Score distributions: per-query curves against naive counts.
* Distractors: t2i R@K with streamed distractors against a full-gallery pessimistic ranking.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import icr.training.evaluation.metrics.pair_blocks as pair_blocks_module
from icr.training.evaluation.metrics.calibration import (
    Calibration,
    ScoreHistogram,
    calibration_error,
    fit_calibration,
    score_histogram,
)
from icr.training.evaluation.metrics.distractors import DistractorRecall
from icr.training.evaluation.metrics.global_pr import global_metrics, pr_curve, threshold_metrics
from icr.training.evaluation.metrics.pair_blocks import pair_blocks
from icr.training.evaluation.metrics.ranking import first_relevant_ranks, ranking_metrics
from icr.training.evaluation.metrics.relevant_pairs import Relevance
from icr.training.evaluation.metrics.report import full_metrics, json_ready
from icr.training.evaluation.metrics.score_distribution import score_distributions


# --- brute-force references ------------------------------------------------------------------------
def resolved(sim: np.ndarray, rel: np.ndarray) -> tuple[list[float], list[bool]]:
    """All pairs flattened, NaN resolved against the model (non-relevant +inf, relevant -inf)."""
    scores, labels = [], []
    for s, r in zip(np.asarray(sim, dtype=np.float64).ravel().tolist(), rel.ravel().tolist(), strict=True):
        if math.isnan(s):
            s = -math.inf if r else math.inf
        scores.append(s)
        labels.append(bool(r))
    return scores, labels


def walk(sim: np.ndarray, rel: np.ndarray) -> list[tuple[float, int, int]]:
    """(threshold, #relevant >= t, #non-relevant >= t) at every distinct score, best first."""
    scores, labels = resolved(sim, rel)
    pairs = sorted(zip(scores, labels, strict=True), key=lambda p: -p[0])
    out: list[tuple[float, int, int]] = []
    tp = fp = 0
    i = 0
    while i < len(pairs):
        t = pairs[i][0]
        while i < len(pairs) and pairs[i][0] == t:  # equal scores enter together
            tp += pairs[i][1]
            fp += not pairs[i][1]
            i += 1
        out.append((t, tp, fp))
    return out


def brute_average_precision(sim: np.ndarray, rel: np.ndarray) -> float:
    positives = int(rel.sum())
    ap, previous_tp = 0.0, 0
    for _, tp, fp in walk(sim, rel):
        ap += (tp - previous_tp) / positives * tp / (tp + fp)
        previous_tp = tp
    return ap


def brute_trapezoid(sim: np.ndarray, rel: np.ndarray) -> float:
    """scikit-learn's auc(recall, precision) on precision_recall_curve, by hand."""
    positives = int(rel.sum())
    curve = [(0.0, 1.0)]  # (recall, precision), prepended
    for _, tp, fp in walk(sim, rel):
        curve.append((tp / positives, tp / (tp + fp)))
        if tp == positives:  # the curve stops at full recall
            break
    return sum((r1 - r0) * (p0 + p1) / 2 for (r0, p0), (r1, p1) in zip(curve, curve[1:], strict=False))


def brute_threshold(sim: np.ndarray, rel: np.ndarray, t: float) -> dict[str, float | None]:
    scores, labels = resolved(sim, rel)
    returned = sum(s >= t for s in scores)
    tp = sum(s >= t and y for s, y in zip(scores, labels, strict=True))
    precision = tp / returned if returned else None
    recall = tp / sum(labels)
    f1 = 2 * precision * recall / (precision + recall) if precision else 0.0
    n_img, n_cap = sim.shape
    return {
        "threshold": t,
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "returned_pairs": returned,
        "empty_i2t": sum(not any(sim[i, c] >= t for c in range(n_cap)) for i in range(n_img)) / n_img,
        "empty_t2i": sum(not any(sim[i, c] >= t for i in range(n_img)) for c in range(n_cap)) / n_cap,
        "results_per_query_i2t": returned / n_img,
        "results_per_query_t2i": returned / n_cap,
    }


def dense_of(img_of_cap: np.ndarray, n_img: int) -> np.ndarray:
    return np.arange(n_img)[:, None] == np.asarray(img_of_cap)[None, :]


def integer_scores(rng: np.random.Generator, n_img: int, n_cap: int, levels: int = 6) -> np.ndarray:
    return rng.integers(0, levels, size=(n_img, n_cap)).astype(np.float32)


def cases():
    """(name, sim, relevance, dense relevance): ties, annotation and dense multi-positive layouts."""
    rng = np.random.default_rng(0)
    layout = rng.permutation(np.repeat(np.arange(8), 5))
    yield "annotations", integer_scores(rng, 8, 40), Relevance.annotations(layout), dense_of(layout, 8)
    rel = rng.random((9, 23)) < rng.uniform(0, 0.4, size=(9, 1))
    rel[0, 0] = True
    yield "dense", integer_scores(rng, 9, 23, 4), Relevance.matrix(rel), rel
    cont = rng.normal(size=(7, 21))
    rel = (cont + rng.normal(size=cont.shape) > 0.8) | dense_of(np.arange(21) % 7, 7)
    yield "continuous", cont, Relevance.matrix(rel), rel


CASES = list(cases())
IDS = [c[0] for c in CASES]


# --- PR curve ----------------------------------------------------------------------------------
@pytest.mark.parametrize("block_elements", [None, 1, 50])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_pr_auc_matches_brute_force(case, block_elements, monkeypatch):
    _, sim, relevance, dense = case
    if block_elements is not None:
        # pair_blocks sizes its blocks from its own (imported) BLOCK_ELEMENTS
        monkeypatch.setattr(pair_blocks_module, "BLOCK_ELEMENTS", block_elements)
        expected_blocks = math.ceil(sim.shape[0] / max(1, block_elements // sim.shape[1]))
        assert len(list(pair_blocks(sim, relevance))) == expected_blocks > 1
    curve = pr_curve(sim, relevance)
    assert curve.average_precision() == pytest.approx(brute_average_precision(sim, dense), rel=1e-12)
    assert curve.trapezoid_auc() == pytest.approx(brute_trapezoid(sim, dense), rel=1e-12)
    # the counts at each relevant threshold
    reference = {t: (tp, fp) for t, tp, fp in walk(sim, dense)}
    assert curve.thresholds.tolist() == sorted({float(s) for s in np.asarray(sim)[dense]}, reverse=True)
    for t, tp, fp in zip(curve.thresholds, curve.tp, curve.fp, strict=True):
        assert (tp, fp) == reference[float(t)]
    summary = global_metrics(curve)
    assert summary["relevant_pairs"] == dense.sum() and summary["pairs"] == dense.size
    assert summary["pr_auc_random"] == pytest.approx(dense.sum() / dense.size)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_pr_auc_matches_scikit_learn(case):
    metrics = pytest.importorskip("sklearn.metrics")
    _, sim, relevance, dense = case
    y, s = dense.ravel(), np.asarray(sim, dtype=np.float64).ravel()
    curve = pr_curve(sim, relevance)
    assert curve.average_precision() == pytest.approx(metrics.average_precision_score(y, s), rel=1e-12)
    precision, recall, _ = metrics.precision_recall_curve(y, s)
    assert curve.trapezoid_auc() == pytest.approx(metrics.auc(recall, precision), rel=1e-12)


def test_pr_auc_hand_case():
    # scores (relevant *): 0.9*, 0.8, 0.7*, 0.7, 0.1*  (P = 3)
    # AP: t=0.9 recall 1/3 precision 1; t=0.7 recall +1/3 precision 2/4; t=0.1 +1/3 precision 3/5
    #     = (1 + 0.5 + 0.6) / 3 = 0.7
    # trapezoid over (0,1) (1/3,1) (1/3,1/2) (2/3,1/2) (1,3/5): 1/3 + 1/3 * 1/2 + 1/3 * (1/2 + 3/5) / 2
    sim = np.array([[0.9, 0.8, 0.7, 0.7, 0.1]])
    rel = np.array([[True, False, True, False, True]])
    curve = pr_curve(sim, Relevance.matrix(rel))
    assert curve.average_precision() == pytest.approx(0.7)
    assert curve.trapezoid_auc() == pytest.approx(1 / 3 + 1 / 6 + 1.1 / 6)
    assert curve.best_f1()["f1"] == pytest.approx(2 * 0.6 * 1 / 1.6)  # t = 0.1: P 3/5, R 1


def test_pr_curve_nan_scores_count_against_the_model():
    sim = np.array([[np.nan, 0.5, 0.4], [0.3, np.nan, 0.2]])
    rel = np.array([[False, True, False], [True, True, False]])
    curve = pr_curve(sim, Relevance.matrix(rel))
    # the NaN negative is a false positive above everything; the NaN positive is found last (-inf)
    assert curve.thresholds[-1] == -np.inf and curve.fp[0] == 1
    assert curve.average_precision() == pytest.approx(brute_average_precision(sim, rel))
    assert curve.average_precision() == pytest.approx((1 / 2 + 2 / 4 + 3 / 6) / 3)


def test_pr_curve_without_relevant_pairs_is_an_error():
    with pytest.raises(ValueError, match="no relevant pair"):
        pr_curve(np.zeros((2, 2)), Relevance.matrix(np.zeros((2, 2), dtype=bool)))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_best_f1_is_the_best_over_every_threshold(case):
    _, sim, relevance, dense = case
    positives = int(dense.sum())
    f1s = {
        t: 2 * tp / (tp + fp) * (tp / positives) / (tp / (tp + fp) + tp / positives)
        for t, tp, fp in walk(sim, dense)
        if tp
    }
    best = pr_curve(sim, relevance).best_f1()
    assert best["f1"] == pytest.approx(max(f1s.values()), rel=1e-12)
    assert f1s[best["threshold"]] == pytest.approx(best["f1"], rel=1e-12)
    at = brute_threshold(sim, dense, best["threshold"])
    assert (best["precision"], best["recall"]) == pytest.approx((at["precision"], at["recall"]))


@pytest.mark.parametrize("target", [0.2, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_threshold_for_precision_gives_the_most_recall(case, target):
    _, sim, relevance, dense = case
    positives = int(dense.sum())
    ok = [(tp / positives, t) for t, tp, fp in walk(sim, dense) if tp and tp / (tp + fp) >= target]
    point = pr_curve(sim, relevance).threshold_for_precision(target)
    if not ok:
        assert point is None
        return
    assert point is not None
    assert point["recall"] == pytest.approx(max(r for r, _ in ok), rel=1e-12)
    at = brute_threshold(sim, dense, point["threshold"])
    assert point["precision"] == pytest.approx(at["precision"]) and point["precision"] >= target
    assert point["recall"] == pytest.approx(at["recall"])
    # the lowest relevant threshold reaching that precision
    relevant_ok = [t for r, t in ok if any(np.asarray(sim)[dense] == t)]
    assert point["threshold"] == min(relevant_ok)


def test_threshold_for_precision_none_when_unreachable():
    sim = np.array([[0.9, 0.1]])
    rel = np.array([[False, True]])
    assert pr_curve(sim, Relevance.matrix(rel)).threshold_for_precision(0.9) is None


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_threshold_metrics_match_brute_force(case, monkeypatch):
    _, sim, relevance, dense = case
    monkeypatch.setattr(pair_blocks_module, "BLOCK_ELEMENTS", 2 * sim.shape[1])  # 2 image rows a block
    values = np.unique(np.asarray(sim))
    asked = [float(values[len(values) // 2]), -100.0, 100.0, float(values[0]) + 0.5, float(values[-1])]
    rows = threshold_metrics(sim, relevance, asked + asked[:2])  # duplicates are reported once
    assert sorted(r["threshold"] for r in rows) == sorted(set(asked))
    for row in rows:
        expected = brute_threshold(sim, dense, row["threshold"])
        assert set(row) == set(expected)
        for key, value in expected.items():
            if value is None:
                assert row[key] is None, key
            else:
                assert row[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    top = next(r for r in rows if r["threshold"] == 100.0)
    assert top["precision"] is None and top["f1"] == 0.0 and top["empty_i2t"] == top["empty_t2i"] == 1.0
    bottom = next(r for r in rows if r["threshold"] == -100.0)
    assert bottom["recall"] == 1.0 and bottom["returned_pairs"] == dense.size and bottom["empty_t2i"] == 0.0


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_threshold_metrics_reuse_the_curve_counts(case):
    # Thresholds the curve holds come from its counts, the others from a pass over the blocks:
    # both must agree with the brute force, alone and mixed.
    _, sim, relevance, dense = case
    curve = pr_curve(sim, relevance)
    on_curve = [float(curve.thresholds[0]), float(curve.thresholds[-1])]
    for asked in (on_curve, on_curve + [-100.0, float(np.median(np.asarray(sim))) + 0.25]):
        rows = threshold_metrics(sim, relevance, asked, curve)
        assert rows == threshold_metrics(sim, relevance, asked)
        for row in rows:
            expected = brute_threshold(sim, dense, row["threshold"])
            assert row["returned_pairs"] == expected["returned_pairs"]
            assert row["recall"] == pytest.approx(expected["recall"], rel=1e-12)


def test_curve_points_are_spread_over_the_curve():
    sim = np.array([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    rel = np.array([[True, False, True, True, False, True]])
    curve = pr_curve(sim, Relevance.matrix(rel))
    everything = curve.points()
    assert everything["threshold"] == [5.0, 3.0, 2.0, 0.0]
    assert everything["recall"] == [0.25, 0.5, 0.75, 1.0]
    assert everything["precision"] == pytest.approx([1.0, 2 / 3, 3 / 4, 4 / 6])
    few = curve.points(max_points=2)
    assert few["threshold"] == [5.0, 0.0] and few["recall"] == [0.25, 1.0]


def test_full_metrics_sections_and_json_ready():
    rng = np.random.default_rng(12)
    layout = rng.permutation(np.repeat(np.arange(10), 5))
    sim = rng.normal(size=(10, 50)) + 1.5 * dense_of(layout, 10)
    relevance = Relevance.annotations(layout)
    cal = Calibration("platt", a=3.0, b=-4.0, fit={"split": "val"})
    report = full_metrics(sim, relevance, layout, calibration=cal, thresholds=(0.5,), distribution_queries=4)
    assert report["retrieval"] == ranking_metrics(sim, relevance)
    curve = pr_curve(sim, relevance)
    assert report["global"]["pr_auc"] == pytest.approx(brute_average_precision(sim, dense_of(layout, 10)))
    asked = {row["threshold"] for row in report["thresholds"]}
    assert {0.5, curve.best_f1()["threshold"]} <= asked
    for target in (0.5, 0.8, 0.9):
        point = curve.threshold_for_precision(target)
        assert report["global"][f"threshold_precision_{target}"] == (point["threshold"] if point else None)
        if point:
            assert point["threshold"] in asked
    assert report["calibration"]["ece"] == calibration_error(sim, relevance, cal)["ece"]
    assert report["calibration"]["score_for_relevance"]["0.5"] == pytest.approx(4.0 / 3.0)
    assert report["score_distribution"]["i2t"]["queries"] == 4
    ready = json_ready(report)
    assert "curve" not in ready and ready["pr_curve_points"]["threshold"] == curve.points()["threshold"]
    assert "curves" in report["score_distribution"]["t2i"]  # for plots
    assert "curves" not in ready["score_distribution"]["t2i"]
    json.dumps(ready)


# --- calibration ---------------------------------------------------------------------------------
def test_isotonic_pav_hand_case():
    # bins with fractions 1/2, 0/2, 1/1 (weights 2, 2, 1): the first two pool to 1/4
    histogram = ScoreHistogram(np.array([0.0, 1.0, 2.0, 3.0]), np.array([1, 0, 1]), np.array([1, 2, 0]))
    cal = fit_calibration(histogram, "isotonic")
    assert cal.x == (0.5, 1.5, 2.5) and cal.y == pytest.approx((0.25, 0.25, 1.0))
    assert cal(np.array([-5.0, 1.0, 2.0, 9.0])) == pytest.approx([0.25, 0.25, 0.625, 1.0])
    assert cal.fit == {"pairs": 5, "relevant_pairs": 2, "bins": 3}


def test_isotonic_recovers_a_known_relevance_curve():
    rng = np.random.default_rng(1)
    sim = rng.random((400, 500))  # p(relevant | s) = s on [0, 1]
    rel = rng.random(sim.shape) < sim
    cal = fit_calibration(score_histogram(sim, Relevance.matrix(rel), bins=50), "isotonic")
    assert np.all(np.diff(cal.y) >= 0) and np.all(np.diff(cal.x) > 0)
    grid = np.linspace(-0.5, 1.5, 401)
    assert np.all(np.diff(cal(grid)) >= 0)
    probe = np.linspace(0.05, 0.95, 19)
    assert np.abs(cal(probe) - probe).max() < 0.05


def test_isotonic_is_non_decreasing_on_a_model_like_matrix():
    rng = np.random.default_rng(2)
    layout = np.repeat(np.arange(60), 5)
    sim = rng.normal(size=(60, 300)) + 2.0 * dense_of(layout, 60)
    cal = fit_calibration(score_histogram(sim, Relevance.annotations(layout)), "isotonic")
    assert np.all(np.diff(cal.y) >= 0) and 0.0 <= cal.y[0] and cal.y[-1] <= 1.0


def test_platt_recovers_a_known_logistic_model():
    rng = np.random.default_rng(3)
    a, b = 4.0, -1.0
    sim = rng.uniform(-1, 1, size=(400, 500))
    rel = rng.random(sim.shape) < 1 / (1 + np.exp(-(a * sim + b)))
    cal = fit_calibration(score_histogram(sim, Relevance.matrix(rel)), "platt")
    assert cal.method == "platt"
    assert cal.a == pytest.approx(a, abs=0.1) and cal.b == pytest.approx(b, abs=0.05)


@pytest.mark.parametrize("method", ["isotonic", "platt"])
def test_score_for_inverts_the_map(method):
    rng = np.random.default_rng(4)
    sim = rng.uniform(-1, 1, size=(200, 300))
    rel = rng.random(sim.shape) < 1 / (1 + np.exp(-(5 * sim - 1)))
    cal = fit_calibration(score_histogram(sim, Relevance.matrix(rel), bins=100), method)
    low, high = float(cal(np.array(-1.0))), float(cal(np.array(1.0)))
    for p in np.linspace(low + 0.01, high - 0.01, 9):
        s = cal.score_for(float(p))
        assert s is not None
        assert float(cal(np.array(s))) == pytest.approx(p, abs=1e-9)
        assert float(cal(np.array(s - 1e-3))) < p  # lower scores fall short of p
    if method == "isotonic":
        assert high < 1.0 and cal.score_for((high + 1.0) / 2) is None  # above the top knot
    else:
        assert cal.score_for(0.0) is None and cal.score_for(1.0) is None
    with pytest.raises(ValueError, match="probability"):
        cal.score_for(1.5)


@pytest.mark.parametrize("method", ["isotonic", "platt"])
def test_calibration_json_round_trip(method):
    rng = np.random.default_rng(5)
    sim = rng.normal(size=(30, 40))
    rel = rng.random(sim.shape) < 1 / (1 + np.exp(-2 * sim))
    cal = fit_calibration(score_histogram(sim, Relevance.matrix(rel)), method)
    back = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert back == cal
    assert np.array_equal(back(sim), cal(sim))


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        {"method": "platt", "a": 1.0, "b": 0.0},  # no format version
        {"format_version": 99, "method": "platt", "a": 1.0, "b": 0.0},
        {"format_version": 1, "method": "histogram"},
        {"format_version": 1, "method": "platt", "a": 1.0},
        {"format_version": 1, "method": "platt", "a": "steep", "b": 0.0},
        {"format_version": 1, "method": "platt", "a": None, "b": 0.0},
        {"format_version": 1, "method": "isotonic", "x": [0.0, 1.0], "y": [0.5]},
        {"format_version": 1, "method": "isotonic", "x": [], "y": []},
        {"format_version": 1, "method": "isotonic", "x": [1.0, 0.0], "y": [0.1, 0.2]},
        {"format_version": 1, "method": "isotonic", "x": [0.0, 1.0], "y": [0.9, 0.2]},
        {"format_version": 1, "method": "isotonic", "x": 3, "y": [0.2]},
        {"format_version": 1, "method": "isotonic", "y": [0.2]},
        {"format_version": 1, "method": "isotonic", "x": [0.0], "y": [0.2], "fit": 7},
    ],
)
def test_malformed_calibration_dicts_raise_value_error(bad):
    with pytest.raises(ValueError):
        Calibration.from_dict(bad)


def test_fit_calibration_errors():
    histogram = ScoreHistogram(np.array([0.0, 1.0]), np.array([0]), np.array([3]))
    with pytest.raises(ValueError, match="no relevant pair"):
        fit_calibration(histogram)
    with pytest.raises(ValueError, match="unknown calibration method"):
        fit_calibration(ScoreHistogram(np.array([0.0, 1.0]), np.array([1]), np.array([3])), "beta")


def naive_ece(sim: np.ndarray, rel: np.ndarray, cal: Calibration, bins: int) -> tuple[float, list[int]]:
    members: list[list[tuple[float, bool]]] = [[] for _ in range(bins)]
    for s, r in zip(sim.ravel().tolist(), rel.ravel().tolist(), strict=True):
        p = float(cal(s))
        members[min(int(p * bins), bins - 1)].append((p, r))
    total = sim.size
    ece = 0.0
    for group in members:
        if group:
            mean_p = sum(p for p, _ in group) / len(group)
            frac = sum(r for _, r in group) / len(group)
            ece += len(group) / total * abs(mean_p - frac)
    return ece, [len(g) for g in members]


@pytest.mark.parametrize("bins", [15, 4])
def test_ece_matches_a_naive_loop(bins, monkeypatch):
    rng = np.random.default_rng(6)
    sim = rng.normal(size=(30, 40))
    rel = rng.random(sim.shape) < 1 / (1 + np.exp(-(3 * sim - 2)))
    relevance = Relevance.matrix(rel)
    monkeypatch.setattr(pair_blocks_module, "BLOCK_ELEMENTS", 7 * 40)  # blocks of 7 image rows
    for cal in (Calibration("platt", a=1.5, b=-0.5), fit_calibration(score_histogram(sim, relevance))):
        got = calibration_error(sim, relevance, cal, bins=bins)
        ece, counts = naive_ece(sim, rel, cal, bins)
        assert got["ece"] == pytest.approx(ece, rel=1e-12, abs=1e-12)
        assert [b["pairs"] for b in got["bins"]] == counts
        assert got["bins"][0]["low"] == 0.0 and got["bins"][-1]["high"] == 1.0


def test_perfectly_calibrated_predictions_have_zero_ece():
    # identity map; 10 pairs at each score s in {.1, .3, .5, .7, .9}, 10 * s of them relevant:
    # each lands in its own 15-bin bucket whose fraction relevant is exactly s
    cal = Calibration("isotonic", x=(0.0, 1.0), y=(0.0, 1.0))
    sim = np.repeat(np.array([0.1, 0.3, 0.5, 0.7, 0.9])[:, None], 10, axis=1)
    rel = np.arange(10)[None, :] < np.array([1, 3, 5, 7, 9])[:, None]
    assert calibration_error(sim, Relevance.matrix(rel), cal)["ece"] == pytest.approx(0.0, abs=1e-12)
    # labels drawn from a known logistic model, scored by that model: ECE is sampling noise only
    rng = np.random.default_rng(7)
    sim = rng.uniform(-2, 2, size=(300, 400))
    rel = rng.random(sim.shape) < 1 / (1 + np.exp(-(2 * sim + 0.5)))
    model = Calibration("platt", a=2.0, b=0.5)
    assert calibration_error(sim, Relevance.matrix(rel), model)["ece"] < 0.01
    assert calibration_error(sim, Relevance.matrix(rel), Calibration("platt", a=4.0, b=0.5))["ece"] > 0.03


def test_score_histogram_counts():
    sim = np.array([[0.0, 0.25, 0.5], [0.75, 1.0, np.nan]])
    rel = np.array([[True, False, True], [False, True, True]])
    h = score_histogram(sim, Relevance.matrix(rel), bins=4)
    assert h.edges.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    # the relevant NaN is resolved to -inf and clipped into the lowest bin
    assert h.relevant.tolist() == [2, 0, 1, 1] and h.other.tolist() == [0, 1, 0, 1]


# --- score distributions -------------------------------------------------------------------------
def naive_curves(scores: np.ndarray, grid: list[float]) -> np.ndarray:
    return np.array([[sum(float(s) >= g for s in row) for g in grid] for row in scores])


@pytest.mark.parametrize("queries", [1000, 5])
def test_score_distribution_curves_are_naive_counts(queries):
    rng = np.random.default_rng(8)
    layout = rng.permutation(np.repeat(np.arange(9), 3))
    sim = rng.integers(0, 7, size=(9, 27)).astype(np.float64)
    sim[rng.random(sim.shape) < 0.2] += rng.random() * 0.5
    dense = dense_of(layout, 9)
    out = score_distributions(sim, Relevance.annotations(layout), queries=queries, grid_points=33, seed=3)
    rng_picks = np.random.default_rng(3)
    picks = {
        "i2t": np.sort(rng_picks.choice(9, size=min(queries, 9), replace=False)),
        "t2i": np.sort(rng_picks.choice(27, size=min(queries, 27), replace=False)),
    }
    sampled = {
        "i2t": (sim[picks["i2t"]], dense[picks["i2t"]]),
        "t2i": (sim.T[picks["t2i"]], dense.T[picks["t2i"]]),
    }
    everything = np.concatenate([s.ravel() for s, _ in sampled.values()])
    for direction, (scores, rel) in sampled.items():
        section = out[direction]
        grid = section["grid"]
        assert len(grid) == 33 and grid[0] == everything.min() and grid[-1] == everything.max()
        curves = naive_curves(scores, grid)
        assert section["queries"] == len(scores)
        assert np.array_equal(section["curves"], curves)
        assert section["curves"][:, 0].tolist() == [scores.shape[1]] * len(scores)  # all >= min
        for q in (5, 50, 95):
            assert section["percentile_curves"][f"p{q}"] == pytest.approx(np.percentile(curves, q, axis=0))
        assert section["top1"]["p50"] == pytest.approx(np.percentile(scores.max(axis=1), 50))
        assert section["top1"]["mean"] == pytest.approx(scores.max(axis=1).mean())
        assert section["relevant"]["p95"] == pytest.approx(np.percentile(scores[rel], 95))


# --- distractors ---------------------------------------------------------------------------------
KS = (1, 5, 10, 100)


def brute_gallery_recall(scores: np.ndarray, rel: np.ndarray, ks=KS) -> dict[str, float]:
    """R@K of the best relevant item of each caption in the full gallery (pessimistic ties)."""
    ranks = []
    for q in range(scores.shape[0]):
        relevant = [float(s) for s, r in zip(scores[q], rel[q], strict=True) if r]
        if not relevant:
            continue
        best = max(relevant)
        ranks.append(1 + sum(float(s) >= best for s, r in zip(scores[q], rel[q], strict=True) if not r))
    return {f"t2i_r{k}": 100.0 * sum(r <= k for r in ranks) / len(ranks) for k in ks}


def splits(n: int, how: str, rng: np.random.Generator) -> list[slice]:
    if how == "one":
        return [slice(0, n)]
    if how == "singles":
        return [slice(i, i + 1) for i in range(n)]
    cuts = np.sort(rng.choice(np.arange(1, n), size=6, replace=False))
    bounds = [0, *cuts.tolist(), n]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("how", ["one", "singles", "random"])
@pytest.mark.parametrize("relevant_distractors", [False, True])
def test_distractor_recall_matches_a_full_gallery_ranking(how, relevant_distractors):
    rng = np.random.default_rng(9)
    n_img, n_dis, dim = 20, 150, 4
    layout = rng.permutation(np.repeat(np.arange(n_img), 2))
    cap = rng.integers(-2, 3, size=(layout.size, dim)).astype(np.float32)  # small integers: many ties
    img = rng.integers(-2, 3, size=(n_img, dim)).astype(np.float32)
    dis = rng.integers(-2, 3, size=(n_dis, dim)).astype(np.float32)
    dis_rel = rng.random((layout.size, n_dis)) < 0.02 if relevant_distractors else None
    acc = DistractorRecall(layout.size)
    acc.add(img @ cap.T, Relevance.annotations(layout).image_rows(0, n_img), distractor=False)
    for s in splits(n_dis, how, rng):
        acc.add(dis[s] @ cap.T, None if dis_rel is None else dis_rel[:, s].T)  # (b, N_cap)
    got = acc.metrics()
    gallery = np.concatenate([cap @ img.T, cap @ dis.T], axis=1)  # (N_cap, N_img + N_dis)
    gallery_rel = np.concatenate(
        [dense_of(layout, n_img).T, dis_rel if dis_rel is not None else np.zeros((layout.size, n_dis), bool)],
        axis=1,
    )
    expected = brute_gallery_recall(gallery, gallery_rel)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
    assert 0 < got["t2i_r10"] < 100  # the distractors matter
    assert got["gallery_size"] == n_img + n_dis and got["queries_without_relevant"] == 0
    relevant_columns = 0 if dis_rel is None else int(dis_rel.any(axis=0).sum())
    assert got["distractors_relevant_to_some_query"] == relevant_columns


def test_distractor_recall_dense_truth_with_queries_without_relevant():
    rng = np.random.default_rng(10)
    q, n_test, ks = 12, 15, (1, 3, 20)
    test_scores = rng.integers(0, 5, size=(q, n_test)).astype(np.float64)
    test_rel = rng.random((q, n_test)) < 0.15
    test_rel[:2] = False  # two captions have no relevant test image ...
    blocks = [rng.integers(0, 5, size=(q, b)).astype(np.float64) for b in (4, 1, 9)]
    block_rel = [rng.random(s.shape) < 0.05 for s in blocks]
    for r in block_rel:
        r[1] = False
    block_rel[0][0, 0] = True  # ... one of them finds one among the distractors
    acc = DistractorRecall(q, ks)
    acc.add(test_scores.T, test_rel.T, distractor=False)  # gallery-major: (images, captions)
    for s, r in zip(blocks, block_rel, strict=True):
        # a torch block with zero columns padding the queries to 8, as the evaluation passes them
        acc.add(torch.from_numpy(np.pad(s.T, ((0, 0), (0, 4)))), r.T)
    got = acc.metrics()
    gallery = np.concatenate([test_scores, *blocks], axis=1)
    gallery_rel = np.concatenate([test_rel, *block_rel], axis=1)
    expected = brute_gallery_recall(gallery, gallery_rel, ks)
    assert {k: got[k] for k in expected} == pytest.approx(expected)
    assert got["queries_without_relevant"] == (~gallery_rel.any(axis=1)).sum() >= 1
    assert got["gallery_size"] == n_test + 14


def test_distractor_recall_input_checks():
    with pytest.raises(ValueError, match="positive"):
        DistractorRecall(3, (0, 5))
    acc = DistractorRecall(3, (1,))
    with pytest.raises(ValueError, match="shape"):
        acc.add(np.zeros((4, 2)))
    with pytest.raises(ValueError, match="shape"):
        acc.add(np.zeros((4, 3)), np.zeros((3, 4), dtype=bool))


def test_distractor_recall_nan_relevant_score_is_a_miss():
    # Caption 0's only relevant image scores NaN: like every rank metric
    # (icr.training.evaluation.metrics.ranking:
    # "NaN counts against the query") it must rank last, i.e. count as a miss in the denominator,
    # not vanish from it. Caption 1 finds its image first. Expected R@1 = 50, R@5 = 100 (3 images).
    scores = np.array([[np.nan, 0.5, 0.1], [0.9, 0.5, 0.1]])  # (captions, images)
    rel = np.array([[True, False, False], [True, False, False]])
    acc = DistractorRecall(2, (1, 5))
    acc.add(scores.T, rel.T, distractor=False)
    got = acc.metrics()
    reference = first_relevant_ranks(scores.T, Relevance.matrix(rel.T), "t2i")  # the ranking engine
    assert reference.tolist() == [3, 1]
    assert got["queries_without_relevant"] == 0.0
    assert (got["t2i_r1"], got["t2i_r5"]) == (50.0, 100.0)
