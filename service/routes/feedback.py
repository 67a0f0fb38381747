"""POST /v1/feedback (label a served hit), GET /v1/feedback (what the labels hold and support), GET
/v1/feedback/labels (the labels already given to one query's hits, for the page to show them) and
POST /v1/feedback/refit (fit the calibration on them and serve it): labelling where the user is.

The labels live in the server's state directory (``feedback.sqlite``, :mod:`icr.index.feedback_labels`),
keyed by the served image index (its checkpoint and build stamp), so a rebuilt index starts without
the old index's labels and a restart keeps them. A refit runs :func:`calibrate_from_labels` on them
in the request's worker thread (the route is sync: never on the event loop), which replaces the
index folder's calibration.json atomically, then reloads the artifacts the way POST
/v1/admin/reload does, so the answer comes once the new calibration is served.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import Field

from icr.core.state_dir import default_state_dir
from icr.index.calibration import ServedCalibration
from icr.index.feedback_labels import FEEDBACK_FILE, FeedbackStore, index_key
from icr.index.label_calibration import USER_LABELS, calibrate_from_labels
from icr.service.access import admin_identity
from icr.service.errors import ApiError
from icr.service.loaded_index import calibration_summary
from icr.service.retriever import Retriever
from icr.service.routes.admin import reload_artifacts
from icr.service.routes.deps import folder_live, query_text, retriever_of, settings_of
from icr.service.schemas import (
    LABELS_IDS_MAX,
    SQLITE_INT_MAX,
    FeedbackRequest,
    LabelledHit,
    QueryLabels,
    check_text,
    error_responses,
)
from icr.service.serving import without_paths
from icr.service.strict_json import StrictJSONRoute

log = logging.getLogger("icr.service")
router = APIRouter(prefix="/v1/feedback", tags=["feedback"], route_class=StrictJSONRoute)
_refitting = threading.Lock()  # a fit loads the model and the index again: one at a time
_store_lock = threading.Lock()
# What the refit answer and GET /v1/feedback show of a threshold (the label report has more)
_THRESHOLD_FIELDS = ("reached", "score", "labels_above", "precision_above", "more_labels", "best_bound")
# A refit waits this long for an admin reload (or the watcher's) to finish before its own reload
_RELOAD_WAIT_S = 120.0


def feedback_store(request: Request) -> FeedbackStore:
    """The labels file in the server's state directory, opened on first use (a server nobody labels
    on creates no file)."""
    state = request.app.state
    with _store_lock:
        store: FeedbackStore | None = getattr(state, "feedback", None)
        if store is None:
            settings = settings_of(request)
            store = FeedbackStore((settings.state_dir or default_state_dir()) / FEEDBACK_FILE)
            state.feedback = store
    return store


def served_key(retriever: Retriever) -> str:
    manifest = retriever.images.manifest
    return index_key(manifest.checkpoint_sha256, manifest.created)


def supports(calibration: ServedCalibration | None) -> dict[str, Any] | None:
    """What a calibration fitted on user labels supports, per min_relevance: whether the bound
    reaches it, from which score, the labels above that score and their precision, and how many more
    labels would bring the bound to +-0.05. None for a calibration not fitted on user labels."""
    if calibration is None or calibration.info.get("labels") != USER_LABELS:
        return None
    report = calibration.info.get("label_report")
    if not isinstance(report, dict):
        return None
    thresholds = report.get("thresholds") or {}
    return {
        "labels": report.get("labels"),
        "used": report.get("used"),
        "beyond_depth": report.get("beyond_depth"),
        "relevant": report.get("relevant"),
        "queries": report.get("queries"),
        "thresholds": {
            target: {k: v for k, v in entry.items() if k in _THRESHOLD_FIELDS}
            for target, entry in thresholds.items()
            if isinstance(entry, dict)
        },
    }


@router.post(
    "",
    summary="Label a served hit relevant or not relevant to its text query",
    responses=error_responses(401, 403, 404, 422, 503),
)
def add_feedback(body: FeedbackRequest, request: Request) -> dict[str, Any]:
    """Stores one judgement for the served image index (the same person judging the same hit again
    replaces their earlier verdict; several people's verdicts become one label by majority). The
    200 comes once it is on disk. Answers with what the labels of this index now hold. Needs the
    admin key (ICR_ADMIN_KEY; unset: clients on this machine only)."""
    settings = settings_of(request)
    # the text search reads (stripped, bounded): a label names a query search could have answered,
    # with the text the refit will embed
    query = query_text(
        body.query,
        settings,
        "query",
        "send the text the hit was returned for",
        ", as for searches; send the query the hit was returned for",
    )
    retriever = retriever_of(request)
    state = retriever.images.live.state  # an image added since the build is labelled as any other
    if not state.is_live(body.image_id):
        ids = (
            f"ids run from 0 to {state.ids_end - 1}, less deleted ones"
            if state.size
            else "it holds no images"
        )
        raise ApiError(
            404, "not_found", f"image_id: no image {body.image_id} in the served index; {ids} (a hit's id)"
        )
    # the middleware let only an admin through; "admin" covers a reload of the settings in between
    who = admin_identity(request.scope, settings) or "admin"
    store = feedback_store(request)
    key = served_key(retriever)
    store.add(key, query, body.image_id, body.relevant, who)
    return {
        "recorded": {"query": query, "image_id": body.image_id, "relevant": body.relevant},
        "counts": asdict(store.counts(key)),
    }


@router.get("", summary="What the labels of the served index hold, and what they support")
def feedback_counts(request: Request) -> dict[str, Any]:
    """The judgements given on the served image index (judgements; hits and queries they cover; hits
    relevant by majority), whether this request may label (``can_label``), and, when the served
    calibration was fitted on these labels (``calibration_labels`` "user"), what it supports per
    min_relevance."""
    retriever = retriever_of(request)
    calibration = retriever.images.calibration
    return {
        "index": retriever.images.directory.name,
        "counts": asdict(feedback_store(request).counts(served_key(retriever))),
        "can_label": admin_identity(request.scope, settings_of(request)) is not None,
        "calibration_labels": calibration.info.get("labels") if calibration is not None else None,
        "supports": supports(calibration),
    }


@router.get(
    "/labels",
    response_model=QueryLabels,
    summary="The labels already given to hits of one query",
    responses=error_responses(422, 503),
)
def query_labels(
    request: Request,
    query: Annotated[
        str,
        Query(
            description="The text query the hits were returned for, as searched (blank around it is "
            "stripped, as the search and POST /v1/feedback strip it).",
            examples=["a red circle left of a blue square"],
        ),
    ],
    image_id: Annotated[
        list[Annotated[int, Field(ge=0, le=SQLITE_INT_MAX)]],
        Query(
            default_factory=list,
            max_length=LABELS_IDS_MAX,
            description=f"Only these hits (repeat the parameter: image_id=3&image_id=17; at most "
            f"{LABELS_IDS_MAX}); absent: every judged hit of the query.",
        ),
    ],
) -> QueryLabels:
    """Each hit of ``query`` judged on the served image index, with its label (the majority's
    verdict; a tie counts as not relevant), how many judged it and how many said relevant, and
    ``mine``: the verdict given with this request's admin identity (null without admin rights). The
    search page marks the hits it shows with it. Read access, as GET /v1/feedback."""
    settings = settings_of(request)
    try:
        check_text(query)
    except ValueError as err:
        raise ApiError(422, "invalid_request", f"query: {err}") from None
    text = query_text(
        query,
        settings,
        "query",
        "send the text the hits were returned for",
        ", as for searches; send the query the hits were returned for",
    )
    retriever = retriever_of(request)
    who = admin_identity(request.scope, settings)
    found = feedback_store(request).query_labels(served_key(retriever), text, image_id or None, who)
    return QueryLabels(
        index=retriever.images.directory.name,
        query=text,
        labels=[LabelledHit(**asdict(label)) for label in found],
    )


@router.post(
    "/refit",
    summary="Fit the calibration on the labels of the served index and serve it",
    responses=error_responses(401, 403, 409, 503),
)
def refit(request: Request) -> dict[str, Any]:
    """Fits a Clopper-Pearson lower-bound relevance map on the served index's labels (each labelled
    hit takes the score this server gives it, to ICR_SEARCH_DEPTH), writes the index folder's
    calibration.json (atomically), and serves it; answers once it is served, with what the labels
    support. 409 with the reason when the labels cannot be fitted (none yet, none relevant, none
    among the hits the server returns) or another refit is running; the served calibration stays.
    Needs the admin key (ICR_ADMIN_KEY; unset: clients on this machine only)."""
    settings = settings_of(request)
    retriever = retriever_of(request)
    if not _refitting.acquire(blocking=False):
        raise ApiError(409, "refit_in_progress", "a refit is already running; retry when it has finished")
    try:
        started = time.perf_counter()
        key = served_key(retriever)
        labels = feedback_store(request).labels(key)
        name = retriever.images.directory.name
        if not labels:
            raise ApiError(
                409,
                "no_labels",
                f"no labels for the served index {name!r} yet: mark hits relevant or not relevant "
                "(POST /v1/feedback, or the search page's Label buttons), then refit",
            )
        live = folder_live(retriever.images, "be recalibrated from labels", "refit_refused")
        try:
            calibrate_from_labels(
                retriever.images.directory,
                labels,
                checkpoint=retriever.checkpoint,
                depth=settings.search_depth,
                device=retriever.device,
                progress=False,
                live=live,  # hits as served now: added images' labels count
            )
        except ValueError as err:  # what the labels cannot support, said with the fix
            raise ApiError(409, "refit_refused", without_paths(str(err), settings)) from None
        except Exception as err:  # the artifacts failed the fit: the served calibration stays
            log.exception("refit failed")
            reason = without_paths(f"{type(err).__name__}: {err}", settings)
            raise ApiError(
                409, "refit_failed", f"the fit failed ({reason}); the served calibration stays"
            ) from None
        fresh = reload_artifacts(request.app, settings, wait_s=_RELOAD_WAIT_S)
        calibration = fresh.images.calibration
        return {
            "status": "refitted",
            "seconds": round(time.perf_counter() - started, 3),
            "counts": asdict(feedback_store(request).counts(served_key(fresh))),
            "supports": supports(calibration),
            "calibration": calibration_summary(calibration),
        }
    finally:
        _refitting.release()
