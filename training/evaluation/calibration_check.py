"""The ``relevance`` section of ``icr evaluate``: do calibrated thresholds keep their promise?

Held-out captions (the evaluated split) are searched, as the service searches, to ``depth`` over a
gallery they were not written for: on the embedded benchmark the split's images plus the
generated distractors, judged on the distractors only, with the generator's ground truth; on
Flickr30k/COCO the split's images, judged on every image but the caption's own, with the
annotations (or CxC positives), which *underestimate* relevance (an unannotated relevant image
counts as a negative).

The maps under test are fitted on the validation split's captions against the same kind of gallery
(its own images plus the same distractors; a caption's own image stays in its list, as in the
service, but never enters the fit) and compared side by side:

* ``per_query`` (:mod:`icr.training.evaluation.metrics.query_calibration`): the score and the query's own
  results (and embedding), what ``icr index calibrate`` now writes for the service;
* ``isotonic_served``: one score -> relevance map fitted on the same held-out hits;
* ``isotonic_all_pairs``: one map fitted on every pair of the validation split (the calibration
  before this section existed; kept as the baseline).

Figures per map, pooled and per query kind (:mod:`training.data.synthetic.kinds`): see
:mod:`icr.training.evaluation.metrics.threshold_honesty`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from icr.training.data.synthetic.ground_truth import relevance_of_hits
from icr.training.data.synthetic.kinds import query_kind
from icr.training.data.synthetic.parse import parse_caption
from icr.training.evaluation.metrics.calibration import Calibration, fit_calibration, score_histogram
from icr.training.evaluation.metrics.query_calibration import (
    QueryCalibration,
    fit_query_calibration,
    fit_query_calibration_by_group,
)
from icr.training.evaluation.metrics.query_evidence import QueryEvidence
from icr.training.evaluation.metrics.query_honesty import ood_figures, query_honesty
from icr.training.evaluation.metrics.relevant_pairs import Relevance
from icr.training.evaluation.metrics.threshold_honesty import HitLists, TopDepth, threshold_honesty
from icr.training.evaluation.ood_queries import NONSENSE, OTHER_DOMAIN, word_salad

DEFAULT_DEPTH = 1000  # the service's search depth (ICR_SEARCH_DEPTH)
ANNOTATION_NOTE = (
    "labels are the annotations: relevance is underestimated, since an image relevant to a caption "
    "but not annotated with it counts as a negative"
)


@dataclass
class QuerySide:
    """One split's captions as queries over its gallery (the split's images, then any distractors)."""

    captions: list[str]
    embeddings: np.ndarray  # (Q, D)
    own_image: np.ndarray  # (Q,) the gallery row each caption was written for (-1: none)
    top: TopDepth
    groups: dict[str, int] = field(default_factory=dict)  # consecutive named groups of queries, if any

    @classmethod
    def start(
        cls, captions: list[str], cap_emb: np.ndarray, img_of_cap: np.ndarray, img_emb: np.ndarray, depth: int
    ) -> QuerySide:
        top = TopDepth(cap_emb, depth)
        top.add(img_emb)
        return cls(list(captions), cap_emb, np.asarray(img_of_cap, dtype=np.int64), top)


def synthetic_hits(
    captions: Sequence[str],
    scores: np.ndarray,
    ids: np.ndarray,
    table: Any,
    num_images: int,
    *,
    judge_distractors: bool,
    own_image: np.ndarray | None = None,
) -> HitLists:
    """Ground-truth hit lists of ``captions``' (Q, depth) ``scores`` / gallery ``ids`` (-1: no hit)
    over the gallery whose scenes are ``table`` (its first ``num_images`` rows a split's images).

    Judged: the distractors (rows >= num_images) with ``judge_distractors``, else every hit but the
    caption's ``own_image`` (None: the captions' own images are not in this gallery)."""
    queries = [parse_caption(c) for c in captions]
    judged_from = num_images if judge_distractors else 0
    relevant, n_relevant, n_judged = relevance_of_hits(queries, ids, table, judged_from=judged_from)
    judged = ids >= judged_from  # also leaves out the -1 of a short list
    if own_image is not None and not judge_distractors:
        judged &= ids != own_image[:, None]
        n_judged = n_judged - 1  # the own image is relevant (every caption is true of its image)
    kinds = np.array([query_kind(q) for q in queries])
    return HitLists(scores, relevant, judged, n_relevant, n_judged, kinds)


def annotation_hits(side: QuerySide, positives: Callable[[int], np.ndarray] | None = None) -> HitLists:
    """Hit lists labelled by the annotations (or ``positives(q)``: the gallery rows relevant to q);
    judged = every row but the caption's own image."""
    ids = side.top.ids
    if positives is None:
        relevant = ids == side.own_image[:, None]
        n_relevant = np.ones(len(ids), dtype=np.int64)
    else:
        rows = [positives(q) for q in range(len(ids))]
        relevant = np.stack([np.isin(ids[q], rows[q]) for q in range(len(ids))])
        n_relevant = np.array([len(r) for r in rows], dtype=np.int64)
    judged = ids != side.own_image[:, None]
    n_judged = n_relevant - (relevant & ~judged).sum(1)
    return HitLists(side.top.scores, relevant, judged, n_relevant, n_judged, None)


@dataclass(frozen=True)
class ServedMaps:
    """What ``icr index calibrate`` writes for the service: the per-query map, the global map, and
    the evidence that decides which queries get a relevance at all."""

    per_query: QueryCalibration
    global_map: Calibration
    evidence: QueryEvidence


