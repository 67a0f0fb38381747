"""POST /v1/search/text (text -> images), /image (upload -> captions), /similar and /vector (-> images).

``/similar`` searches from a stored image's own vector, ``/vector`` from an embedding the client
computed; neither has text, so neither gets a calibrated relevance.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from icr.index.filters import parse_filter
from icr.service.config import Settings
from icr.service.errors import ApiError, validation_message
from icr.service.loaded_index import LoadedIndex, NotServable, public_source
from icr.service.quality import query_quality
from icr.service.retriever import Page, Retriever, unit_query
from icr.service.routes.deps import decode_slots_of, query_text, retriever_of, settings_of
from icr.service.routes.images import not_found
from icr.service.schemas import (
    BLANK,
    FILTER_DESCRIPTION,
    NO_RELEVANCE,
    ImageResults,
    ImageSearchResponse,
    ScoreFields,
    SimilarSearchRequest,
    TextSearchRequest,
    TextSearchResponse,
    ThresholdFields,
    Timings,
    VectorQuery,
    VectorSearchRequest,
    VectorSearchResponse,
    error_responses,
)
from icr.service.strict_json import StrictJSONRoute, parse_strict
from icr.service.uploads import decode_upload, read_upload

router = APIRouter(prefix="/v1/search", tags=["search"], route_class=StrictJSONRoute)


def _json(response: TextSearchResponse | ImageSearchResponse | VectorSearchResponse) -> Response:
    """``response`` as the JSON FastAPI would send for it, serialised here, once.

    The model was validated when it was built; returning a Response skips FastAPI's second
    validation of it against ``response_model`` and, for these sync routes, the second hop to the
    thread pool that validation takes (``response_model`` still documents the body). The bytes are
    the ones FastAPI's own path writes: pydantic's JSON dump of the model, by alias."""
    body = type(response).__pydantic_serializer__.to_json(response, by_alias=True)
    return Response(content=body, media_type="application/json")


def _check_paging(settings: Settings, k: int, offset: int) -> None:
    if k > settings.max_k:
        raise ApiError(
            422,
            "invalid_request",
            f"k: at most {settings.max_k} results per page (ICR_MAX_K); page with offset for more",
        )
    # One bound per field (the schema can state it): any k then fits within the search depth.
    deepest = settings.search_depth - settings.max_k
    if offset > deepest:
        raise ApiError(
            422,
            "invalid_request",
            f"offset: at most {deepest} (ICR_SEARCH_DEPTH {settings.search_depth} - ICR_MAX_K "
            f"{settings.max_k}): results beyond the search depth are never retrieved; raise the "
            "threshold to narrow the results instead of paging that deep",
        )


def _check_filter(target: LoadedIndex, filter_spec: Any) -> None:
    """422 for a filter ``target`` cannot run (an unknown field, a value of the wrong kind), answered
    before any search work."""
    try:
        parse_filter(filter_spec, target.manifest.metadata_fields, target.field_types)
    except ValueError as err:
        raise ApiError(422, "invalid_request", str(err)) from None


def _search(
    retriever: Retriever,
    target: LoadedIndex,
    query: np.ndarray,  # (1, D)
    fields: ScoreFields,
    settings: Settings,
    timings: dict[str, float],
    cross_modal: bool = True,
    text: str | None = None,
    filter_spec: Any = None,
    exclude: int | None = None,
) -> Page:
    """``cross_modal=False`` (image -> similar images, vector queries): relevance is left out and
    only min_score thresholds, as the calibration is of caption-image scores. ``text``: the query's
    words (text queries), which the per-query calibration reads. ``filter_spec``: the request's
    filter (JSON), checked against ``target``'s fields and their kinds. ``exclude``: an id left out."""
    try:
        filter_ = parse_filter(filter_spec, target.manifest.metadata_fields, target.field_types)
    except ValueError as err:
        raise ApiError(422, "invalid_request", str(err)) from None
    min_relevance = fields.min_relevance if isinstance(fields, ThresholdFields) and cross_modal else None
    try:
        return retriever.search(
            target,
            query,
            k=fields.k,
            offset=fields.offset,
            depth=settings.search_depth,
            min_score=fields.min_score,
            min_relevance=min_relevance,
            calibrated=cross_modal,
            text=text,
            filter_=filter_,
            exclude=exclude,
            timings=timings,
        )
    except NotServable as err:  # min_relevance without a calibration
        raise ApiError(409, "no_calibration", str(err)) from None


