"""What a user should know about one query's results, in plain sentences.

Relevance is a calibrated probability, but a calibration is only as good as what it was fitted
and checked on. Each search response therefore carries a ``quality`` block: the query's kind on
the embedded benchmark (read from its parse: microseconds) with the model's held-out P@10 for that
kind, and warnings when

* the query is of a kind the model handles poorly (``calibration.json``'s ``kinds`` table says
  ``handled_well: false``): high relevance does not make its results right;
* the query does not parse in the embedded benchmark's grammar: the model never saw such words,
  so neither its ranking nor the relevance can be trusted;
* few of the top 10 are likely relevant (their mean relevance is below one half);
* the calibration's labels are known to bias it (``labels_note``);
* the served index has changed so much since the build its calibration was fitted on that the
  promise is no longer measured to hold (:func:`calibration_due`).

First of all, a text query outside the calibration's evidence
(:mod:`icr.training.evaluation.metrics.query_evidence`) is given no relevance at all, and the block
says why (``evidence``); a calibration fitted before the check existed says it cannot tell.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from icr.training.data.synthetic.generate import SCENES_NAME
from icr.training.data.synthetic.kinds import text_kind
from icr.training.data.synthetic.parse import CaptionParseError, parse_caption
from icr.training.evaluation.metrics.query_evidence import Evidence

# Below this mean relevance of the top 10 retrieved, the response says few results are likely relevant.
LOW_TOP_RELEVANCE = 0.5
TOP_N = 10

# What each query kind of the embedded benchmark asks for, in words a user understands.
KIND_WORDS = {
    "count": "they state how many objects there are",
    "relation": "they relate two objects, e.g. 'left of'",
    "position": "they place an object, e.g. 'in the top left corner'",
    "background": "they name the background",
    "several_objects": "they name two or more objects",
    "one_object": "they name one object",
}
DATED_CALIBRATION = (
    "this index's calibration predates the evidence check, so it cannot tell whether it has seen "
    "queries like this one; refit it with `icr index calibrate`"
)
# A living index's writes change each query's score list, on which the per-query map reads its
# features. Measured on the demo index, 21,000 images (docs/results/2026-11-27-living-index.md):
# adding 10 %, 25 % or 50 % more images kept every min_relevance within 0.006 of its promise;
# deleting 10 % moved precision at 0.5 by 0.007 below it, 25 % by 0.015, 50 % by 0.051 (0.861
# delivered for 0.912 promised). From a quarter of the build deleted, or more added than was
# measured, a response says the calibration is due for a refit.
RECALIBRATE_DELETED = 0.25
RECALIBRATE_ADDED = 0.5
_UNKNOWN_WORD = re.compile(r"unknown word '([^']*)'")


def over_embedded_benchmark(data: dict[str, Any]) -> bool:
    """Whether an index manifest's ``data`` is an embedded-benchmark dataset (it has scenes.json)."""
    path = data.get("path")
    return path is not None and bool(path) and (Path(path) / SCENES_NAME).is_file()


def benchmark_kind(text: str) -> tuple[str | None, str | None]:
    """(kind, None) for a query inside the embedded benchmark's grammar, else (None, the warning)."""
    kind = text_kind(text)  # cached: the calibration's kind correction parses the same text
    if kind is not None:
        return kind, None
    try:
        parse_caption(text)  # again, only to say why it does not parse
    except CaptionParseError as err:
        why = str(err).removeprefix(f"cannot read caption {text!r}: ")
        unknown = _UNKNOWN_WORD.fullmatch(why)
        where = f"first unknown word: '{unknown.group(1)}'" if unknown else why
        return None, (
            f"the query uses words or phrasing outside the embedded benchmark's vocabulary ({where}): "
            "the model never saw such queries, so its results and their relevance are unreliable"
        )
    return None, None  # not reached: text_kind is None only for a text that does not parse


def _kind_warning(kind: str, row: dict[str, Any]) -> str | None:
    if row.get("handled_well", True):
        return None
    words = KIND_WORDS.get(kind)
    named = f"'{kind}' queries ({words})" if words else f"'{kind}' queries"
    p10 = row.get("p_at_10")
    if p10 is None:
        return f"{named} were not measured on held-out captions: their relevance is unverified"
    return (
        f"{named} are handled poorly by this model: on held-out captions its P@10 for them is "
        f"{p10:.2f}; expect wrong images even at high relevance"
    )


def calibration_due(added: int, deleted: int, built: int) -> str | None:
    """The warning a response carries when the images ``added`` to or ``deleted`` from an index of
    ``built`` images since its build exceed what its calibration was measured to survive."""
    if built <= 0 or (deleted < RECALIBRATE_DELETED * built and added <= RECALIBRATE_ADDED * built):
        return None
    return (
        f"the index has changed since its calibration was fitted ({added:,} images added, {deleted:,} "
        f"deleted, of {built:,}): relevance may promise more than it delivers; refit it from labels "
        "(POST /v1/feedback/refit), or rebuild the index over the current images and calibrate it again "
        "(icr index build, icr index calibrate)"
    )


def query_quality(
    text: str | None,
    *,
    benchmark: bool,
    kinds: dict[str, Any],
    top_relevance: float | None,
    top_count: int = TOP_N,
    labels_note: str | None,
    evidence: Evidence | None = None,
    dated: bool = False,
    due: str | None = None,
) -> dict[str, Any]:
    """The response's ``quality`` block.

    ``text``: the text query (None for an image query); ``benchmark``: the index is over the
    embedded benchmark; ``kinds``: the calibration's per-kind table (may be empty);
    ``top_relevance``: the mean relevance of the top ``top_count`` retrieved (``TOP_N``, fewer only in
    a tiny index; None without calibration or outside its evidence); ``evidence``: what the
    calibration has seen of the text query; ``dated``: the calibration has no evidence to check;
    ``due``: the index changed past what the calibration survives (:func:`calibration_due`).
    """
    kind = p10 = None
    warnings: list[str] = []
    reason = evidence.reason() if evidence is not None else None
    outside = reason is not None
    if reason is not None:
        warnings.append(reason)
    if dated:
        warnings.append(DATED_CALIBRATION)
    if text is not None and benchmark:
        kind, problem = benchmark_kind(text)
        if problem is not None and not outside:  # the evidence's reason already names the words
            warnings.append(problem)
        elif kind in kinds:
            row = kinds[kind]
            p10 = row.get("p_at_10")
            warning = _kind_warning(kind, row)
            if warning is not None:
                warnings.append(warning)
    if top_relevance is not None and top_relevance < LOW_TOP_RELEVANCE:
        warnings.append(
            "few results are likely relevant: expected precision of the top "
            f"{top_count} is {top_relevance:.2f}"
        )
    if labels_note:
        warnings.append(labels_note)
    if due is not None:
        warnings.append(due)
    return {
        "kind": kind,
        "kind_p_at_10": p10,
        "warnings": warnings,
        "evidence": evidence.to_dict() if evidence is not None else None,
    }
