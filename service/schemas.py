"""Request and response bodies of the HTTP API (v1). Field descriptions end up in /openapi.json."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from icr.service.config import DATASET_NAMES

# Hard bounds of the schema; the server's settings may set tighter ones (checked in the handlers,
# so the message can name the setting).
K_MAX = 1000
OFFSET_MAX = 100_000
# Values of a query vector: the served index's dim, checked in the handler (the schema states it
# once the index is loaded); this bound only keeps a body of numbers from being parsed at length.
VECTOR_MAX = 16_384


# Whitespace controls a pasted caption may carry; every other control character (Unicode category
# Cc: U+0000-U+001F and U+007F-U+009F) and every lone surrogate is refused. One compiled class, so
# the check is a single linear scan in C, not a Python loop per character.
_REFUSED_CHARACTER = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
# What counts as blank: Python's whitespace and U+FEFF, which is JSON Schema's (ECMA-262) \s too,
# so a text the schema's pattern calls blank is blank here.
BLANK = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
    "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
)


def check_text(value: str) -> str:
    """``value`` when it is text the encoder and a JSON response can carry; ValueError saying
    what to send instead (the message names the character by code point, never repeats it)."""
    found = _REFUSED_CHARACTER.search(value)
    if found is None:
        return value
    i, code = found.start(), ord(found.group())
    if 0xD800 <= code <= 0xDFFF:
        raise ValueError(
            f"character {i} is a lone surrogate (U+{code:04X}), not Unicode text; send UTF-8 text "
            "(a JSON \\u escape of a character beyond U+FFFF must be a high + low surrogate pair)"
        )
    raise ValueError(f"character {i} is the control character U+{code:04X}; remove it")


# What check_text accepts, for the OpenAPI schema only (pydantic's regex engine has no surrogates).
# (Lone surrogates are refused too, but JSON Schema cannot name them.)
_REFUSED = "\\x00-\\x08\\x0b\\x0c\\x0e-\\x1f\\x7f-\\x9f"
TEXT_PATTERN = f"^[^{_REFUSED}]*$"
NONBLANK_TEXT_PATTERN = f"^[^{_REFUSED}]*[^\\s{_REFUSED}][^{_REFUSED}]*$"  # and not only whitespace
Text = Annotated[str, AfterValidator(check_text), WithJsonSchema({"type": "string", "pattern": TEXT_PATTERN})]


def _json_integer(value: Any) -> Any:
    """A JSON integer, also written 5.0 or 5e0 (JSON Schema's "integer"); never "5" or true."""
    if isinstance(value, bool | str):
        raise ValueError("Input should be a valid integer (a JSON number, not a string or boolean)")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_json_integer)]


class Threshold(BaseModel):
    """The threshold a search applied, before pagination."""

    kind: Literal["none", "min_score", "min_relevance"]
    value: float | None = Field(None, description="The value asked for (cosine, or probability in [0, 1]).")
    score: float | None = Field(
        None,
        description="The raw cosine score this threshold corresponds to. min_score: the value. "
        "min_relevance: the lowest retrieved score whose relevance reaches the value (null when no "
        "retrieved hit reaches it); with the per-query calibration map this is this query's equivalent "
        "and another query's may differ.",
    )


class ScoreFields(BaseModel):
    """Paging and the raw-score threshold: what every search takes."""

    # a misspelt field (min_relevence) is refused, not ignored: ignored, it searched without a threshold
    model_config = ConfigDict(extra="forbid")

    # Strict: "10" and true are not numbers (a JSON client that sends them has a bug to hear about).
    k: JsonInt = Field(10, ge=1, le=K_MAX, description="Results per page (at most ICR_MAX_K).")
    offset: JsonInt = Field(
        0,
        ge=0,
        le=OFFSET_MAX,
        description="Results to skip (after thresholding); offset + k at most ICR_SEARCH_DEPTH.",
    )
    # allow_inf_nan=False: nan is told "a finite number", not a bound it cannot compare with
    min_score: StrictFloat | None = Field(
        None, ge=-1.0, le=1.0, allow_inf_nan=False, description="Keep hits with cosine >= this."
    )


