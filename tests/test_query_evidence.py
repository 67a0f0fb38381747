"""Query evidence (no promise without evidence): n-grams, leave-one-out novelty and the conformal
p-value against naive loops, unknown words, and the JSON round trip."""

from __future__ import annotations

import numpy as np
import pytest

from icr.training.evaluation.metrics.query_evidence import QueryEvidence, query_grams

FIT = [
    "a red circle",
    "a blue square on a dark background",
    "a red circle and a blue square",
    "in the top left corner there is a star",
    "a small green star",
    "a red square",
    "a blue circle",
    "three shapes: a red circle, a blue square and a star",
]


def naive_novelty(text: str, others: list[str]) -> float:
    words = text.lower().replace(":", " ").replace(",", " ").split()
    grams = list(dict.fromkeys(words + [f"{a} {b}" for a, b in zip(words, words[1:], strict=False)]))
    if not grams:
        return 1.0
    seen = set()
    for other in others:
        w = other.lower().replace(":", " ").replace(",", " ").split()
        seen |= set(w) | {f"{a} {b}" for a, b in zip(w, w[1:], strict=False)}
    return sum(g not in seen for g in grams) / len(grams)


def test_grams_are_words_then_pairs_in_order() -> None:
    assert query_grams("A red, RED circle!") == ["a", "red", "circle", "a red", "red red", "red circle"]
    assert query_grams("!!!") == [] and query_grams("\u200b") == []


def test_leave_one_out_novelty_and_p_value_match_naive_loops() -> None:
    evidence = QueryEvidence.fit(FIT, alpha=0.2)
    loo = sorted(naive_novelty(t, FIT[:i] + FIT[i + 1 :]) for i, t in enumerate(FIT))
    assert np.allclose(evidence.reference, loo)
    for query in ["a red circle", "a green circle", "qwerty", "circle red star", "a star left of a circle"]:
        novelty, _ = evidence.novelty(query)
        assert novelty == pytest.approx(naive_novelty(query, FIT))
        p = (1 + sum(v >= novelty - 1e-12 for v in loo)) / (len(loo) + 1)
        assessed = evidence.assess(query)
        assert assessed.p_value == pytest.approx(p)
        assert assessed.inside == (p > 0.2)


def test_what_is_inside_and_outside() -> None:
    evidence = QueryEvidence.fit(FIT * 20, alpha=0.01)  # every fitting query seen 20 times: novelty 0
    inside = evidence.assess("a blue square")
    assert inside.inside and inside.p_value == 1.0 and inside.reason() is None
    for text in ["qwerty", "the eiffel tower at night", "circle circle red", "a star left of a circle"]:
        out = evidence.assess(text)
        assert not out.inside and out.p_value == pytest.approx(1 / (len(FIT) * 20 + 1))
        assert "never saw queries like it" in (out.reason() or "")
    assert evidence.assess("qwerty").unseen == ("qwerty",)
    assert set(evidence.assess("a star left of a circle").unseen) >= {"of", "star left", "left of"}
    empty = evidence.assess("\u200b")
    assert not empty.inside and empty.no_words and "no words" in (empty.reason() or "")
    # words the tokenizer cannot read are outside whatever the n-grams say
    unknown = evidence.assess("a red circle", unknown_words=["circle"])
    assert not unknown.inside and unknown.p_value == 1.0 and "'circle'" in (unknown.reason() or "")
    flags = evidence.inside(["a red circle", "qwerty", "a blue circle"], [[], [], ["blue"]])
    assert flags.tolist() == [True, False, False]


def test_alpha_is_the_share_of_fitting_queries_refused() -> None:
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(60)]
    texts = [" ".join(rng.choice(words, size=4)) for _ in range(400)]
    evidence = QueryEvidence.fit(texts, alpha=0.1)
    # exchangeable queries from the same source: about alpha of them or fewer are refused
    fresh = [" ".join(rng.choice(words, size=4)) for _ in range(400)]
    refused = 1 - evidence.inside(fresh).mean()
    assert 0.0 < refused <= 0.1 + 3 * np.sqrt(0.1 * 0.9 / 400)


def test_round_trip_and_bad_files() -> None:
    evidence = QueryEvidence.fit(FIT, alpha=0.05)
    again = QueryEvidence.from_dict(evidence.to_dict())
    assert again.counts == evidence.counts and again.alpha == 0.05
    assert np.array_equal(again.reference, evidence.reference)
    for query in ["a red circle", "qwerty", "a star"]:
        assert again.assess(query) == evidence.assess(query)
    good = evidence.to_dict()
    for bad in [
        None,
        {**good, "format_version": 9},
        {**good, "alpha": 1.5},
        {**good, "grams": {"a": 0}},
        {**good, "reference": []},
        {**good, "reference": [[2.0, 3]]},
    ]:
        with pytest.raises(ValueError):
            QueryEvidence.from_dict(bad)
    with pytest.raises(ValueError):
        QueryEvidence.fit([])
    with pytest.raises(ValueError):
        QueryEvidence.fit(FIT, alpha=0.0)
