"""Threshold honesty figures against naive per-query, per-hit loops written here."""

from __future__ import annotations

import numpy as np
import pytest

from icr.training.data.synthetic.kinds import QUERY_KINDS, query_kind
from icr.training.data.synthetic.parse import parse_caption
from icr.training.evaluation.metrics.threshold_honesty import (
    HitLists,
    TopDepth,
    reliability,
    threshold_honesty,
)


def _random_hits(seed: int, q: int = 40, depth: int = 30) -> tuple[HitLists, np.ndarray]:
    rng = np.random.default_rng(seed)
    scores = -np.sort(-rng.random((q, depth)), axis=1)
    relevant = rng.random((q, depth)) < 0.4
    judged = rng.random((q, depth)) < 0.8
    # R: at least the relevant hits found; sometimes 0 (a query with nothing relevant anywhere)
    n_relevant = relevant.sum(1) + rng.integers(0, 20, q) * (rng.random(q) < 0.7)
    n_relevant[0] = 0
    relevant[0] = False
    n_judged = (relevant & judged).sum(1) + rng.integers(0, 5, q)
    kinds = rng.choice(["count", "relation", "one_object"], q)
    relevance = np.round(rng.random((q, depth)), 2)  # ties with the targets happen
    return HitLists(scores, relevant, judged, n_relevant, n_judged, kinds), relevance