class ThresholdFields(ScoreFields):
    min_relevance: StrictFloat | None = Field(
        None,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="Keep hits whose calibrated probability of relevance is >= this.",
    )

    @model_validator(mode="after")
    def _one_threshold(self) -> ThresholdFields:
        if self.min_score is not None and self.min_relevance is not None:
            raise ValueError("give either min_score or min_relevance, not both")
        return self


FILTER_DESCRIPTION = (
    "Only items whose metadata match are searched (before thresholds and pagination). A JSON object, every "
    'entry must hold: {"album": "holidays"} equality, {"camera": {"in": ["x100", "gr3"]}} one of, '
    '{"year": {"gte": 2019, "lt": 2023}} numeric range (gt, gte, lt, lte), {"is_distractor": false}. '
    "Field names are the index's metadata fields (GET /v1/info: index.metadata_fields), and values must "
    "be of the kinds each holds (index.metadata_field_types; integers and other numbers compare): "
    '{"year": "2024"} on a field of integers is refused, not an empty result.'
)


class TextSearchRequest(ThresholdFields):
    text: Text = Field(
        ...,
        description="The query caption: Unicode text without control characters other than tab and newline.",
        examples=["a red circle left of a blue square"],
    )
    filter: dict[str, Any] | None = Field(
        None, description=FILTER_DESCRIPTION, examples=[{"is_distractor": False}]
    )


NO_RELEVANCE = (
    "no calibrated relevance for a search by vector or by stored image: the calibration maps the "
    "scores of text queries to a probability of relevance, and this query has no text"
)


class _UncalibratedSearch(ScoreFields):
    """A search whose query is a vector, not a caption: raw-score threshold only."""

    filter: dict[str, Any] | None = Field(
        None, description=FILTER_DESCRIPTION, examples=[{"is_distractor": False}]
    )

    # Not part of the schema: declared only so that sending it is refused with the reason, rather
    # than as an unknown field ("did you mean min_score?"). null means no threshold, as elsewhere.
    min_relevance: SkipJsonSchema[Any] = None

    @field_validator("min_relevance")
    @classmethod
    def _no_relevance(cls, value: Any) -> None:
        if value is not None:
            raise ValueError(f"{NO_RELEVANCE}; threshold by min_score (cosine) instead")


class SimilarSearchRequest(_UncalibratedSearch):
    image_id: JsonInt = Field(
        ...,
        ge=0,
        description="A stored image's id (a hit's id; ids run from 0 to index.ntotal - 1 of GET /v1/info). "
        "Its own stored vector is the query.",
        examples=[17],
    )
    include_self: StrictBool = Field(
        False, description="Also return the image itself (normally its own nearest neighbour)."
    )


class FeedbackRequest(BaseModel):
    """One judgement of a served hit: was image ``image_id`` relevant to the text query ``query``?"""

    model_config = ConfigDict(extra="forbid")

    query: Text = Field(
        ...,
        description="The text query the hit was returned for, as searched (POST /v1/search/text's text; "
        "blank around it is stripped, as the search strips it).",
        examples=["a red circle left of a blue square"],
    )
    image_id: JsonInt = Field(
        ...,
        ge=0,
        description="The hit's id (ids run from 0 to index.ntotal - 1 of GET /v1/info).",
        examples=[17],
    )
    relevant: StrictBool = Field(..., description="true: the image matches the query; false: it does not.")


# Image ids one GET /v1/feedback/labels may name (a page of hits is at most ICR_MAX_K; the request
# line stays well within the server's 16 KiB bound on it)
LABELS_IDS_MAX = 100
SQLITE_INT_MAX = 2**63 - 1  # the largest id the labels file can hold


