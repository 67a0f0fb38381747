"""Writes to the served image index (admin): add images by embedding or upload, patch their fields,
delete them by id or by filter. Each is acknowledged once it is in the write log on disk
(:mod:`icr.index.live_writes`) and searchable on this server; other servers on the same state
directory apply it within ICR_WRITES_POLL_SECONDS."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Request, UploadFile
from pydantic import ValidationError

from icr.core.atomic import atomic_write
from icr.index.filters import parse_filter
from icr.index.live_writes import UPLOAD_PREFIX, Ack, NewImage, UnknownImage, check_fields
from icr.service.access import admin_identity
from icr.service.errors import ApiError, validation_message
from icr.service.loaded_index import Live, LoadedIndex
from icr.service.retriever import Retriever, unit_query
from icr.service.routes.deps import decode_slots_of, retriever_of, settings_of
from icr.service.routes.images import metadata_of, not_found
from icr.service.schemas import (
    EXTERNAL_ID_MAX,
    AddImagesRequest,
    DeleteByFilter,
    DeleteImagesRequest,
    ImageMetadata,
    ImageToAdd,
    PatchImageRequest,
    WriteResult,
    WrittenImage,
    error_responses,
)
from icr.service.uploads import decode_upload, read_upload

router = APIRouter(prefix="/v1/images", tags=["images"])


def _live(retriever: Retriever) -> Live:
    """The served index's writes: its folder's log, or its shards' (routed to the owning shard)."""
    live = retriever.images.live
    if not live.writable:
        raise ApiError(
            409,
            "writes_disabled",
            "this server takes no writes (ICR_WRITES=false): restart it with ICR_WRITES=true to add, "
            "change or delete images",
        )
    return live


def _who(request: Request) -> str:
    # the middleware let only an admin through; "admin" covers a reload of the settings in between
    return admin_identity(request.scope, settings_of(request)) or "admin"


def checked_fields(fields: dict[str, Any] | None, target: LoadedIndex, where: str) -> dict[str, Any] | None:
    """``fields`` when the index can filter on them (:func:`check_fields`); 422 naming the fix otherwise."""
    try:
        return check_fields(fields, target.manifest.metadata_fields, target.field_types, where)
    except ValueError as err:
        raise ApiError(422, "invalid_request", str(err)) from None


def _new_image(image: ImageToAdd, k: int, target: LoadedIndex) -> NewImage:
    where = f"images[{k}]"
    try:
        vector = unit_query(image.vector, target.manifest.dim, f"{where}.vector")[0]  # (D,)
    except ValueError as err:
        raise ApiError(422, "invalid_request", str(err)) from None
    row = {
        "source": image.source or image.external_id or "added",
        "captions": image.captions,
        "fields": checked_fields(image.fields, target, f"{where}.fields"),
    }
    return NewImage(vector, row, image.external_id)


def _result(live: Live, acks: list[Ack]) -> WriteResult:
    state = live.state
    return WriteResult(
        written=[
            WrittenImage(id=a.id, external_id=a.external_id, replaced=a.replaced)
            for a in acks
            if a.op == "add"
        ],
        deleted=[a.id for a in acks if a.op == "delete"],
        seq=state.seq,
        images=state.size,
    )


@router.post(
    "",
    response_model=WriteResult,
    summary="Add images by their embeddings (an external_id already used replaces its image)",
    responses=error_responses(401, 403, 409, 413, 422, 503),
)
def add_images(body: AddImagesRequest, request: Request) -> WriteResult:
    """Adds up to 1,000 images in one transaction: all of them or, on any error, none. Each takes a
    new id (never reused); one with an ``external_id`` that names a live image replaces it. The 200
    comes once the write is on disk and searchable here. Needs the admin key (ICR_ADMIN_KEY; unset:
    clients on this machine only)."""
    retriever = retriever_of(request)
    live = _live(retriever)
    images = [_new_image(image, k, retriever.images) for k, image in enumerate(body.images)]
    return _result(live, live.add(images, _who(request)))


