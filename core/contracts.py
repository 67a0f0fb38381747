"""Typed artifact contracts: validating a JSON document against a pydantic model, with one error that
names the file and every bad field (``manifest.json: invalid index manifest: dim: Input should be
greater than or equal to 1; data.split: Field required. Rebuild the index with `icr index build`.``).

The models live beside the code that writes each artifact (``icr.index.manifest.Manifest``, ...);
this module only turns pydantic's errors into the project's one-line messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def field_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    """``dim: Input should be a valid integer; data.split: Field required``."""
    parts = []
    for error in errors:
        where = ".".join(str(p) for p in error.get("loc", ())) or "the document"
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {message}")
    return "; ".join(parts)


def validated(model: type[M], data: Any, source: str, what: str, hint: str) -> M:
    """``data`` as ``model``; ValueError ``"{source}: invalid {what}: {field errors}. {hint}"`` (the
    caller may leave ``hint`` empty and add its own)."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        message = f"{source}: invalid {what}: {field_errors(err.errors())}"
        raise ValueError(f"{message}. {hint}" if hint else message) from None