class LabelledHit(BaseModel):
    """The labels given to one hit of the query."""

    image_id: int
    relevant: bool = Field(
        ...,
        description="The label: the verdict of the majority of its judges (a tie counts as not relevant).",
    )
    judgements: int = Field(..., ge=1, description="How many people judged this hit for this query.")
    relevant_judgements: int = Field(..., ge=0, description="How many of them judged it relevant.")
    mine: bool | None = Field(
        None,
        description="Your own verdict: the one given with this request's admin identity (the admin key, or "
        "with no ICR_ADMIN_KEY this machine's address); null when you have not judged the hit or this "
        "request has no admin rights.",
    )


class QueryLabels(BaseModel):
    """The labels already given on the served image index to hits of one query."""

    index: str = Field(..., description="The served image index's folder name.")
    query: str = Field(..., description="The query as the labels store it (blank around it stripped).")
    labels: list[LabelledHit] = Field(
        ..., description="Each judged hit of the query (among image_id, when sent), by image id."
    )


class VectorSearchRequest(_UncalibratedSearch):
    vector: list[StrictFloat] = Field(
        ...,
        min_length=1,
        max_length=VECTOR_MAX,
        description="An embedding computed with the served checkpoint (e.g. icr.load(...)'s embed): "
        "index.dim finite numbers, not all 0. It is normalised to unit length before the search, as the "
        "index's vectors are.",
    )


class Timings(BaseModel):
    """Milliseconds per stage of this request."""

    encode_ms: float
    search_ms: float
    select_ms: float = Field(
        0.0, description="Part of search_ms: finding the ids a filter selects (0 when cached or no filter)."
    )
    filter_ms: float
    metadata_ms: float
    total_ms: float


class ImageHit(BaseModel):
    id: int
    rank: int = Field(..., description="1-based rank among the hits that passed the threshold.")
    score: float = Field(..., description="Cosine similarity.")
    relevance: float | None = Field(
        None, description="Calibrated probability of relevance (null: no calibration)."
    )
    is_distractor: bool
    image_url: str | None = Field(None, description="Where GET /v1/images/{id} serves it (null: no pixels).")
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="source, captions, image_id, scene, and fields (the index's own metadata).",
    )


class CaptionHit(BaseModel):
    id: int
    rank: int
    score: float
    relevance: float | None = None
    caption: str
    image_id: int | None = Field(None, description="The split image this caption was written for.")
    source: str | None = None


class PageInfo(BaseModel):
    threshold: Threshold
    passed: int = Field(..., description="Hits that passed the threshold among the `searched` nearest.")
    passed_is_exact: bool = Field(
        ..., description="False when every searched candidate passed: more beyond the search depth may pass."
    )
    searched: int = Field(..., description="Nearest neighbours retrieved before thresholding.")
    k: int
    offset: int
    matched: int | None = Field(
        None,
        description="Items of the index the query's filter selects (null: no filter); only they are "
        "searched.",
    )


class QueryEvidence(BaseModel):
    """What the calibration has seen of a text query: outside its evidence no relevance is given."""

    inside: bool = Field(
        ...,
        description="True: the calibration has evidence for queries like this one, and relevance is "
        "given. False: relevance is null for every hit and min_relevance passes nothing.",
    )
    p_value: float = Field(
        ...,
        description="Conformal novelty p-value: the share of the calibration's own queries at least as "
        "novel as this one (1: every word and word pair seen). Below the calibration's alpha: outside.",
    )
    novelty: float = Field(
        ..., description="Share of the query's words and word pairs no calibration query has."
    )
    unseen: list[str] = Field(default_factory=list, description="Some of those words and word pairs.")
    unknown_words: list[str] = Field(
        default_factory=list, description="Words the model's tokenizer cannot read (always outside)."
    )
    reason: str | None = Field(None, description="Why no relevance is given, in plain words (null: inside).")


