"""FeedbackStore.query_labels, the labels the search page marks its hits with: one SQL statement,
checked against the labels computed naively from every judgement (last verdict per person, majority
per hit, a tie not relevant), and on the primary key's prefix (it reads one query's rows only)."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

from icr.index.feedback_labels import QUERY_LABELS_SQL, FeedbackStore, HitLabel

KEY = "sha:2024-01-01T00:00:00"
PEOPLE = ("ana", "bo", "cy", "admin-key", "127.0.0.1")
QUERIES = ("a red circle", "a blue square", "two dogs on a beach")


def _naive(
    verdicts: dict[tuple[str, str, int, str], bool],
    key: str,
    query: str,
    ids: set[int] | None,
    who: str | None,
) -> list[HitLabel]:
    """From every person's last verdict: per hit of ``query`` on ``key``, the majority (a tie: not
    relevant), the counts, and ``who``'s own verdict."""
    hits: dict[int, list[tuple[str, bool]]] = {}
    for (k, q, image, person), relevant in verdicts.items():
        if k == key and q == query and (ids is None or image in ids):
            hits.setdefault(image, []).append((person, relevant))
    out = []
    for image in sorted(hits):
        votes = hits[image]
        yes = sum(relevant for _, relevant in votes)
        mine = next((relevant for person, relevant in votes if person == who), None)
        out.append(HitLabel(image, yes > len(votes) - yes, len(votes), yes, mine))
    return out


def test_the_labels_of_a_query_are_the_majority_of_each_persons_last_verdict(tmp_path: Path) -> None:
    store = FeedbackStore(tmp_path / "feedback.sqlite")
    verdicts: dict[tuple[str, str, int, str], bool] = {}

    def add(key: str, query: str, image: int, relevant: bool, who: str) -> None:
        store.add(key, query, image, relevant, who)
        verdicts[(key, query, image, who)] = relevant

    # the cases by hand: a changed verdict, a tie, a majority either way
    add(KEY, "a red circle", 3, True, "ana")
    add(KEY, "a red circle", 3, False, "ana")  # ana changes her mind: her last verdict counts, once
    add(KEY, "a red circle", 4, True, "ana")
    add(KEY, "a red circle", 4, False, "bo")  # a tie: not relevant
    add(KEY, "a red circle", 5, True, "ana")
    add(KEY, "a red circle", 5, True, "bo")
    add(KEY, "a red circle", 5, False, "cy")  # 2 of 3: relevant
    add(KEY, "a blue square", 3, True, "bo")  # another query's label of the same image stays apart
    add("other:index", "a red circle", 3, True, "bo")  # so does another index's
    assert store.query_labels(KEY, "a red circle", who="ana") == [
        HitLabel(3, False, 1, 0, False),
        HitLabel(4, False, 2, 1, True),
        HitLabel(5, True, 3, 2, True),
    ]
    assert store.query_labels(KEY, "a red circle", [5, 4, 99], who="cy") == [
        HitLabel(4, False, 2, 1, None),
        HitLabel(5, True, 3, 2, False),
    ]
    assert store.query_labels(KEY, "a red circle", []) == []  # no hits asked for: none
    assert store.query_labels(KEY, "a green star") == []
    assert store.query_labels(KEY, "a blue square", who=None) == [HitLabel(3, True, 1, 1, None)]

    # many people changing their minds at random, read back against the naive computation
    rng = random.Random(0)
    for _ in range(600):
        key = rng.choice((KEY, "other:index"))
        add(key, rng.choice(QUERIES), rng.randrange(12), rng.random() < 0.5, rng.choice(PEOPLE))
    again = FeedbackStore(tmp_path / "feedback.sqlite")  # a reopened file answers the same
    ties = 0
    for query in QUERIES:
        for who in (*PEOPLE, "nobody", None):
            for ids in (None, set(rng.sample(range(14), 5))):
                found = again.query_labels(KEY, query, ids, who)
                assert found == _naive(verdicts, KEY, query, ids, who), (query, who, ids)
                ties += sum(2 * hit.relevant_judgements == hit.judgements for hit in found)
    assert ties > 0  # the tie rule was exercised
    # the same labels as labels() and counts() read: one per judged hit, the same verdicts
    rows = {(label.query, label.image): label.relevant for label in again.labels(KEY)}
    per_query = {
        (query, hit.image_id): hit.relevant for query in QUERIES for hit in again.query_labels(KEY, query)
    }
    assert per_query == rows
    assert again.counts(KEY).relevant == sum(per_query.values())


def test_the_labels_of_a_query_are_read_through_the_primary_key(tmp_path: Path) -> None:
    """One query's rows are found by the primary key's prefix (index_key, query), not by reading
    every label."""
    path = tmp_path / "feedback.sqlite"
    FeedbackStore(path).add(KEY, "a red circle", 3, True, "ana")
    with sqlite3.connect(path) as db:
        for ids in (None, "[3, 4]"):
            args = {"key": KEY, "query": "a red circle", "ids": ids, "who": "ana"}
            plan = " / ".join(row[-1] for row in db.execute("EXPLAIN QUERY PLAN " + QUERY_LABELS_SQL, args))
            assert "SEARCH labels USING INDEX" in plan and "index_key=? AND query=?" in plan, plan
            assert "SCAN labels" not in plan, plan