@router.post(
    ":upload",
    response_model=WriteResult,
    summary="Add an uploaded image, embedded by the served checkpoint",
    responses=error_responses(401, 403, 409, 413, 415, 422, 503, decodes=True),
)
def upload_image(
    request: Request,
    file: Annotated[UploadFile, File(description="JPEG, PNG, WebP... image (EXIF orientation applied)")],
    external_id: Annotated[str | None, Form(min_length=1, max_length=EXTERNAL_ID_MAX)] = None,
    fields: Annotated[str | None, Form(description="A JSON object of the index's fields.")] = None,
) -> WriteResult:
    """Embeds the image with the served model, keeps its file in the state directory (GET
    /v1/images/{id} serves it), and adds it as POST /v1/images adds an embedding."""
    settings = settings_of(request)
    retriever = retriever_of(request)
    live = _live(retriever)
    if not retriever.accepts_images:
        raise ApiError(
            409, "no_image_encoder", "this checkpoint's image tower reads precomputed features, not pixels"
        )
    try:
        entry = ImageToAdd(
            vector=[1.0], external_id=external_id, fields=json.loads(fields) if fields else None
        )
    except ValidationError as err:
        raise ApiError(422, "invalid_request", validation_message(err.errors())) from None
    except ValueError as err:  # not JSON
        raise ApiError(422, "invalid_request", f"fields: not JSON ({err}); send a JSON object") from None
    row_fields = checked_fields(entry.fields, retriever.images, "fields")
    data, name = read_upload(file, settings)
    with decode_slots_of(request).slot():  # the decoded image and its resizing: bounded memory
        image = decode_upload(data, name, settings)
        vector = retriever.encode_image(image)[0]  # (D,)
        del image
    stored = hashlib.sha256(data).hexdigest()  # content-addressed: the same bytes are kept once
    uploads = retriever.gallery.uploads
    assert uploads is not None  # _live: this server takes writes
    if not (uploads / stored).is_file():
        atomic_write(uploads / stored, lambda handle: handle.write(data))  # on disk before the ack
    row = {"source": f"{UPLOAD_PREFIX}{stored}", "fields": row_fields}
    return _result(live, live.add([NewImage(vector, row, entry.external_id)], _who(request)))


@router.patch(
    "/{image_id}",
    response_model=ImageMetadata,
    summary="Set (or remove, with null) metadata fields of an image",
    responses=error_responses(401, 403, 404, 409, 422, 503),
)
def patch_image(image_id: int, body: PatchImageRequest, request: Request) -> ImageMetadata:
    """Answers with the image's metadata as stored from now on (filters select on it at once)."""
    retriever = retriever_of(request)
    live = _live(retriever)
    checked_fields(body.fields, retriever.images, "fields")
    try:
        live.patch(image_id, body.fields, _who(request))
    except UnknownImage:
        raise not_found(retriever, image_id) from None
    return metadata_of(retriever, image_id)


@router.delete(
    "/{image_id}",
    response_model=WriteResult,
    summary="Delete an image",
    responses=error_responses(401, 403, 404, 409, 422, 503),
)
def delete_image(image_id: int, request: Request) -> WriteResult:
    """Gone from every search, filter count and image route once answered. 404 if not live."""
    retriever = retriever_of(request)
    live = _live(retriever)
    acks = live.delete([image_id], _who(request))
    if not acks:
        raise not_found(retriever, image_id)
    return _result(live, acks)


@router.post(
    ":delete",
    response_model=WriteResult,
    summary="Delete images by id or by filter",
    responses=error_responses(401, 403, 409, 422, 503),
)
def delete_images(body: DeleteImagesRequest, request: Request) -> WriteResult:
    """Deletes, in one transaction, the live images among ``ids`` (the others are left out of
    ``deleted``), or every live image ``filter`` selects (as search filters)."""
    retriever = retriever_of(request)
    live = _live(retriever)
    target = retriever.images
    if not isinstance(body, DeleteByFilter):
        return _result(live, live.delete(body.ids, _who(request)))
    try:
        filter_ = parse_filter(body.filter, target.manifest.metadata_fields, target.field_types)
    except ValueError as err:
        raise ApiError(422, "invalid_request", f"filter: {err}") from None
    assert filter_ is not None  # the schema asks for at least one field
    return _result(live, live.delete_matching(filter_, _who(request)))
