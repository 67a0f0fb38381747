"""Uploaded images: the bytes read within ICR_MAX_UPLOAD_BYTES, decoded within the pixel and aspect
limits (checked on the header, before decoding: :mod:`icr.core.image_input`), each refusal a 4xx
that names the problem."""

from __future__ import annotations

from typing import Any

from fastapi import UploadFile

from icr.core.image_input import ImageLimits, ImageRefused, open_image
from icr.service.config import Settings
from icr.service.errors import ApiError


def read_upload(upload: UploadFile, settings: Settings) -> tuple[bytes, str]:
    """(the uploaded file's bytes, its name for messages); 413 over ICR_MAX_UPLOAD_BYTES, 422 empty."""
    data = upload.file.read(settings.max_upload_bytes + 1)
    name = upload.filename or "file"
    if len(data) > settings.max_upload_bytes:
        raise ApiError(
            413,
            "payload_too_large",
            f"{name}: over {settings.max_upload_bytes} bytes (ICR_MAX_UPLOAD_BYTES); send a smaller image",
        )
    if not data:
        raise ApiError(422, "invalid_image", f"{name}: empty file; upload a JPEG, PNG or WebP image")
    return data, name


def decode_upload(data: bytes, name: str, settings: Settings) -> Any:
    """The upload as an upright RGB PIL image; 413 / 415 / 422 naming the problem otherwise."""
    limits = ImageLimits(max_pixels=settings.max_image_pixels, max_aspect_ratio=settings.max_aspect_ratio)
    try:
        return open_image(data, limits)
    except ImageRefused as err:
        status, code, setting = {
            "format": (415, "unsupported_media_type", ""),
            "pixels": (413, "image_too_large", " (ICR_MAX_IMAGE_PIXELS)"),
            "aspect_ratio": (422, "invalid_image", " (ICR_MAX_ASPECT_RATIO)"),
        }.get(err.reason, (422, "invalid_image", ""))
        fix = "; upload it again or re-encode it" if err.reason == "corrupt" else ""
        raise ApiError(status, code, f"{name}: {err}{setting}{fix}") from None