class Quality(BaseModel):
    """What a user should know about this query's results, in plain sentences."""

    kind: str | None = Field(
        None,
        description="The query's kind on the embedded benchmark (count, relation, position, background, "
        "several_objects, one_object); null for other datasets, image queries and queries outside its "
        "grammar.",
    )
    kind_p_at_10: float | None = Field(
        None,
        description="The model's P@10 on held-out captions of this kind (calibration.json's kinds table).",
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="Plain sentences to show the user: a kind the model handles poorly, a query outside "
        "the embedded benchmark's vocabulary, few likely relevant results in the top 10, a known bias "
        "of the calibration's labels.",
    )
    evidence: QueryEvidence | None = Field(
        None,
        description="Text queries over a calibrated index: whether the calibration has evidence for "
        "this query (null: image queries, no calibration, or a calibration fitted before the check).",
    )


class Assessment(BaseModel):
    """How much of the result is likely relevant, by the calibration, and why not to trust it."""

    calibration: Literal["per_query", "global"] | None = Field(
        None,
        description="The map that produced `relevance`: per_query (score and the query's own results and "
        "embedding; text queries), global (one score -> probability map: image queries, format-1 files), "
        "null without calibration.",
    )
    expected_precision: float | None = Field(
        None,
        description="Mean relevance of the hits on this page: the share of them expected to be relevant "
        "(null without calibration or without hits).",
    )
    expected_relevant: float | None = Field(
        None,
        description="Sum of relevance over every hit that passed the threshold (all pages): the expected "
        "number of relevant results among `passed` (null without calibration).",
    )
    quality: Quality = Field(default_factory=Quality)


class TextSearchResponse(Assessment, PageInfo):
    query: str
    hits: list[ImageHit]
    timings: Timings


class VectorQuery(BaseModel):
    """What a search by vector or by stored image searched with."""

    kind: Literal["vector", "image"] = Field(
        ..., description="vector: the request's vector; image: a stored image's vector."
    )
    image_id: int | None = Field(None, description="The stored image searched from (kind image).")
    include_self: bool = Field(False, description="Whether that image may be among the hits.")
    approximate: bool = Field(
        False,
        description="True when the index stores compressed codes (PQ, SQ): the stored image's vector is "
        "read back approximately, and so are its neighbours.",
    )


class VectorSearchResponse(Assessment, PageInfo):
    """Images near a vector. ``relevance`` is null for every hit and ``calibration`` is null: there is
    no text for the calibration to read (``quality.warnings`` says so where the index has one)."""

    query: VectorQuery
    hits: list[ImageHit]
    timings: Timings


class ImageMetadata(BaseModel):
    """What the index stores about one image, without the server's paths."""

    id: int
    source: str = Field(
        ...,
        description="The image file relative to the gallery folder the index was built from, "
        "distractor:{k} for a generated distractor, or features.npy#row for precomputed features.",
    )
    file_name: str | None = Field(None, description="The file's name (null: not a file).")
    fields: dict[str, Any] = Field(
        default_factory=dict, description="The index's own metadata fields for this image (filterable)."
    )
    captions: list[str] = Field(default_factory=list)
    is_distractor: bool
    image_id: int | None = Field(None, description="The dataset split image it is (null: a distractor).")
    scene: dict[str, Any] | None = Field(None, description="The embedded benchmark's scene (null elsewhere).")
    image_url: str | None = Field(None, description="Where GET /v1/images/{id} serves it (null: no pixels).")


class ImageResults(PageInfo):
    hits: list[ImageHit]


class ImageSearchResponse(Assessment, PageInfo):
    hits: list[CaptionHit]
    similar_images: ImageResults | None = Field(
        None,
        description="Only with include_images=true. Image-image scores carry no calibrated relevance: "
        "only min_score thresholds them (with min_relevance their threshold is 'none').",
    )
    timings: Timings


def check_dataset_name(value: str) -> str:
    """``value`` when it is a name a server can configure (ICR_DATASETS accepts no other, see
    service.config); whether this server has configured it is the handler's question (404)."""
    if value not in DATASET_NAMES:
        raise ValueError(
            f"must be one of {', '.join(DATASET_NAMES)} (the ones this server has: GET /v1/info)"
        )
    return value


