"""Rank metrics (icr.training.evaluation.metrics.ranking) and test protocols
(icr.training.evaluation.metrics.protocols).

Every metric of ``ranking_metrics`` is checked against a naive oracle written here: one Python loop
per query that sorts the candidates by score with ties broken against the relevant items, walks the
list and reads positions, R@K, medr, meanr, standard AP@k, ECIR AP@k, R-precision and full AP off
it. Inputs: integer-valued scores (many ties), uneven multi-positive dense relevance with queries
that have no relevant item, the annotation layout with 5 captions per image, NaN scores, and block
sizes that split the queries. Small cases are computed by hand in the comments. The COCO 1K protocol
is checked against sequential 1000-image blocks sliced by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from icr.training.evaluation.metrics.protocols import fold_metrics, protocol_folds
from icr.training.evaluation.metrics.ranking import (
    first_relevant_ranks,
    per_query_metrics,
    ranking_metrics,
    relevant_positions,
)
from icr.training.evaluation.metrics.relevant_pairs import Relevance
from icr.training.evaluation.retrieval import retrieval_ranks


# --- the oracle: one query at a time ---------------------------------------------------------------
def oracle_positions(scores: np.ndarray, relevant: np.ndarray) -> list[int]:
    """1-based positions of the relevant items after a pessimistic sort (NaN rules of the module)."""
    s = [float(x) for x in scores]
    rel = [bool(x) for x in relevant]
    poisoned = any(math.isnan(x) and r for x, r in zip(s, rel, strict=True))
    for c, (x, r) in enumerate(zip(s, rel, strict=True)):
        if math.isnan(x) and not r:
            s[c] = math.inf  # a NaN competitor outranks everything
        elif r and poisoned:
            s[c] = -math.inf  # a NaN relevant score sends all the query's relevant items last
    order = sorted(range(len(s)), key=lambda c: (-s[c], rel[c]))  # equal score: non-relevant first
    return [p + 1 for p, c in enumerate(order) if rel[c]]


def oracle_query(positions: list[int]) -> dict[str, float]:
    """Per-query values from the positions of its relevant items (at least one)."""
    r = len(positions)
    out: dict[str, float] = {"rank": positions[0]}
    for k in (5, 10):
        hits = [(m + 1) / p for m, p in enumerate(positions) if p <= k]
        out[f"map{k}"] = sum(hits) / min(k, r)
        out[f"map{k}_ecir"] = sum(hits) / len(hits) if hits else 0.0
    out["rprec"] = sum(p <= r for p in positions) / r
    out["map"] = sum((m + 1) / p for m, p in enumerate(positions)) / r
    return out


def oracle_metrics(sim: np.ndarray, rel: np.ndarray) -> dict[str, float]:
    """ranking_metrics by hand: ``sim`` (N_img, N_cap) and dense ``rel`` (N_img, N_cap) bool."""
    out: dict[str, float] = {}
    for prefix, scores, relevant in (("i2t", sim, rel), ("t2i", sim.T, rel.T)):
        rows = []
        for q in range(scores.shape[0]):
            positions = oracle_positions(scores[q], relevant[q])
            if positions:
                rows.append(oracle_query(positions))
        ranks = [row["rank"] for row in rows]
        out[f"{prefix}_queries"] = scores.shape[0]
        out[f"{prefix}_queries_without_relevant"] = scores.shape[0] - len(rows)
        for k in (1, 5, 10):
            out[f"{prefix}_r{k}"] = 100.0 * sum(x <= k for x in ranks) / len(ranks)
        out[f"{prefix}_ar"] = (out[f"{prefix}_r1"] + out[f"{prefix}_r5"] + out[f"{prefix}_r10"]) / 3
        ordered = sorted(ranks)
        n = len(ordered)
        median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        out[f"{prefix}_medr"] = math.floor(median)
        out[f"{prefix}_meanr"] = sum(ranks) / n
        for key in ("map5", "map5_ecir", "map10", "map10_ecir", "rprec", "map"):
            out[f"{prefix}_{key}"] = sum(row[key] for row in rows) / n
    out["rsum"] = sum(out[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10))
    return out


def dense_of(img_of_cap: np.ndarray, n_img: int) -> np.ndarray:
    return np.arange(n_img)[:, None] == np.asarray(img_of_cap)[None, :]


def assert_metrics(got: dict[str, float], expected: dict[str, float]) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def random_dense(rng: np.random.Generator, n_img: int, n_cap: int) -> np.ndarray:
    """Uneven multi-positive relevance: per-image density from 0 to 0.5, two empty images and captions."""
    density = rng.uniform(0.0, 0.5, size=(n_img, 1))
    rel = rng.random((n_img, n_cap)) < density
    rel[rng.choice(n_img, 2, replace=False)] = False
    rel[:, rng.choice(n_cap, 2, replace=False)] = False
    return rel


def five_per_image(rng: np.random.Generator, n_img: int) -> np.ndarray:
    """Annotation layout: 5 captions per image, in shuffled caption order."""
    return rng.permutation(np.repeat(np.arange(n_img), 5))


# --- hand-computed cases ---------------------------------------------------------------------------
# 2 images x 6 captions, captions 0-2 written for image 0, captions 3-5 for image 1.
HAND_SIM = np.array(
    [
        [0.9, 0.05, 0.5, 0.8, 0.5, 0.1],
        [0.3, 0.7, 0.6, 0.4, 0.65, 0.35],
    ]
)
HAND_LAYOUT = np.array([0, 0, 0, 1, 1, 1])


def test_hand_two_images_six_captions():
    # i2t image 0: order c0 .9 (R), c3 .8, c4 .5 (ties with c2, goes first), c2 .5 (R), c5 .1, c1 .05 (R)
    #   positions [1, 4, 6]. AP@5 standard (1/1 + 2/4) / min(5, 3) = 0.5; ECIR (1 + 0.5) / 2 = 0.75;
    #   AP@10 standard = ECIR = (1 + 0.5 + 3/6) / 3 = 2/3; R-prec 1/3 (one of 3 in top 3); AP 2/3.
    # i2t image 1: order c1 .7, c4 .65 (R), c2 .6, c3 .4 (R), c5 .35 (R), c0 .3 -> positions [2, 4, 5]
    #   AP@5 both ways (1/2 + 2/4 + 3/5) / 3 = 1.6/3; R-prec 1/3; AP 1.6/3; rank 2.
    # t2i ranks (2 candidates, 1 relevant): c0 1, c1 2, c2 2, c3 2, c4 1, c5 1.
    got = ranking_metrics(HAND_SIM, Relevance.annotations(HAND_LAYOUT))
    expected = {
        "i2t_queries": 2,
        "i2t_queries_without_relevant": 0,
        "i2t_r1": 50.0,
        "i2t_r5": 100.0,
        "i2t_r10": 100.0,
        "i2t_ar": 250 / 3,
        "i2t_medr": 1.0,
        "i2t_meanr": 1.5,
        "i2t_map5": (0.5 + 1.6 / 3) / 2,
        "i2t_map5_ecir": (0.75 + 1.6 / 3) / 2,
        "i2t_map10": (2 / 3 + 1.6 / 3) / 2,
        "i2t_map10_ecir": (2 / 3 + 1.6 / 3) / 2,
        "i2t_rprec": 1 / 3,
        "i2t_map": 0.6,
        "t2i_queries": 6,
        "t2i_queries_without_relevant": 0,
        "t2i_r1": 50.0,
        "t2i_r5": 100.0,
        "t2i_r10": 100.0,
        "t2i_ar": 250 / 3,
        "t2i_medr": 1.0,
        "t2i_meanr": 1.5,
        "t2i_map5": 0.75,
        "t2i_map5_ecir": 0.75,
        "t2i_map10": 0.75,
        "t2i_map10_ecir": 0.75,
        "t2i_rprec": 0.5,
        "t2i_map": 0.75,
        "rsum": 500.0,
    }
    assert_metrics(got, expected)
    assert_metrics(got, oracle_metrics(HAND_SIM, dense_of(HAND_LAYOUT, 2)))
    # the same pairs as a dense matrix give the same numbers
    assert_metrics(ranking_metrics(HAND_SIM, Relevance.matrix(dense_of(HAND_LAYOUT, 2))), expected)


def test_hand_positions_and_per_query_values():
    positions, counts = relevant_positions(HAND_SIM, dense_of(HAND_LAYOUT, 2))
    assert positions.tolist() == [[1, 4, 6], [2, 4, 5]] and counts.tolist() == [3, 3]
    values = per_query_metrics(positions, counts)
    assert values["rank"].tolist() == [1, 2]
    assert values["map5"] == pytest.approx([0.5, 1.6 / 3])
    assert values["map5_ecir"] == pytest.approx([0.75, 1.6 / 3])
    assert values["rprec"] == pytest.approx([1 / 3, 1 / 3])


def test_collapsed_model_gets_the_worst_ranks():
    # all scores equal: every relevant item ranks after the 3 non-relevant captions (positions 4, 5, 6)
    got = ranking_metrics(np.zeros((2, 6)), Relevance.annotations(HAND_LAYOUT))
    assert (got["i2t_r1"], got["i2t_r5"], got["i2t_medr"]) == (0, 100, 4)
    assert (got["t2i_r1"], got["t2i_medr"]) == (0, 2)
    # AP@5: (1/4 + 2/5) / 3; ECIR (1/4 + 2/5) / 2; R-prec 0; AP (1/4 + 2/5 + 3/6) / 3
    assert got["i2t_map5"] == pytest.approx(0.65 / 3)
    assert got["i2t_map5_ecir"] == pytest.approx(0.65 / 2)
    assert got["i2t_rprec"] == 0.0
    assert got["i2t_map"] == pytest.approx(1.15 / 3)


def test_hand_queries_without_relevant_are_excluded_and_counted():
    # 3 images x 4 captions; image 2 and caption 3 have no relevant item
    rel = np.array(
        [
            [True, False, True, False],
            [False, True, False, False],
            [False, False, False, False],
        ]
    )
    sim = np.array(
        [
            [0.1, 0.9, 0.8, 0.5],  # image 0: c1, c2 (R), c3, c0 (R) -> positions [2, 4]
            [0.2, 0.3, 0.1, 0.4],  # image 1: c3, c1 (R) -> position 2
            [0.9, 0.9, 0.9, 0.9],  # no relevant caption: never averaged in
        ]
    )
    got = ranking_metrics(sim, Relevance.matrix(rel))
    assert got["i2t_queries"] == 3 and got["i2t_queries_without_relevant"] == 1
    assert got["i2t_r1"] == 0.0 and got["i2t_medr"] == 2.0 and got["i2t_meanr"] == 2.0
    # image 0: AP (1/2 + 2/4) / 2 = 0.5, R-prec 1/2; image 1: AP 1/2, R-prec 0
    assert got["i2t_map"] == pytest.approx(0.5) and got["i2t_rprec"] == pytest.approx(0.25)
    # t2i: c0 -> image 0 after images 2 (.9) and 1 (.2): rank 3; c1 -> image 1 after 0 and 2: rank 3;
    # c2 -> image 0 after image 2 (.9): rank 2; c3 has no relevant image
    assert got["t2i_queries"] == 4 and got["t2i_queries_without_relevant"] == 1
    assert got["t2i_meanr"] == pytest.approx(8 / 3) and got["t2i_medr"] == 3.0
    assert_metrics(got, oracle_metrics(sim, rel))


def test_no_relevant_pair_at_all_is_an_error():
    with pytest.raises(ValueError, match="no i2t query has a relevant candidate"):
        ranking_metrics(np.zeros((2, 3)), Relevance.matrix(np.zeros((2, 3), dtype=bool)))


# --- NaN rules -------------------------------------------------------------------------------------
def test_nan_competitor_ranks_above_everything():
    scores = np.array([[0.9, np.nan, 0.1, 0.95]])
    relevant = np.array([[True, False, False, False]])
    positions, _ = relevant_positions(scores, relevant)
    assert positions.tolist() == [[3]]  # behind the NaN (as +inf) and 0.95


def test_nan_relevant_score_sends_every_relevant_item_last():
    scores = np.array([[np.nan, 0.9, 0.1, 0.2, 0.3]])
    relevant = np.array([[True, True, False, False, False]])
    positions, counts = relevant_positions(scores, relevant)
    assert positions.tolist() == [[4, 5]] and counts.tolist() == [2]  # 0.9 is poisoned too
    # a relevant -inf ties with a non-relevant -inf: the non-relevant one goes first
    positions, _ = relevant_positions(np.array([[-np.inf, -np.inf, 0.0]]), np.array([[True, False, False]]))
    assert positions.tolist() == [[3]]


def test_nan_matrix_matches_the_oracle():
    rng = np.random.default_rng(7)
    sim = rng.integers(0, 4, size=(9, 14)).astype(np.float64)
    sim[rng.random(sim.shape) < 0.12] = np.nan
    rel = random_dense(rng, 9, 14)
    assert_metrics(ranking_metrics(sim, Relevance.matrix(rel), block_rows=2), oracle_metrics(sim, rel))


# --- random matrices against the oracle ------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block_rows", [None, 1, 3])
def test_dense_multi_positive_matches_the_oracle(seed, block_rows):
    rng = np.random.default_rng(seed)
    n_img, n_cap = int(rng.integers(8, 16)), int(rng.integers(15, 40))
    sim = rng.integers(-3, 3, size=(n_img, n_cap)).astype(np.float32)  # many ties
    rel = random_dense(rng, n_img, n_cap)
    got = ranking_metrics(sim, Relevance.matrix(rel), block_rows=block_rows)
    expected = oracle_metrics(sim, rel)
    assert expected["i2t_queries_without_relevant"] >= 2 and expected["t2i_queries_without_relevant"] >= 2
    assert_metrics(got, expected)


@pytest.mark.parametrize("seed", range(3))
def test_annotation_layout_matches_the_oracle(seed):
    rng = np.random.default_rng(100 + seed)
    n_img = 12
    layout = five_per_image(rng, n_img)
    sim = rng.integers(0, 6, size=(n_img, layout.size)).astype(np.float64)
    relevance = Relevance.annotations(layout)
    expected = oracle_metrics(sim, dense_of(layout, n_img))
    assert_metrics(ranking_metrics(sim, relevance), expected)
    assert_metrics(ranking_metrics(sim, relevance, block_rows=5), expected)
    assert expected["i2t_queries_without_relevant"] == 0


def test_positions_match_the_oracle_per_query():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 3, size=(20, 12)).astype(np.float64)
    scores[rng.random(scores.shape) < 0.05] = np.nan
    relevant = rng.random((20, 12)) < 0.3
    positions, counts = relevant_positions(scores, relevant)
    for q in range(20):
        expected = oracle_positions(scores[q], relevant[q])
        assert counts[q] == len(expected)
        assert positions[q, : counts[q]].tolist() == expected
        assert not positions[q, counts[q] :].any()


def test_first_relevant_ranks_equal_retrieval_ranks_and_the_oracle():
    rng = np.random.default_rng(11)
    layout = five_per_image(rng, 15)
    sim = rng.integers(0, 5, size=(15, layout.size)).astype(np.float32)
    relevance = Relevance.annotations(layout)
    i2t, t2i = retrieval_ranks(sim, layout)
    assert np.array_equal(first_relevant_ranks(sim, relevance, "i2t"), i2t)
    assert np.array_equal(first_relevant_ranks(sim, relevance, "t2i", block_rows=4), t2i)
    dense = dense_of(layout, 15)
    assert i2t.tolist() == [oracle_positions(sim[i], dense[i])[0] for i in range(15)]
    assert t2i.tolist() == [oracle_positions(sim[:, c], dense[:, c])[0] for c in range(layout.size)]
    # queries without a relevant item get rank 0
    rel = random_dense(rng, 6, 10)
    ranks = first_relevant_ranks(rng.random((6, 10)), Relevance.matrix(rel), "i2t")
    assert (ranks[~rel.any(axis=1)] == 0).all() and (ranks[rel.any(axis=1)] >= 1).all()


def test_shape_and_direction_errors():
    relevance = Relevance.annotations(HAND_LAYOUT)
    with pytest.raises(ValueError, match="rows must be images"):
        ranking_metrics(HAND_SIM.T, relevance)
    with pytest.raises(ValueError, match="direction"):
        first_relevant_ranks(HAND_SIM, relevance, "x2y")


def test_relevance_subset_and_union():
    layout = np.array([0, 1, 1, 2, 0, 2])
    ann = Relevance.annotations(layout)
    sub = ann.subset(np.array([1, 2]), np.array([1, 2, 3, 5]))
    assert sub.img_of_cap.tolist() == [0, 0, 1, 1] and (sub.n_img, sub.n_cap) == (2, 4)
    with pytest.raises(ValueError, match="not in the image subset"):
        ann.subset(np.array([1, 2]), np.array([0, 1]))
    extra = np.zeros((3, 6), dtype=bool)
    extra[2, 0] = True
    union = ann.union(Relevance.matrix(extra))
    assert np.array_equal(union.dense, dense_of(layout, 3) | extra)
    assert union.num_pairs() == 7
    assert np.array_equal(union.caption_rows(0, 6), union.dense.T)
    assert np.array_equal(ann.caption_rows(0, 6), dense_of(layout, 3).T)


# --- protocols -------------------------------------------------------------------------------------
def test_1k_folds_equal_sequential_blocks_sliced_by_hand():
    rng = np.random.default_rng(5)
    n_img = 3000
    layout = rng.permutation(np.concatenate([np.arange(n_img), rng.choice(n_img, 1500, replace=False)]))
    sim = rng.integers(0, 40, size=(n_img, layout.size)).astype(np.float32)
    got = fold_metrics(sim, Relevance.annotations(layout), layout, "1k")
    per_fold = []
    for fold in range(3):
        lo, hi = 1000 * fold, 1000 * (fold + 1)
        captions = np.flatnonzero((layout >= lo) & (layout < hi))
        block = np.ascontiguousarray(sim[lo:hi][:, captions])
        per_fold.append(ranking_metrics(block, Relevance.annotations(layout[captions] - lo, 1000)))
    assert got["protocol"] == "1k" and got["folds"] == 3
    assert got["per_fold"] == per_fold
    for key in per_fold[0]:
        values = [m[key] for m in per_fold]
        assert got["metrics"][key] == pytest.approx(sum(values) / 3, rel=1e-12), key
        assert got["std"][key] == pytest.approx(float(np.std(values)), abs=1e-9), key
    # rsum of the fold averages equals the mean of the per-fold rsums
    assert got["metrics"]["rsum"] == pytest.approx(
        sum(got["metrics"][f"{d}_r{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10))
    )
    # the folds are not the whole matrix: pooled metrics differ
    assert got["metrics"]["i2t_meanr"] != pytest.approx(
        ranking_metrics(sim, Relevance.annotations(layout))["i2t_meanr"]
    )


def test_1k_with_dense_ground_truth_uses_the_subset():
    rng = np.random.default_rng(6)
    n_img = 2000
    layout = np.repeat(np.arange(n_img), 2)
    truth = dense_of(layout, n_img)
    truth[rng.integers(0, n_img, 300), rng.integers(0, layout.size, 300)] = True  # extra positives
    sim = rng.integers(0, 30, size=(n_img, layout.size)).astype(np.float32)
    got = fold_metrics(sim, Relevance.matrix(truth), layout, "1k")
    for fold in range(2):
        rows, cols = slice(1000 * fold, 1000 * (fold + 1)), slice(2000 * fold, 2000 * (fold + 1))
        assert got["per_fold"][fold] == ranking_metrics(sim[rows, cols], Relevance.matrix(truth[rows, cols]))


def test_protocol_size_checks():
    assert [f.tolist() for f in protocol_folds(3, "full")] == [[0, 1, 2]]
    assert len(protocol_folds(5000, "5k")) == 1 and protocol_folds(5000, "5k")[0].size == 5000
    assert [(f[0], f[-1]) for f in protocol_folds(2000, "1k")] == [(0, 999), (1000, 1999)]
    with pytest.raises(ValueError, match="5,000-image"):
        protocol_folds(1000, "5k")
    with pytest.raises(ValueError, match="folds of 1,000 images"):
        protocol_folds(1500, "1k")
    with pytest.raises(ValueError, match="folds of 1,000 images"):
        protocol_folds(500, "1k")
    with pytest.raises(ValueError, match="unknown protocol"):
        protocol_folds(1000, "10k")
    sim = np.zeros((1000, 1000), dtype=np.float32)
    ann = Relevance.annotations(np.arange(1000))
    with pytest.raises(ValueError, match="5,000-image"):
        fold_metrics(sim, ann, np.arange(1000), "5k")
    sim = np.zeros((1500, 1500), dtype=np.float32)
    with pytest.raises(ValueError, match="folds of 1,000 images"):
        fold_metrics(sim, Relevance.annotations(np.arange(1500)), np.arange(1500), "1k")


def test_full_and_single_fold_1k_equal_ranking_metrics():
    rng = np.random.default_rng(8)
    layout = five_per_image(rng, 30)
    sim = rng.integers(0, 8, size=(30, layout.size)).astype(np.float64)
    relevance = Relevance.annotations(layout)
    full = fold_metrics(sim, relevance, layout, "full")
    assert full["metrics"] == ranking_metrics(sim, relevance)
    assert full["folds"] == 1 and full["per_fold"] == [] and set(full["std"].values()) == {0.0}
    layout = np.repeat(np.arange(1000), 2)
    sim = rng.integers(0, 50, size=(1000, 2000)).astype(np.float32)
    one = fold_metrics(sim, Relevance.annotations(layout), layout, "1k")
    assert one["folds"] == 1 and one["metrics"] == ranking_metrics(sim, Relevance.annotations(layout))