def _naive(hits: HitLists, relevance: np.ndarray, rows: list[int], target: float) -> dict:
    p10, rprec = [], []
    passing = good = 0
    per_query = []
    for i in rows:
        r = int(hits.n_relevant[i])
        depth = hits.scores.shape[1]
        if r > 0:
            p10.append(sum(bool(hits.relevant[i, j]) for j in range(min(10, depth))) / min(10, r))
            cut = min(r, depth)
            rprec.append(sum(bool(hits.relevant[i, j]) for j in range(cut)) / cut)
        mine = mine_good = 0
        for j in range(hits.scores.shape[1]):
            if hits.judged[i, j] and relevance[i, j] >= target:
                mine += 1
                mine_good += bool(hits.relevant[i, j])
        passing += mine
        good += mine_good
        if mine:
            per_query.append(mine_good / mine)
    total_relevant = sum(int(hits.n_relevant_judged[i]) for i in rows)
    return {
        "p_at_10": np.mean(p10),
        "r_precision": np.mean(rprec),
        "passing": passing,
        "precision": good / passing if passing else None,
        "recall": good / total_relevant,
        "queries_with_hits": len(per_query),
        "share_below": np.mean([p < target - 0.1 for p in per_query]) if per_query else None,
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_figures_match_naive_loops(seed: int) -> None:
    hits, relevance = _random_hits(seed)
    report = threshold_honesty(hits, relevance, targets=(0.5, 0.8))
    groups = {"pooled": list(range(len(hits)))}
    groups.update({k: [i for i in range(len(hits)) if hits.kinds[i] == k] for k in set(hits.kinds)})
    for name, rows in groups.items():
        got = report["pooled"] if name == "pooled" else report["by_kind"][name]
        assert got["queries"] == len(rows)
        for target in (0.5, 0.8):
            want = _naive(hits, relevance, rows, target)
            assert got["p_at_10"] == pytest.approx(want["p_at_10"])
            assert got["r_precision"] == pytest.approx(want["r_precision"])
            t = got["thresholds"][str(target)]
            for key in ("passing", "queries_with_hits"):
                assert t[key] == want[key], (name, target, key)
            for key in ("precision", "recall", "share_below"):
                assert t[key] == pytest.approx(want[key]), (name, target, key)


def test_reliability_matches_naive_bins() -> None:
    rng = np.random.default_rng(5)
    p = rng.random(500)
    p[:5] = [0.0, 1.0, 1 / 15, 14 / 15, 0.5]  # bin edges and the ends
    y = rng.random(500) < p
    got = reliability(p, y, bins=15)
    ece = 0.0
    for b in range(15):
        members = [i for i in range(500) if min(int(p[i] * 15), 14) == b]
        if members:
            gap = abs(np.mean([p[i] for i in members]) - np.mean([y[i] for i in members]))
            ece += len(members) / 500 * gap
        assert got["bins"][b]["pairs"] == len(members)
    assert got["ece"] == pytest.approx(ece)


def test_expected_precision_is_the_mean_promise() -> None:
    hits, relevance = _random_hits(3)
    t = threshold_honesty(hits, relevance, targets=(0.5,))["pooled"]["thresholds"]["0.5"]
    passing = hits.judged & (relevance >= 0.5)
    assert t["expected_precision"] == pytest.approx(relevance[passing].mean())
    assert t["expected_precision"] >= 0.5


def test_shapes_are_checked() -> None:
    hits, relevance = _random_hits(0)
    with pytest.raises(ValueError, match="relevance must be"):
        threshold_honesty(hits, relevance[:, :-1])
    with pytest.raises(ValueError, match="judged must be"):
        HitLists(hits.scores, hits.relevant, hits.judged[:, :-1], hits.n_relevant, hits.n_relevant_judged)


@pytest.mark.parametrize(
    ("caption", "kind"),
    [
        ("three shapes: a big red disc, a small blue square and a green triangle", "count"),
        ("a red circle left of a blue square", "relation"),
        ("in the top left corner there is a star", "position"),
        ("a big red disc and a small blue square on a dark background", "background"),
        ("a circle that is red; a square that is large", "several_objects"),
        ("a small red shape", "one_object"),
    ],
)
def test_query_kinds(caption: str, kind: str) -> None:
    assert kind in QUERY_KINDS
    assert query_kind(parse_caption(caption)) == kind


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth", [1, 7, 60])
def test_top_depth_streams_the_exact_top_with_ties_by_id(seed: int, depth: int) -> None:
    # small integer vectors: many tied scores, so the running threshold's strict comparison and
    # the tie order (lower id first) are both exercised, over batches of uneven sizes
    rng = np.random.default_rng(seed)
    q, n, dim = 13, 230, 3
    queries = rng.integers(-2, 3, size=(q, dim)).astype(np.float32)
    gallery = rng.integers(-2, 3, size=(n, dim)).astype(np.float32)
    top = TopDepth(queries, depth)
    cuts = [0, *sorted(rng.choice(np.arange(1, n), size=9, replace=False).tolist()), n]
    for a, b in zip(cuts, cuts[1:], strict=False):
        if b - a == 1:
            top.add(gallery[a:b])
        else:  # scores computed once and offered, as the distractor pass shares them
            top.offer(top.score(gallery[a:b]))
    assert top.ntotal == n
    for i in range(q):
        ranked = sorted(range(n), key=lambda j: (-float(queries[i] @ gallery[j]), j))[:depth]
        assert top.ids[i].tolist() == ranked
        assert top.scores[i].tolist() == [float(queries[i] @ gallery[j]) for j in ranked]


def test_top_depth_reads_a_read_only_memory_map(tmp_path) -> None:
    rng = np.random.default_rng(0)
    gallery = rng.standard_normal((50, 4)).astype(np.float32)
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    np.save(tmp_path / "g.npy", gallery)
    top = TopDepth(gallery[:3], 5)
    top.add(np.load(tmp_path / "g.npy", mmap_mode="r"))
    assert top.ids[:, 0].tolist() == [0, 1, 2]  # each query's own vector scores highest
    wide = TopDepth(gallery[:3], 5)
    wide.add(gallery.astype(np.float64)[::1])  # another dtype: converted, not refused
    assert wide.ids.tolist() == top.ids.tolist()
    with pytest.raises(ValueError, match="depth"):
        TopDepth(gallery[:3], 0)
