"""Per-query calibration: the relevance of a hit from its score *and* from what the query itself shows.

One score -> relevance map for all queries cannot keep its promise per query: the same cosine
means "certainly relevant" for "a red shape" (thousands of relevant images, all scoring alike)
and "probably a near miss" for "three shapes: ..." (one relevant image among many that share two
of its three objects). What separates them is visible at query time, as in query-performance
prediction: in the query's own score list (how high the top score is, how fast the scores fall,
how spread they are), in its embedding, and in its words (a stated count, a relation). The map
reads those features ``z`` and turns each hit's score into a probability:

    u     = (score - mean_q) / std_q          (the hit's score standardised within its own list)
    logit = softplus(a(z)) * u + b(z) - softplus(g(z)) * log(rank)

``z``: the scores at ranks 1, 2, 5, 10, 20, 50, 100 with their mean and standard deviation over the
top 100, optionally the query embedding and optionally hashed word uni- and bigrams of the query
text (:func:`text_features`), each standardised over the fitting queries; ``a``, ``b``, ``g`` come
from one small MLP. Both slopes are positive, so within a query relevance never rises as the score
falls: a threshold on it is a threshold on the score, and the hits passing it are a prefix of the
ranking. ``g`` lets a broad query stay relevant deep into its list while a narrow one drops after
its first hits.

Fitted by logistic loss on held-out queries' top-depth hits labelled relevant or not; applied per
request in numpy (tens of microseconds for a 1,000-hit list).

**Per-group correction** (:func:`fit_query_calibration_by_group`). Fitted on every query at once,
the map serves the common kinds of query well and the rare, hard ones badly: on the demo's
held-out count captions, the hits it put at relevance >= 0.5 were 29 % relevant. Where a query's
group can be read from its words (``group_by="benchmark_kind"``: the embedded benchmark's query
kind, from the caption's parse), each group gets an isotonic map from the per-query relevance to
the precision its hits actually had. Those maps are fitted *out of fold* (the per-query map refitted
on four fifths of the queries, applied to the fifth), so they correct what the map gets wrong on
queries it has not seen, not on the ones it was fitted to, and every value rests on at least
``GROUP_MIN_HITS`` held-out hits (:func:`~icr.training.evaluation.metrics.calibration.merged_from_top`)
and is the 95 % lower confidence bound of their precision, not the fraction itself.
The maps are non-decreasing, so a query's relevance stays non-increasing down its list. A query
outside every group (it does not parse) keeps the per-query map's value.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from icr.training.data.synthetic.kinds import text_kind
from icr.training.evaluation.metrics.calibration import (
    Calibration,
    ScoreHistogram,
    fit_calibration,
    merged_from_top,
)

if TYPE_CHECKING:
    from icr.training.evaluation.metrics.calibration import Calibration

FEATURE_RANKS: tuple[int, ...] = (1, 2, 5, 10, 20, 50, 100)
# Spread statistics are taken over this many top hits, so any search depth >= it gives the same features.
STATS_DEPTH = 100
MIN_DEPTH = max(*FEATURE_RANKS, STATS_DEPTH)
N_QUERY_FEATURES = len(FEATURE_RANKS) + 2  # the scores at the ranks, their mean and spread
TEXT_BUCKETS = 512
QUERY_CALIBRATION_FORMAT = 2
GROUP_BY: tuple[str, ...] = ("benchmark_kind",)
GROUP_FOLDS = 5
GROUP_MIN_HITS = 100
# The group maps give each merged bin the 95 % one-sided Wilson lower bound of its precision: on
# the demo, 21 test count hits that a bin's plain fraction (>= 100 validation hits) put over 0.5
# were 38 % relevant (README, "The demo model").
GROUP_LOWER_Z = 1.645
GROUP_BINS = 200  # equal-width bins of per-query relevance the group maps are fitted on
_WORD = re.compile(r"[a-z0-9]+")


def query_features(scores: np.ndarray) -> np.ndarray:
    """(Q, depth) scores, best first -> (Q, N_QUERY_FEATURES) raw score-list features.

    Lists shorter than ``MIN_DEPTH`` (a small gallery) are extended with their last score.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2 or scores.shape[1] < 1:
        raise ValueError(f"query features need (Q, depth) scores, got an array of shape {scores.shape}")
    if scores.shape[1] < MIN_DEPTH:
        scores = np.concatenate([scores, np.repeat(scores[:, -1:], MIN_DEPTH - scores.shape[1], 1)], 1)
    top = scores[:, :STATS_DEPTH]
    at = scores[:, [r - 1 for r in FEATURE_RANKS]]  # (Q, len(FEATURE_RANKS))
    return np.concatenate([at, top.mean(1, keepdims=True), top.std(1, keepdims=True)], axis=1)