def _image_hits(retriever: Retriever, page: Page) -> list[dict[str, Any]]:
    """The page's hits as ImageHit fields: plain dicts, validated with the response that holds
    them (one pydantic call for the whole body, not one model per hit)."""
    hits = []
    pixels = retriever.gallery.has_pixels
    root = retriever.images.source_root
    relevance = page.relevance.tolist() if page.relevance is not None else None
    rows = zip(page.ids.tolist(), page.scores.tolist(), page.rows, strict=False)
    for i, (image_id, score, row) in enumerate(rows):
        metadata = {key: row[key] for key in ("captions", "image_id", "scene")}
        if row.get("fields"):
            metadata["fields"] = row["fields"]
        metadata["source"] = public_source(row["source"], root)
        hits.append(
            {
                "id": image_id,
                "rank": page.offset + i + 1,
                "score": score,
                "relevance": None if relevance is None else relevance[i],
                "is_distractor": row["is_distractor"],
                "image_url": f"/v1/images/{image_id}" if pixels(row) else None,
                "metadata": metadata,
            }
        )
    return hits


def _caption_hits(page: Page, root: str | None) -> list[dict[str, Any]]:
    """The page's hits as CaptionHit fields (plain dicts, as :func:`_image_hits`)."""
    relevance = page.relevance.tolist() if page.relevance is not None else None
    return [
        {
            "id": caption_id,
            "rank": page.offset + i + 1,
            "score": score,
            "relevance": None if relevance is None else relevance[i],
            "caption": (row["captions"] or [""])[0],
            "image_id": row["image_id"],
            "source": public_source(row["source"], root),
        }
        for i, (caption_id, score, row) in enumerate(
            zip(page.ids.tolist(), page.scores.tolist(), page.rows, strict=False)
        )
    ]


def _page_info(page: Page) -> dict[str, Any]:
    return {
        "threshold": page.threshold,
        "passed": page.passed,
        "passed_is_exact": page.passed_is_exact,
        "searched": page.searched,
        "k": page.k,
        "offset": page.offset,
        "matched": page.matched,
    }


def _assessment(target: LoadedIndex, page: Page | None, text: str | None, benchmark: bool) -> dict[str, Any]:
    """calibration, expected_precision, expected_relevant and quality of a text query (``text``) or
    an image query (``text=None``); ``page=None``: nothing was searched with a calibration."""
    calibration = target.calibration if page is not None and page.calibration is not None else None
    quality = query_quality(
        text,
        benchmark=benchmark,
        kinds=calibration.kinds if calibration is not None else {},
        top_relevance=page.top_relevance if page is not None else None,
        top_count=page.top_count if page is not None else 0,
        labels_note=calibration.labels_note if calibration is not None else None,
        evidence=page.evidence if page is not None else None,
        dated=target.calibration is not None and target.calibration.evidence is None and text is not None,
        due=target.calibration_due() if calibration is not None else None,
    )
    if page is not None:
        quality["warnings"] = [*quality["warnings"], *_partial(page)]
    return {
        "calibration": page.calibration if page is not None else None,
        "expected_precision": page.expected_precision if page is not None else None,
        "expected_relevant": page.expected_relevant if page is not None else None,
        "quality": quality,
    }


def _partial(page: Page) -> list[str]:
    """The warning of an answer that leaves out shards which did not answer (none otherwise)."""
    if not page.unanswered:
        return []
    return [
        f"partial results: index shard{'s' if len(page.unanswered) > 1 else ''} "
        f"{', '.join(page.unanswered)} did not answer, so their images are missing and passed counts "
        "only the shards that answered (passed_is_exact is false); retry shortly"
    ]


