"""GET /v1/images/{id}: a gallery or distractor image (or its thumbnail), and what the index stores about it.

``/v1/images/{id}`` serves the pixels for display, ``/v1/images/{id}/metadata`` the stored row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Request, Response

from icr.core.image_input import GALLERY_FORMATS, ImageLimits
from icr.index.live_writes import UPLOAD_PREFIX
from icr.service.errors import ApiError
from icr.service.gallery_images import DISTRACTOR_PREFIX
from icr.service.loaded_index import public_source
from icr.service.retriever import Retriever
from icr.service.routes.deps import decode_slots_of, retriever_of, settings_of
from icr.service.schemas import ImageMetadata, error_responses

router = APIRouter(prefix="/v1/images", tags=["images"])


@router.get(
    "/{image_id}",
    response_class=Response,
    summary="An indexed image as PNG",
    responses={200: {"content": {"image/png": {}}}, **error_responses(404, 422, 503, decodes=True)},
)
def get_image(image_id: int, request: Request, size: Literal["full", "thumb"] = "full") -> Response:
    """A gallery file is opened with the limits of uploads (ICR_MAX_IMAGE_PIXELS, ICR_MAX_ASPECT_RATIO,
    photo formats only), so a file replaced since the build cannot exhaust memory: 404 beyond them."""
    retriever = retriever_of(request)
    settings = settings_of(request)
    thumb = settings.thumbnail_size if size == "thumb" else None
    limits = ImageLimits(settings.max_image_pixels, settings.max_aspect_ratio, GALLERY_FORMATS)
    try:
        png = retriever.gallery.png(image_id, thumb, limits, decode_slots_of(request).slot())
    except KeyError:
        raise not_found(retriever, image_id) from None
    except OSError as err:  # precomputed features, or a gallery file moved or damaged since the build
        raise ApiError(404, "no_pixels", f"image {image_id} has no viewable file: {err}") from None
    # Index images never change under a given id while the server runs.
    return Response(png, media_type="image/png", headers={"Cache-Control": "public, max-age=3600"})


def not_found(retriever: Retriever, image_id: int) -> ApiError:
    """404 for an id that names no live image: beyond the index, or deleted."""
    state = retriever.images.live.state
    if not state.size:
        valid = "the index is empty"
    elif state.seq:  # written to since its build: ids have gaps
        valid = "ids are those searches return (images added since the build have ids from "
        valid += f"{state.base_ntotal} up; deleted ones are gone)"
    else:
        valid = f"ids run from 0 to {state.base_ntotal - 1}"
    return ApiError(404, "not_found", f"no image {image_id}: {valid}")


@router.get(
    "/{image_id}/metadata",
    response_model=ImageMetadata,
    summary="What the index stores about an image",
    responses=error_responses(404, 422, 503),
)
def image_metadata(image_id: int, request: Request) -> ImageMetadata:
    """The stored row of an image: its source relative to the gallery folder (never the server's
    path), file name, metadata fields, captions, whether it is a distractor, and where its pixels
    are served. 404 naming the valid ids for an id outside the index."""
    return metadata_of(retriever_of(request), image_id)


def metadata_of(retriever: Retriever, image_id: int) -> ImageMetadata:
    """The stored row of a live image as clients see it; 404 (naming the valid ids) otherwise."""
    state = retriever.images.live.state
    if not state.is_live(image_id):  # also keeps ids beyond SQLite's int64 out
        raise not_found(retriever, image_id)
    row = retriever.images.live.rows([image_id], state)[0]
    source = public_source(row["source"], retriever.images.source_root)
    is_file = not row["source"].startswith((DISTRACTOR_PREFIX, UPLOAD_PREFIX)) and "#" not in row["source"]
    return ImageMetadata(
        id=image_id,
        source=source,
        file_name=Path(source).name if is_file else None,
        fields=row.get("fields") or {},
        captions=row["captions"],
        is_distractor=row["is_distractor"],
        image_id=row["image_id"],
        scene=row["scene"],
        image_url=f"/v1/images/{image_id}" if retriever.gallery.has_pixels(row) else None,
    )