def text_features(texts: Sequence[str], buckets: int = TEXT_BUCKETS) -> np.ndarray:
    """(Q, buckets) 0/1: which hashed word unigrams and bigrams each (lower-cased) text contains."""
    out = np.zeros((len(texts), buckets), dtype=np.float64)
    for i, text in enumerate(texts):
        words = _WORD.findall(text.lower())
        for gram in [*words, *(f"{a} {b}" for a, b in zip(words, words[1:], strict=False))]:
            out[i, zlib.crc32(gram.encode("utf-8")) % buckets] = 1.0
    return out


def query_groups(group_by: str, texts: Sequence[str]) -> np.ndarray:
    """(Q,) object array: each text's group (None: in no group). ``benchmark_kind``: the embedded
    benchmark's query kind (:mod:`icr.training.data.synthetic.kinds`), about 35 µs a text."""
    if group_by != "benchmark_kind":
        raise ValueError(f"unknown query grouping {group_by!r}; expected one of {', '.join(GROUP_BY)}")

    return np.array([text_kind(t) for t in texts], dtype=object)


def standardised(scores: np.ndarray) -> np.ndarray:
    """Each score standardised by the mean and spread of its own list's top ``STATS_DEPTH``."""
    top = scores[:, :STATS_DEPTH]
    u: np.ndarray = (scores - top.mean(1, keepdims=True)) / (top.std(1, keepdims=True) + 1e-6)
    return u


def _softplus(x: np.ndarray) -> np.ndarray:
    y: np.ndarray = np.logaddexp(0.0, x)
    return y


def _inputs(
    scores: np.ndarray, embeddings: np.ndarray | None, texts: Sequence[str] | None, text_buckets: int
) -> np.ndarray:
    parts = [query_features(scores)]
    if embeddings is not None:
        parts.append(np.asarray(embeddings, dtype=np.float64))
    if texts is not None:
        parts.append(text_features(texts, text_buckets))
    return np.concatenate(parts, axis=1)


