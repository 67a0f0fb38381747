"""Shared request helpers of the routers."""

from __future__ import annotations

from fastapi import Request

from icr.service.config import Settings
from icr.service.errors import ApiError
from icr.service.retriever import Retriever


def settings_of(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def retriever_of(request: Request) -> Retriever:
    """The loaded retriever, or 503 while the model and index are still loading (or failed to)."""
    retriever: Retriever | None = request.app.state.retriever
    refused = request.app.state.refused
    if refused is not None:
        raise ApiError(503, "artifacts_changed", refused)
    if retriever is None:
        error = request.app.state.load_error
        if error is not None:
            raise ApiError(503, "load_failed", f"the model or index failed to load: {error}")
        raise ApiError(
            503,
            "not_ready",
            "the model and index are still loading; retry in a few seconds "
            "(GET /readyz turns 200 when ready)",
        )
    return retriever
