"""Liveness, readiness and what is being served."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from icr.service.routes.deps import retriever_of, settings_of
from icr.service.schemas import error_responses

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz", summary="Readiness: model and index loaded (503 until then)", responses=error_responses(503)
)
def readyz(request: Request) -> dict[str, Any]:
    """200 while search can run. 503 with the reason while loading, after a failed load, and while a
    served file is changed on disk. ``calibrated``: whether relevance is given (false: min_relevance
    answers 409)."""
    retriever = retriever_of(request)
    return {"status": "ready", "calibrated": retriever.images.calibration is not None}


@router.get(
    "/v1/info",
    summary="Checkpoint, indices, calibration, limits and benchmark datasets",
    responses=error_responses(503),
)
def info(request: Request) -> dict[str, Any]:
    settings = settings_of(request)
    retriever = retriever_of(request)
    return {
        **retriever.info(),
        "faiss_threads": settings.faiss_threads,
        "micro_batch": {"max_batch": settings.micro_batch, "searches": retriever.batching()},
        "limits": {
            "max_k": settings.max_k,
            "search_depth": settings.search_depth,
            "max_text_chars": settings.max_text_chars,
            "max_upload_bytes": settings.max_upload_bytes,
            "max_image_pixels": settings.max_image_pixels,
            "max_aspect_ratio": settings.max_aspect_ratio,
        },
        "datasets": sorted(settings.datasets),
        "benchmarks_need_api_key": settings.admin_key is not None,
        "search_needs_api_key": settings.api_key is not None,
    }