def fit_served_maps(
    fit_hits: HitLists, embeddings: np.ndarray, texts: list[str], method: str = "isotonic"
) -> ServedMaps:
    """The per-query map (reading each query's score list, embedding and words), the global map
    (``method``: isotonic or platt), both fitted on the judged hits of held-out queries (unjudged
    hits: weight 0), and the fitting queries' evidence (:mod:`.metrics.query_evidence`). Where the
    hits know their queries' kinds (the embedded benchmark), the per-query map carries a correction
    per kind (:func:`fit_query_calibration_by_group`)."""
    judged = fit_hits.judged
    # the judged hits as one row of pairs, so the all-pairs histogram serves them too
    pairs = Relevance.matrix(fit_hits.relevant[judged][None, :])
    served = fit_calibration(score_histogram(fit_hits.scores[judged][None, :], pairs), method)
    served.fit.update(kind="served hits", queries=len(fit_hits), depth=int(fit_hits.scores.shape[1]))
    fit = fit_query_calibration if fit_hits.kinds is None else fit_query_calibration_by_group
    per_query = fit(fit_hits.scores, fit_hits.relevant, embeddings, texts, weights=judged)
    return ServedMaps(per_query, served, QueryEvidence.fit(texts))


def mapped(
    relevance_map: Calibration | QueryCalibration,
    scores: np.ndarray,
    embeddings: np.ndarray,
    texts: Sequence[str],
    evidence: QueryEvidence | None = None,
    unknown: Sequence[Sequence[str]] | None = None,
) -> np.ndarray:
    """(Q, depth) relevance of best-first ``scores`` as the service gives it: NaN rows for the
    queries outside ``evidence`` (``unknown``: each text's words the tokenizer cannot read)."""
    if isinstance(relevance_map, QueryCalibration):
        out = relevance_map(scores, embeddings, texts)
    else:
        out = relevance_map(scores)
    out = np.array(out, dtype=np.float64)
    if evidence is not None:
        out[~evidence.inside(texts, unknown)] = np.nan
    return out


def honesty_report(
    test_hits: HitLists,
    test_embeddings: np.ndarray,
    test_texts: list[str],
    maps: dict[str, Any],
    evidence: QueryEvidence | None = None,
    unknown: Sequence[Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Threshold honesty and per-query honesty (``queries``) of each map (name -> Calibration or
    QueryCalibration) on the test hits. ``evidence`` applies to the served map (``per_query``) only:
    the others are baselines as they are."""
    out = {}
    for name, relevance_map in maps.items():
        if relevance_map is None:
            continue
        gate = evidence if name == "per_query" else None
        predicted = mapped(relevance_map, test_hits.scores, test_embeddings, test_texts, gate, unknown)
        out[name] = {
            **threshold_honesty(test_hits, predicted),
            "queries": query_honesty(test_hits.relevant, predicted, test_hits.kinds),
        }
    return out


HELD_OUT_KIND = "relation"  # the kind the out-of-domain section fits without, then queries


def held_out_kind_relevance(
    fit_hits: HitLists,
    fit_embeddings: np.ndarray,
    fit_texts: list[str],
    test_hits: HitLists,
    test_embeddings: np.ndarray,
    test_texts: list[str],
    kind: str = HELD_OUT_KIND,
    unknown: Sequence[Sequence[str]] | None = None,
) -> np.ndarray:
    """(Q_kind, depth) relevance of the test captions of ``kind``, served by maps and evidence fitted
    on every fitting query *but* that kind's: a kind the calibration never saw."""
    if fit_hits.kinds is None or test_hits.kinds is None:
        raise ValueError("a held-out kind needs hits that know their queries' kinds")
    keep = np.flatnonzero(fit_hits.kinds != kind)
    rows = np.flatnonzero(test_hits.kinds == kind)
    if len(keep) == len(fit_hits) or len(keep) == 0:
        raise ValueError(f"cannot hold out {kind!r}: the fitting queries must have some of it and more")
    maps = fit_served_maps(fit_hits.select(keep), fit_embeddings[keep], [fit_texts[i] for i in keep])
    return mapped(
        maps.per_query,
        test_hits.scores[rows],
        test_embeddings[rows],
        [test_texts[i] for i in rows],
        maps.evidence,
        None if unknown is None else [unknown[int(i)] for i in rows],
    )


def ood_groups(
    fit_texts: Sequence[str], queries: Sequence[str] | None = None, seed: int = 0
) -> dict[str, list[str]]:
    """The out-of-domain query groups of :mod:`.ood_queries`: nonsense and other domains (or the
    user's own ``queries``), and word salad of the fitting queries' words."""
    groups = {"nonsense": list(NONSENSE), "other_domain": list(OTHER_DOMAIN)}
    if queries is not None:
        groups = {"given": list(queries)}
    return {**groups, "word_salad": word_salad(fit_texts, len(OTHER_DOMAIN), seed)}


def ood_report(relevance: dict[str, np.ndarray]) -> dict[str, Any]:
    """:func:`ood_figures` per group of out-of-domain queries (name -> (Q_group, depth) relevance,
    NaN rows where no promise is given) and over all of them (``all``), each query counted once."""
    out = {name: ood_figures(r) for name, r in relevance.items()}
    depth = max(r.shape[1] for r in relevance.values())  # NaN pads a shorter list: it passes nothing
    rows = [np.pad(r, ((0, 0), (0, depth - r.shape[1])), constant_values=np.nan) for r in relevance.values()]
    out["all"] = ood_figures(np.concatenate(rows))
    return out
