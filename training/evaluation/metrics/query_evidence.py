"""Does a calibration have evidence for this query? No promise without it.

A relevance map is fitted on held-out queries. For a query unlike every one of them (nonsense,
another domain, a kind of query never fitted) it has no evidence, and its number is a guess dressed
as a probability: on the demo, "qwerty" passed 1,000 hits at relevance 0.99, since its score list
looks like that of a broad query ("a red shape"). What separates such queries is not where their
embedding or score list lies (README, "No promise without evidence": an unknown token maps nonsense
close to real captions) but what the fit has seen of their words, whatever the tokenizer:

* a query is read as word n-grams: its lower-cased Unicode words (:func:`icr.training.data.vocab.tokenize`)
  and adjacent word pairs; a phrase never fitted ("left of" when no relation caption was fitted, or
  word salad of known words) shows up as unseen pairs;
* ``novelty(q)`` = the share of its n-grams that no fitting query contains (1 for a query with no
  word at all: "!!!", a zero-width space);
* the reference is the fitting queries' own novelty, each computed *leaving that query out* (an
  n-gram only it contains counts as unseen), so it says how novel an in-domain query typically is:
  nearly never on the embedded benchmark's closed vocabulary, often a little on COCO captions;
* conformal novelty p-value (Bates et al., "Testing for outliers with conformal p-values", 2023):
  ``p(q) = (1 + #{i : novelty_i >= novelty(q)}) / (n + 1)``. A query is inside the evidence when
  ``p(q) > alpha``. For a query exchangeable with the fitting queries, ``P(p <= alpha) <= alpha``:
  at most ``alpha`` of in-domain queries lose their promise (the cost in recall, stated and measured);
* words the model's tokenizer maps to its unknown token are outside by definition (the model never
  read them), whatever their p-value.

Outside the evidence the service gives no relevance (null), ``min_relevance`` passes nothing, and
the response says why in plain words (:meth:`Evidence.reason`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from icr.training.data.vocab import tokenize

EVIDENCE_FORMAT = 1
# At most this share of in-domain queries (exchangeable with the fitting ones) is refused a promise.
DEFAULT_ALPHA = 0.01
# Unseen words and phrases a response names (the rest are counted, not listed).
SHOWN_UNSEEN = 5


def query_grams(text: str) -> list[str]:
    """The query's distinct word n-grams in order of first appearance: words, then adjacent pairs
    ("a red circle" -> a, red, circle, "a red", "red circle")."""
    words = tokenize(text)
    grams = [*words, *(f"{a} {b}" for a, b in zip(words, words[1:], strict=False))]
    return list(dict.fromkeys(grams))


@dataclass(frozen=True)
class Evidence:
    """What the calibration has seen of one query."""

    inside: bool
    p_value: float  # conformal novelty p-value (1.0: every n-gram seen)
    novelty: float  # share of the query's n-grams no fitting query contains
    unseen: tuple[str, ...]  # those n-grams, words first (at most SHOWN_UNSEEN)
    unknown_words: tuple[str, ...]  # words the model's tokenizer cannot read
    no_words: bool  # the query has no word at all

    def reason(self) -> str | None:
        """Why the query gets no promise, in plain words (None when it is inside the evidence)."""
        if self.inside:
            return None
        if self.no_words:
            why = "the query has no words the model can read"
        elif self.unknown_words:
            why = f"the model does not know the words {_quoted(self.unknown_words)}"
        else:
            why = (
                f"the calibration never saw queries like it (no fitted query contains "
                f"{_quoted(self.unseen)}; fewer than {self.p_value:.1%} of fitted queries are as novel)"
            )
        return (
            f"no relevance is given for this query: {why}; its results are only the nearest images by "
            "score, with no promise that any of them is relevant"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "inside": self.inside,
            "p_value": self.p_value,
            "novelty": self.novelty,
            "unseen": list(self.unseen),
            "unknown_words": list(self.unknown_words),
            "reason": self.reason(),
        }


def _quoted(words: Sequence[str]) -> str:
    return ", ".join(f"'{w}'" for w in words)


@dataclass(frozen=True)
class QueryEvidence:
    """The n-grams of a calibration's fitting queries and their leave-one-out novelty; JSON round trip
    with :meth:`to_dict` / :meth:`from_dict`."""

    counts: dict[str, int]  # n-gram -> fitting queries that contain it
    reference: np.ndarray  # (n,) sorted leave-one-out novelty of the fitting queries
    alpha: float = DEFAULT_ALPHA

    @classmethod
    def fit(cls, texts: Iterable[str], alpha: float = DEFAULT_ALPHA) -> QueryEvidence:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        grams = [query_grams(t) for t in texts]
        if not grams:
            raise ValueError("query evidence needs at least one fitting query")
        counts = Counter(g for gs in grams for g in gs)
        # leave one out: an n-gram only this query contains is unseen by the others
        novelty = np.array([sum(counts[g] == 1 for g in gs) / len(gs) if gs else 1.0 for gs in grams])
        return cls(dict(counts), np.sort(novelty), alpha)

    def novelty(self, text: str) -> tuple[float, list[str]]:
        """(share of the text's n-grams no fitting query contains, those n-grams in order)."""
        return self._novelty(query_grams(text))

    def _novelty(self, grams: list[str]) -> tuple[float, list[str]]:
        unseen = [g for g in grams if g not in self.counts]
        return (len(unseen) / len(grams) if grams else 1.0), unseen

    def p_value(self, novelty: float) -> float:
        """Conformal p-value: (1 + fitting queries at least as novel) / (n + 1)."""
        n = len(self.reference)
        at_least = n - int(np.searchsorted(self.reference, novelty - 1e-12, side="left"))
        return (1 + at_least) / (n + 1)

    def assess(self, text: str, unknown_words: Sequence[str] = ()) -> Evidence:
        grams = query_grams(text)
        novelty, unseen = self._novelty(grams)
        p = self.p_value(novelty)
        no_words = not grams
        inside = p > self.alpha and not unknown_words and not no_words
        return Evidence(
            inside=inside,
            p_value=p,
            novelty=novelty,
            unseen=tuple(unseen[:SHOWN_UNSEEN]),
            unknown_words=tuple(dict.fromkeys(unknown_words))[:SHOWN_UNSEEN],
            no_words=no_words,
        )

    def inside(self, texts: Sequence[str], unknown: Sequence[Sequence[str]] | None = None) -> np.ndarray:
        """(Q,) bool: each text is inside the evidence (``unknown``: each text's unknown words)."""
        return np.array(
            [self.assess(t, () if unknown is None else unknown[i]).inside for i, t in enumerate(texts)],
            dtype=bool,
        )

    def to_dict(self) -> dict[str, Any]:
        values, counts = np.unique(self.reference, return_counts=True)
        return {
            "format_version": EVIDENCE_FORMAT,
            "alpha": self.alpha,
            "queries": int(len(self.reference)),
            # the reference as (value, how many fitting queries have it): most have novelty 0
            "reference": [[float(v), int(c)] for v, c in zip(values, counts, strict=True)],
            "grams": dict(sorted(self.counts.items())),
        }

    @classmethod
    def from_dict(cls, d: Any) -> QueryEvidence:
        if not isinstance(d, dict) or d.get("format_version") != EVIDENCE_FORMAT:
            got = d.get("format_version") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"query evidence format {got!r}; this code reads {EVIDENCE_FORMAT} (refit it)")
        pairs = d["reference"]
        values = np.repeat([float(v) for v, _ in pairs], [int(c) for _, c in pairs])
        grams = d["grams"]
        if not isinstance(grams, dict) or not all(isinstance(c, int) and c > 0 for c in grams.values()):
            raise ValueError("query evidence: grams must map each n-gram to a positive count")
        if len(values) == 0 or not np.all((values >= 0) & (values <= 1)):
            raise ValueError("query evidence: the reference needs novelty values in [0, 1]")
        alpha = float(d["alpha"])
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"query evidence: alpha must be in (0, 1), got {alpha}")
        return cls({str(g): int(c) for g, c in grams.items()}, np.sort(values), alpha)