# An enum in the schema, so a client (and a fuzzer) can only name a dataset a server may have.
DatasetName = Annotated[
    str, AfterValidator(check_dataset_name), WithJsonSchema({"type": "string", "enum": list(DATASET_NAMES)})
]


class BenchmarkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: DatasetName = Field(
        ...,
        description="One of the names a server may configure; GET /v1/info lists the ones this server "
        "has. Another of them: 404, whose message says how the operator adds it.",
    )
    split: Text = "test"
    protocol: Literal["full", "1k", "5k"] = "full"
    distractors: JsonInt = Field(0, ge=0, description="Embedded benchmark only: generated distractor images.")


class BenchmarkJob(BaseModel):
    id: str
    status: Literal["queued", "running", "succeeded", "failed", "interrupted", "cancelled"]
    dataset: str
    split: str
    protocol: str
    distractors: int
    progress: float = Field(..., ge=0.0, le=1.0)
    stage: str | None = None
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    error: str | None = None
    metrics: dict[str, Any] | None = Field(None, description="Headline metrics (succeeded jobs).")
    report: dict[str, Any] | None = Field(None, description="The full evaluation report (GET by id only).")


class BenchmarkList(BaseModel):
    jobs: list[BenchmarkJob]


class ErrorBody(BaseModel):
    error: str = Field(..., description="A short machine-readable code.")
    message: str = Field(..., description="What went wrong and how to fix it.")
    detail: Any = None


_ERROR_MEANINGS = {
    401: "An API key is required (X-API-Key).",
    403: "Wrong API key, or a client not allowed without one.",
    404: "No such resource (the message names it).",
    408: "The request body did not arrive within ICR_BODY_TIMEOUT_SECONDS of its headers.",
    409: "The loaded artifacts or the resource's state do not allow this.",
    413: "Body, upload or image too large (the message names the limit).",
    415: "Not an image in an accepted format.",
    422: "Invalid field (the message names it and the fix).",
    429: "Too many queued jobs; retry after Retry-After seconds.",
    503: "The model and index are loading, or failed to load (the message says why).",
}


_DECODING_BUSY = (
    " Or ICR_MAX_CONCURRENT_DECODES images were being decoded and none finished within "
    "ICR_DECODE_WAIT_SECONDS: retry after Retry-After seconds."
)


