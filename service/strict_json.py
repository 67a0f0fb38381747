"""JSON request bodies read strictly: a body means one thing, or it is refused with 422 saying why.

Python's ``json.loads`` (which FastAPI uses) lets the last of two equal keys win, reads ``NaN`` and
``Infinity``, and fails on an integer of more than 4,300 digits with a message FastAPI reports as
"not valid JSON". Here:

* a key given twice in one object is refused, naming the key (``{"k": 5, "k": 500}`` would
  otherwise search with 500 while the client's code shows 5);
* ``NaN``, ``Infinity`` and ``-Infinity`` are refused (not JSON, RFC 8259);
* an integer longer than :data:`MAX_INTEGER_DIGITS` digits is refused, naming its field;
* nesting deeper than Python's parser can follow is refused.

Unknown fields are refused by the request models (``extra="forbid"``), and the error handler names
the closest known field (``service.errors``). The body's size is bounded before any of this runs
(``service.body_limit``), so parsing costs at most a few milliseconds on the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

MAX_INTEGER_DIGITS = 30  # far beyond any count this API takes (k, offset, distractors)


class _Refused:
    """A number the parser read but this API refuses (too many digits, NaN, Infinity), kept until
    the key it belongs to is known, so the message can name the field."""

    def __init__(self, what: str) -> None:
        self.what = what


def _integer(literal: str) -> int | _Refused:
    digits = len(literal.lstrip("-"))
    if digits <= MAX_INTEGER_DIGITS:
        return int(literal)
    return _Refused(f"a number of {digits} digits; numbers here are at most {MAX_INTEGER_DIGITS} digits")


def _constant(name: str) -> _Refused:
    return _Refused(f"{name} is not a JSON number; send a finite number")


def _refused_in(value: Any) -> _Refused | None:
    if isinstance(value, _Refused):
        return value
    if isinstance(value, list):  # an object's lists were built before it; nested objects checked themselves
        return next((found for item in value if (found := _refused_in(item)) is not None), None)
    return None


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"{key}: given twice in one JSON object; send each field once")
        refused = _refused_in(value)
        if refused is not None:
            raise ValueError(f"{key}: {refused.what} (see the field's bounds in /docs)")
        out[key] = value
    return out


def parse_strict(body: bytes) -> Any:
    """The JSON value of ``body``; ValueError with a message for a client (json.JSONDecodeError,
    a subclass, for bytes that are not JSON at all; UnicodeDecodeError for bytes that are not UTF-8)."""
    try:
        value = json.loads(body, object_pairs_hook=_object, parse_int=_integer, parse_constant=_constant)
    except RecursionError:
        raise ValueError("the body is nested too deeply; send a flat JSON object") from None
    refused = _refused_in(value)  # a bare value, or one in a top-level list
    if refused is not None:
        raise ValueError(f"{refused.what}; send a JSON object (see /docs)")
    return value


class _StrictRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = parse_strict(body)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise  # FastAPI answers them as any body that is not JSON
            except ValueError as err:
                raise HTTPException(422, str(err)) from None
        return self._json


class StrictJSONRoute(APIRoute):
    """A route whose JSON body is read by :func:`parse_strict` (``APIRouter(route_class=...)``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(_StrictRequest(request.scope, request.receive))

        return strict_handler