@dataclass(frozen=True)
class QueryCalibration:
    """A fitted per-query map; JSON round trip with :meth:`to_dict` / :meth:`from_dict`."""

    feature_mean: np.ndarray  # (F,) standardisation of the inputs
    feature_std: np.ndarray  # (F,)
    w1: np.ndarray  # (F, H)
    b1: np.ndarray  # (H,)
    w2: np.ndarray  # (H, 3): columns a, b, g
    b2: np.ndarray  # (3,)
    uses_embedding: bool
    text_buckets: int  # 0: the query text is not read
    fit: dict[str, Any]
    group_by: str | None = None  # how a query's group is read from its text (GROUP_BY); None: no groups
    group_maps: dict[str, Calibration] = field(default_factory=dict)  # group -> relevance correction

    def logits(
        self, scores: np.ndarray, embeddings: np.ndarray | None = None, texts: Sequence[str] | None = None
    ) -> np.ndarray:
        """(Q, depth) scores (best first) -> (Q, depth) logits of relevance."""
        if self.uses_embedding and embeddings is None:
            raise ValueError("this calibration reads the query embedding; pass embeddings=")
        if self.text_buckets and texts is None:
            raise ValueError("this calibration reads the query text; pass texts=")
        scores = np.asarray(scores, dtype=np.float64)
        z = _inputs(
            scores,
            embeddings if self.uses_embedding else None,
            texts if self.text_buckets else None,
            self.text_buckets,
        )
        z = (z - self.feature_mean) / self.feature_std
        out = np.maximum(z @ self.w1 + self.b1, 0.0) @ self.w2 + self.b2  # (Q, 3)
        log_rank = np.log(np.arange(1, scores.shape[1] + 1, dtype=np.float64))  # (depth,)
        logits: np.ndarray = (
            _softplus(out[:, :1]) * standardised(scores) + out[:, 1:2] - _softplus(out[:, 2:]) * log_rank
        )
        return logits

    def __call__(
        self, scores: np.ndarray, embeddings: np.ndarray | None = None, texts: Sequence[str] | None = None
    ) -> np.ndarray:
        """(Q, depth) probabilities of relevance, non-increasing along each best-first row; with
        ``texts``, each query's group correction applied (see the module docstring)."""
        relevance: np.ndarray = 1.0 / (1.0 + np.exp(-self.logits(scores, embeddings, texts)))
        if self.group_by is None or not self.group_maps or texts is None:
            return relevance
        groups = query_groups(self.group_by, texts)  # (Q,)
        for group, correction in self.group_maps.items():
            rows = np.flatnonzero(groups == group)
            relevance[rows] = correction(relevance[rows])
        return relevance

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": QUERY_CALIBRATION_FORMAT,
            "method": "per_query",
            "uses_embedding": self.uses_embedding,
            "text_buckets": self.text_buckets,
            **{k: getattr(self, k).tolist() for k in ("feature_mean", "feature_std", "w1", "b1", "w2", "b2")},
            "fit": self.fit,
            "group_by": self.group_by,
            "group_maps": {g: m.to_dict() for g, m in self.group_maps.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QueryCalibration:
        if d.get("format_version") != QUERY_CALIBRATION_FORMAT or d.get("method") != "per_query":
            raise ValueError(
                f"per-query calibration format {d.get('format_version')!r} / method {d.get('method')!r}; "
                f"this code reads format {QUERY_CALIBRATION_FORMAT}, method per_query (refit it)"
            )
        arrays = {
            k: np.asarray(d[k], dtype=np.float64)
            for k in ("feature_mean", "feature_std", "w1", "b1", "w2", "b2")
        }
        shapes_ok = (
            arrays["w1"].ndim == 2
            and arrays["w1"].shape[0] == arrays["feature_mean"].shape[0] == arrays["feature_std"].shape[0]
            and arrays["w2"].shape == (arrays["w1"].shape[1], 3)
            and arrays["b1"].shape == (arrays["w1"].shape[1],)
            and arrays["b2"].shape == (3,)
        )
        if not shapes_ok or not all(np.all(np.isfinite(a)) for a in arrays.values()):
            raise ValueError("per-query calibration weights have inconsistent shapes or non-finite values")

        group_by = d.get("group_by")
        if group_by is not None and group_by not in GROUP_BY:
            raise ValueError(f"unknown query grouping {group_by!r}; this code reads {', '.join(GROUP_BY)}")
        return cls(
            **arrays,
            uses_embedding=bool(d["uses_embedding"]),
            text_buckets=int(d["text_buckets"]),
            fit=dict(d.get("fit", {})),
            group_by=group_by,
            group_maps={str(g): Calibration.from_dict(m) for g, m in (d.get("group_maps") or {}).items()},
        )


def fit_query_calibration(
    scores: np.ndarray,
    relevant: np.ndarray,
    embeddings: np.ndarray | None = None,
    texts: Sequence[str] | None = None,
    *,
    weights: np.ndarray | None = None,
    text_buckets: int = TEXT_BUCKETS,
    hidden: int = 32,
    steps: int = 300,
    sampled: int = 200,
    lr: float = 0.03,
    weight_decay: float = 1e-3,
    seed: int = 0,
) -> QueryCalibration:
    """Fit on held-out queries' top-depth hits: ``scores`` (Q, depth) best first, ``relevant`` (Q, depth).

    ``embeddings`` (Q, E) and ``texts`` (Q strings): also read the query embedding and its words
    (where the kind of query, not its score list, decides how far a score can be trusted).
    ``weights`` (Q, depth): per-hit weights of the loss, e.g. 0 for a caption's own image, which
    stays in its list but must not teach the map what a hit on an image nobody wrote the query for
    means. Full-batch Adam on the mean logistic loss over every query's top ``STATS_DEPTH`` hits
    and ``sampled`` of the others, drawn at random and weighted up to stand for all of them.
    """
    scores = np.asarray(scores, dtype=np.float64)
    relevant = np.asarray(relevant, dtype=bool)
    if relevant.shape != scores.shape:
        raise ValueError(f"relevant must have the scores' shape {scores.shape}, got {relevant.shape}")
    z = _inputs(scores, embeddings, texts, text_buckets)
    # An input constant over the fit (a word bucket no fitting query has) keeps unit scale: dividing
    # by its zero spread would blow up the first query that has it.
    mean, std = z.mean(0), z.std(0)
    std = np.where(std < 1e-6, 1.0, std)
    torch.manual_seed(seed)
    zt = torch.from_numpy((z - mean) / std).float()  # (Q, F)
    u = torch.from_numpy(standardised(scores)).float()  # (Q, depth)
    depth = scores.shape[1]
    rng = np.random.default_rng(seed)
    rest = depth - STATS_DEPTH
    if rest > sampled:
        # Top hits all kept; the tail by a random sample per query, each standing for rest / sampled hits.
        tail = STATS_DEPTH + np.argsort(rng.random((scores.shape[0], rest)), axis=1)[:, :sampled]
        cols = np.concatenate([np.broadcast_to(np.arange(STATS_DEPTH), (len(tail), STATS_DEPTH)), tail], 1)
        weight = np.concatenate([np.ones(STATS_DEPTH), np.full(sampled, rest / sampled)])
    else:
        cols, weight = np.broadcast_to(np.arange(depth), scores.shape), np.ones(depth)
    u = u.gather(1, torch.from_numpy(np.ascontiguousarray(cols)))  # (Q, kept)
    log_rank = torch.log(torch.from_numpy(cols + 1.0).float())  # (Q, kept)
    y = torch.from_numpy(np.take_along_axis(relevant, cols, 1)).float()  # (Q, kept)
    pair_weight = np.broadcast_to(weight, cols.shape)  # (Q, kept)
    if weights is not None:
        weights = np.asarray(weights, dtype=np.float64)
        if weights.shape != scores.shape:
            raise ValueError(f"weights must have the scores' shape {scores.shape}, got {weights.shape}")
        pair_weight = pair_weight * np.take_along_axis(weights, cols, 1)
    w = torch.from_numpy(pair_weight / max(pair_weight.mean(), 1e-12)).float()  # (Q, kept)
    layer1, layer2 = torch.nn.Linear(z.shape[1], hidden), torch.nn.Linear(hidden, 3)
    with torch.no_grad():
        layer2.bias.copy_(torch.tensor([0.0, 0.0, -2.0]))  # start with a gentle rank decay
    opt = torch.optim.Adam([*layer1.parameters(), *layer2.parameters()], lr=lr, weight_decay=weight_decay)
    loss_fn = torch.nn.BCEWithLogitsLoss(weight=w)
    softplus = torch.nn.functional.softplus
    for _ in range(steps):
        out = layer2(torch.relu(layer1(zt)))  # (Q, 3)
        logits = softplus(out[:, :1]) * u + out[:, 1:2] - softplus(out[:, 2:]) * log_rank
        loss = loss_fn(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def arr(t: torch.Tensor) -> np.ndarray:
        return t.detach().double().numpy()

    return QueryCalibration(
        feature_mean=mean,
        feature_std=std,
        w1=arr(layer1.weight).T,
        b1=arr(layer1.bias),
        w2=arr(layer2.weight).T,
        b2=arr(layer2.bias),
        uses_embedding=embeddings is not None,
        text_buckets=text_buckets if texts is not None else 0,
        fit={
            "queries": int(scores.shape[0]),
            "depth": int(scores.shape[1]),
            "pairs": int(relevant.size),
            "relevant_pairs": int(relevant.sum()),
            "final_loss": float(loss.detach()),
            "inputs": ["score list"]
            + ["embedding"] * (embeddings is not None)
            + ["text"] * (texts is not None),
        },
    )


def fit_query_calibration_by_group(
    scores: np.ndarray,
    relevant: np.ndarray,
    embeddings: np.ndarray | None = None,
    texts: Sequence[str] | None = None,
    *,
    group_by: str = "benchmark_kind",
    weights: np.ndarray | None = None,
    folds: int = GROUP_FOLDS,
    min_hits: int = GROUP_MIN_HITS,
    seed: int = 0,
    **options: Any,
) -> QueryCalibration:
    """:func:`fit_query_calibration` on every query, with the per-group corrections of the module
    docstring fitted out of fold (``folds`` folds; ``options`` go to every fit). Needs ``texts``:
    the groups are read from them, at fit time as at query time."""
    if texts is None:
        raise ValueError("a per-group correction reads each query's group from its text: pass texts=")
    if folds < 2:
        raise ValueError(f"folds must be >= 2, got {folds}")
    scores = np.asarray(scores, dtype=np.float64)
    relevant = np.asarray(relevant, dtype=bool)
    judged = np.ones(scores.shape, bool) if weights is None else np.asarray(weights) > 0  # (Q, depth)
    groups = query_groups(group_by, texts)  # (Q,)
    texts = list(texts)
    fold = np.random.default_rng(seed).permutation(len(scores)) % folds  # (Q,)
    out_of_fold = np.zeros(scores.shape)  # (Q, depth)
    for f in range(folds):
        train, held = np.flatnonzero(fold != f), np.flatnonzero(fold == f)
        part = fit_query_calibration(
            scores[train],
            relevant[train],
            None if embeddings is None else embeddings[train],
            [texts[i] for i in train],
            weights=None if weights is None else np.asarray(weights)[train],
            seed=seed,
            **options,
        )
        out_of_fold[held] = part.logits(
            scores[held], None if embeddings is None else embeddings[held], [texts[i] for i in held]
        )
    out_of_fold = 1.0 / (1.0 + np.exp(-out_of_fold))
    edges = np.linspace(0.0, 1.0, GROUP_BINS + 1)
    maps: dict[str, Calibration] = {}
    for group in sorted({g for g in groups.tolist() if g is not None}):
        rows = np.flatnonzero(groups == group)
        p, y = out_of_fold[rows][judged[rows]], relevant[rows][judged[rows]]
        if not y.any():  # nothing relevant among the group's held-out hits
            maps[group] = Calibration("isotonic", x=(0.0, 1.0), y=(0.0, 0.0), fit={"pairs": int(len(y))})
            continue
        bins = np.minimum((p * GROUP_BINS).astype(np.int64), GROUP_BINS - 1)
        histogram = ScoreHistogram(
            edges, np.bincount(bins[y], minlength=GROUP_BINS), np.bincount(bins[~y], minlength=GROUP_BINS)
        )
        maps[group] = fit_calibration(merged_from_top(histogram, min_hits), lower_z=GROUP_LOWER_Z)
        maps[group].fit.update(queries=int(len(rows)))
    full = fit_query_calibration(scores, relevant, embeddings, texts, weights=weights, seed=seed, **options)
    fit = {**full.fit, "group_by": group_by, "group_folds": folds, "group_min_hits": min_hits}
    return replace(full, fit=fit, group_by=group_by, group_maps=maps)