def error_responses(*codes: int, decodes: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error statuses a route returns, all with the ErrorBody shape;
    ``decodes``: the route decodes images, so its 503 may also mean every decode slot is busy."""
    out: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorBody, "description": _ERROR_MEANINGS[code]} for code in codes
    }
    if decodes and 503 in out:
        out[503]["description"] += _DECODING_BUSY
        out[503]["headers"] = {
            "Retry-After": {"description": "Seconds to wait (busy decoding).", "schema": {"type": "integer"}}
        }
    return out


# --- writes to a living index (POST / PATCH / DELETE /v1/images) -----------------------------------
WRITE_BATCH_MAX = 1000  # images in one POST /v1/images (one transaction)
EXTERNAL_ID_MAX = 256
FieldValue = str | int | float | bool | list[Any] | dict[str, Any] | None


class ImageToAdd(BaseModel):
    """One image to add by its embedding, with what the index stores about it."""

    model_config = ConfigDict(extra="forbid")

    vector: list[StrictFloat] = Field(
        ...,
        min_length=1,
        max_length=VECTOR_MAX,
        description="Its embedding by the served checkpoint (icr.load(...).encode_images): index.dim finite "
        "numbers, not all 0; normalised to unit length as the index's vectors are.",
    )
    external_id: Text | None = Field(
        None,
        min_length=1,
        max_length=EXTERNAL_ID_MAX,
        description="Your own name for it. Adding an image under an external_id that names a live image "
        "replaces that image (deleted, and this one added with a new id, in one transaction), so a "
        "retried request does not add it twice.",
    )
    source: Text | None = Field(
        None,
        max_length=2048,
        description="What the image is, in your words (a path or URL of yours), shown with its hits; the "
        "server never opens it, so it serves no pixels for an image added by embedding.",
    )
    fields: dict[str, FieldValue] | None = Field(
        None,
        description="Its metadata fields: the index's own (GET /v1/info index.metadata_fields), each with a "
        "value of the kind the field holds, so that filters select it.",
    )
    captions: list[Text] = Field(default_factory=list, max_length=100)


class AddImagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    images: list[ImageToAdd] = Field(..., min_length=1, max_length=WRITE_BATCH_MAX)


class WrittenImage(BaseModel):
    id: int = Field(..., description="Its id from now on (searches return it; never reused).")
    external_id: str | None = None
    replaced: int | None = Field(
        None, description="The id of the image its external_id named before, deleted."
    )


class WriteResult(BaseModel):
    """What a write did, acknowledged once it is on disk; searches on this server already see it,
    other servers on the same state directory within ICR_WRITES_POLL_SECONDS."""

    written: list[WrittenImage] = Field(default_factory=list)
    deleted: list[int] = Field(default_factory=list)
    seq: int = Field(..., description="The write log's position after it (the server's state, GET /v1/info).")
    images: int = Field(..., description="Live images in the index after it.")


class SnapshotRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="The snapshot's folder name under STATE_DIR/snapshots (default: the index folder's "
        "name, the write log's position and the time).",
        examples=["photos-before-cleanup"],
    )


class SnapshotResult(BaseModel):
    """A snapshot written: one folder that ``icr serve --index STATE_DIR/<folder>`` starts from."""

    folder: str = Field(..., description="Where it is, relative to the server's state directory.")
    seq: int = Field(..., description="The write log's position it holds every write up to.")
    images: int = Field(..., description="Live images in it.")
    writes: int = Field(..., description="Write-log rows it carries.")
    uploads: int = Field(..., description="Uploaded images it carries.")
    files_linked: int = Field(..., description="Files of the build hard-linked (no bytes copied).")
    files_copied: int = Field(..., description="Files of the build copied (another file system).")
    seconds: float


class CompactResult(BaseModel):
    """A compaction done and served: the index folder now holds the live images as of ``seq``."""

    seq: int = Field(..., description="The write log's position the new folder includes.")
    images: int = Field(..., description="Live images served after the swap.")
    vectors: int = Field(..., description="Vectors in the new index.faiss.")
    removed: int = Field(..., description="Deleted vectors dropped from the index.")
    added: int = Field(..., description="Vectors added online, now part of the index.")
    holes: int = Field(..., description="Ids with no vector (deleted): never reused.")
    imbalance_before: float | None = Field(
        ..., description="Inverted-list imbalance factor before (1.0: even)."
    )
    imbalance_with_writes: float | None = Field(..., description="The old lists with the writes applied.")
    imbalance_after: float | None = Field(..., description="The new index's (null: not an inverted file).")
    retrained: bool = Field(
        ..., description="Whether the inverted file was trained again (its lists had drifted)."
    )
    seconds: float


class PatchImageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fields: dict[str, FieldValue] = Field(
        ...,
        min_length=1,
        description="Fields to set (the index's own, values of the field's kind); null removes a field.",
    )


class DeleteByIds(BaseModel):
    """Delete the live images among these ids (the others are left out of ``deleted``)."""

    model_config = ConfigDict(extra="forbid")

    ids: list[JsonInt] = Field(..., min_length=1, max_length=WRITE_BATCH_MAX)


class DeleteByFilter(BaseModel):
    """Delete every live image a filter selects."""

    model_config = ConfigDict(extra="forbid")

    filter: dict[str, Any] = Field(..., min_length=1, description=FILTER_DESCRIPTION)


DeleteImagesRequest = DeleteByIds | DeleteByFilter