def _timings(timings: dict[str, float], start: float) -> Timings:
    return Timings(
        encode_ms=timings.get("encode_ms", 0.0),
        search_ms=timings.get("search_ms", 0.0),
        select_ms=timings.get("select_ms", 0.0),
        filter_ms=timings.get("filter_ms", 0.0),
        metadata_ms=timings.get("metadata_ms", 0.0),
        total_ms=(time.perf_counter() - start) * 1000,
    )


@router.post(
    "/text",
    response_model=TextSearchResponse,
    summary="Text -> images, thresholded, paginated",
    responses=error_responses(408, 413, 422, 503),
)
async def search_text(body: TextSearchRequest, request: Request) -> Response:
    """Images for a caption. With ``min_relevance`` (calibrated probability) or ``min_score`` (cosine),
    only hits meeting it are counted and paginated; the response says how many passed.

    With a calibration, the response also says which map produced ``relevance`` (``calibration``),
    the share of this page expected to be relevant (``expected_precision``) and the expected number
    of relevant results among all that passed (``expected_relevant``); ``quality`` gives the query's
    kind on the embedded benchmark and plain-sentence warnings to show the user (a kind the model
    handles poorly, words outside the benchmark's vocabulary, few likely relevant results)."""
    start = time.perf_counter()
    settings = settings_of(request)
    text = query_text(body.text, settings, "text", "send the caption to search for", "; shorten the query")
    _check_paging(settings, body.k, body.offset)
    retriever = retriever_of(request)
    # The checks above are answered on the event loop (microseconds, no thread hop: a client looping
    # refused requests costs others little); the search itself runs in the thread pool.
    return await run_in_threadpool(_text_results, retriever, body, text, settings, request, start)


def _text_results(
    retriever: Retriever,
    body: TextSearchRequest,
    text: str,
    settings: Settings,
    request: Request,
    start: float,
) -> Response:
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    query = retriever.encode_text(text)  # (1, D)
    timings["encode_ms"] = (time.perf_counter() - t0) * 1000
    page = _search(
        retriever, retriever.images, query, body, settings, timings, text=text, filter_spec=body.filter
    )
    response = TextSearchResponse.model_validate(
        {
            "query": text,
            "hits": _image_hits(retriever, page),
            "timings": _timings(timings, start),
            **_page_info(page),
            **_assessment(retriever.images, page, text, retriever.benchmark),
        }
    )
    request.app.state.telemetry.observe_stages("text", response.timings.model_dump())
    return _json(response)


