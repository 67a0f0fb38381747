"""GET /v1/images/{id}: a gallery or distractor image (or its thumbnail) for display."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request, Response

from icr.core.image_input import GALLERY_FORMATS, ImageLimits
from icr.service.errors import ApiError
from icr.service.routes.deps import decode_slots_of, retriever_of, settings_of
from icr.service.schemas import error_responses

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
        raise ApiError(
            404, "not_found", f"no image {image_id}: ids run from 0 to {retriever.images.manifest.ntotal - 1}"
        ) from None
    except OSError as err:  # precomputed features, or a gallery file moved or damaged since the build
        raise ApiError(404, "no_pixels", f"image {image_id} has no viewable file: {err}") from None
    # Index images never change under a given id while the server runs.
    return Response(png, media_type="image/png", headers={"Cache-Control": "public, max-age=3600"})