@router.post(
    "/image",
    response_model=ImageSearchResponse,
    summary="Uploaded image -> captions (and optionally similar images)",
    responses=error_responses(408, 409, 413, 415, 422, 503, decodes=True),
)
def search_image(
    request: Request,
    file: Annotated[UploadFile, File(description="JPEG, PNG, WebP... image")],
    k: Annotated[int, Form()] = 10,
    offset: Annotated[int, Form()] = 0,
    min_score: Annotated[float | None, Form()] = None,
    min_relevance: Annotated[float | None, Form()] = None,
    include_images: Annotated[bool, Form(description="Also return similar gallery images.")] = False,
    filter: Annotated[  # noqa: A002 - the API's own name for it, as in text search
        str | None,
        Form(
            description="Only with include_images=true: a JSON object selecting the similar gallery "
            "images searched, as text search's filter. " + FILTER_DESCRIPTION
        ),
    ] = None,
) -> Response:
    """Captions for an uploaded image, thresholded and paginated like text search (and, with
    ``include_images``, similar gallery images, which carry no relevance; ``filter`` selects which).

    With a calibration, ``calibration`` (always ``global`` here: the per-query map is fitted on text
    queries), ``expected_precision``, ``expected_relevant`` and ``quality.warnings`` describe the
    caption hits as for text search; ``quality.kind`` is null (an image has no query kind)."""
    start = time.perf_counter()
    settings = settings_of(request)
    try:
        fields = ThresholdFields(k=k, offset=offset, min_score=min_score, min_relevance=min_relevance)
    except ValidationError as err:
        raise ApiError(422, "invalid_request", validation_message(err.errors())) from None
    _check_paging(settings, fields.k, fields.offset)
    filter_spec = _form_filter(filter)
    if filter_spec is not None and not include_images:
        raise ApiError(
            422,
            "invalid_request",
            "filter: selects gallery images by their metadata, which image search returns with "
            "include_images=true (captions carry no gallery metadata); send include_images=true",
        )
    retriever = retriever_of(request)
    _check_filter(retriever.images, filter_spec)  # before the upload is decoded
    if not retriever.accepts_images:
        raise ApiError(
            409,
            "no_image_encoder",
            "this checkpoint's image tower reads precomputed region "
            "features, not pixels; serve a checkpoint trained on images to search by image",
        )
    if retriever.captions is None and not include_images:
        raise ApiError(
            409,
            "no_caption_index",
            "no caption index is loaded: build one with `icr index build "
            "--modality text ...` and restart with --caption-index DIR, or ask include_images=true",
        )
    timings: dict[str, float] = {}
    with decode_slots_of(request).slot():  # the decoded image and its resizing: bounded memory
        image = decode_upload(*read_upload(file, settings), settings)
        t0 = time.perf_counter()
        query = retriever.encode_image(image)  # (1, D)
        timings["encode_ms"] = (time.perf_counter() - t0) * 1000
        del image  # freed before the slot is
    similar = None
    if include_images:
        page = _search(
            retriever,
            retriever.images,
            query,
            fields,
            settings,
            timings,
            cross_modal=False,
            filter_spec=filter_spec,
        )
        similar = ImageResults.model_validate({"hits": _image_hits(retriever, page), **_page_info(page)})
    if retriever.captions is not None:
        page = _search(retriever, retriever.captions, query, fields, settings, timings)
        info, hits = _page_info(page), _caption_hits(page, retriever.captions.source_root)
        assessment = _assessment(retriever.captions, page, None, retriever.benchmark)
    else:  # no caption index: the route refused unless include_images, so similar is set
        assert similar is not None
        info, hits = similar.model_dump(exclude={"hits"}), []
        assessment = _assessment(retriever.images, None, None, retriever.benchmark)
    response = ImageSearchResponse.model_validate(
        {"hits": hits, "similar_images": similar, "timings": _timings(timings, start), **info, **assessment}
    )
    request.app.state.telemetry.observe_stages("image", response.timings.model_dump())
    return _json(response)


def _form_filter(value: str | None) -> Any:
    """The image search's ``filter`` form field as JSON (None when absent or blank: a form cannot
    send null), read as strictly as a JSON body; 422 naming the field otherwise."""
    if value is None or not value.strip(BLANK):
        return None
    try:
        return parse_strict(value.encode("utf-8", "surrogatepass"))
    except ValueError as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors too
        raise ApiError(
            422,
            "invalid_request",
            f'filter: not a JSON object ({err}); send e.g. {{"album": "holidays"}} as the form field',
        ) from None


def _vector_page_response(
    retriever: Retriever,
    page: Page,
    query: VectorQuery,
    timings: dict[str, float],
    start: float,
) -> VectorSearchResponse:
    """The response of a search by vector or stored image: no relevance (no text to calibrate), said
    in ``quality.warnings`` where the index has a calibration a text query would get."""
    warnings = []
    if retriever.images.calibration is not None:
        warnings.append(f"{NO_RELEVANCE}: relevance is null and only min_score thresholds")
    if query.approximate:
        warnings.append(
            f"the index stores compressed vectors ({retriever.images.manifest.factory}): image "
            f"{query.image_id}'s vector is read back approximately, so its neighbours are approximate too"
        )
    warnings += _partial(page)
    return VectorSearchResponse.model_validate(
        {
            "query": query,
            "hits": _image_hits(retriever, page),
            "timings": _timings(timings, start),
            **_page_info(page),
            "calibration": None,
            "expected_precision": None,
            "expected_relevant": None,
            "quality": {"warnings": warnings},
        }
    )


@router.post(
    "/similar",
    response_model=VectorSearchResponse,
    summary="A stored image -> the nearest images, thresholded, paginated",
    responses=error_responses(404, 408, 409, 413, 422, 503),
)
async def search_similar(body: SimilarSearchRequest, request: Request) -> Response:
    """Images nearest to a stored image's own vector (not including the image itself unless
    ``include_self``), thresholded by ``min_score`` and paginated like text search; ``filter``
    selects which images are searched. No calibrated relevance: there is no text to calibrate. 404
    for an id outside the index; 409 when the index cannot give its stored vectors back (a GPU
    inverted file), with what to do instead."""
    start = time.perf_counter()
    settings = settings_of(request)
    _check_paging(settings, body.k, body.offset)
    retriever = retriever_of(request)
    return await run_in_threadpool(_similar_results, retriever, body, settings, request, start)


def _similar_results(
    retriever: Retriever, body: SimilarSearchRequest, settings: Settings, request: Request, start: float
) -> Response:
    images = retriever.images
    # in the thread pool: over shards, whether the image is live is asked of the shard holding it
    if not images.live.state.is_live(body.image_id):
        raise ApiError(404, "not_found", f"image_id: {not_found(retriever, body.image_id).message}")
    if images.vectors is None and body.image_id < images.manifest.ntotal:  # an added image's is kept
        raise ApiError(409, "no_stored_vectors", images.why_no_vectors())
    _check_filter(images, body.filter)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        query = retriever.stored_vector(retriever.images, body.image_id)  # (1, D)
    except NotServable as err:  # checked above already; kept for a reload in between
        raise ApiError(409, "no_stored_vectors", str(err)) from None
    timings["encode_ms"] = (time.perf_counter() - t0) * 1000
    page = _search(
        retriever,
        retriever.images,
        query,
        body,
        settings,
        timings,
        cross_modal=False,
        filter_spec=body.filter,
        exclude=None if body.include_self else body.image_id,
    )
    about = VectorQuery(
        kind="image",
        image_id=body.image_id,
        include_self=body.include_self,
        approximate=retriever.images.approximate_vectors,
    )
    response = _vector_page_response(retriever, page, about, timings, start)
    request.app.state.telemetry.observe_stages("similar", response.timings.model_dump())
    return _json(response)


@router.post(
    "/vector",
    response_model=VectorSearchResponse,
    summary="An embedding -> the nearest images, thresholded, paginated",
    responses=error_responses(408, 413, 422, 503),
)
async def search_vector(body: VectorSearchRequest, request: Request) -> Response:
    """Images nearest to an embedding the client computed with the served checkpoint: ``vector``
    must have the index's dim (GET /v1/info: index.dim, the checkpoint's embed_dim), finite values
    and a norm above 0; it is normalised to unit length, as the index's vectors are. Thresholded by
    ``min_score`` and paginated like text search; ``filter`` selects which images are searched. No
    calibrated relevance: there is no text to calibrate."""
    start = time.perf_counter()
    settings = settings_of(request)
    _check_paging(settings, body.k, body.offset)
    retriever = retriever_of(request)
    t0 = time.perf_counter()
    try:
        query = unit_query(body.vector, retriever.images.manifest.dim)  # (1, D)
    except ValueError as err:
        raise ApiError(422, "invalid_request", str(err)) from None
    timings = {"encode_ms": (time.perf_counter() - t0) * 1000}
    _check_filter(retriever.images, body.filter)
    return await run_in_threadpool(_vector_results, retriever, body, query, timings, settings, request, start)


def _vector_results(
    retriever: Retriever,
    body: VectorSearchRequest,
    query: np.ndarray,
    timings: dict[str, float],
    settings: Settings,
    request: Request,
    start: float,
) -> Response:
    images = retriever.images
    page = _search(
        retriever, images, query, body, settings, timings, cross_modal=False, filter_spec=body.filter
    )
    response = _vector_page_response(retriever, page, VectorQuery(kind="vector"), timings, start)
    request.app.state.telemetry.observe_stages("vector", response.timings.model_dump())
    return _json(response)
