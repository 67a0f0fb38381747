"""Query kinds of the embedded benchmark: what a caption asks for, read from its parse.

Thresholds and retrieval quality are reported per kind because one pooled figure hides the
queries a model handles poorly: counts and relations are far harder than "a red shape". Each
caption gets exactly one kind, the first that applies in this order (the hardest ask first):

* ``count``: states the number of objects ("three shapes: ...");
* ``relation``: relates two objects ("a red circle left of a blue square");
* ``position``: places an object in the grid ("in the top left corner there is a star");
* ``background``: names the background tone;
* ``several_objects``: names two or more objects, nothing else;
* ``one_object``: names one object by some of its attributes ("a small red shape").
"""

from __future__ import annotations

import functools

from icr.training.data.synthetic.parse import CaptionParseError, parse_caption
from icr.training.data.synthetic.query import Query

QUERY_KINDS: tuple[str, ...] = (
    "count",
    "relation",
    "position",
    "background",
    "several_objects",
    "one_object",
)


def query_kind(query: Query) -> str:
    """The kind of a parsed caption (see the module docstring)."""
    if query.count is not None:
        return "count"
    if query.relations:
        return "relation"
    if any(d.row is not None or d.col is not None for d in query.objects):
        return "position"
    if query.background is not None:
        return "background"
    return "several_objects" if len(query.objects) >= 2 else "one_object"


@functools.lru_cache(maxsize=4096)
def text_kind(text: str) -> str | None:
    """The kind of a query text in the embedded benchmark's grammar; None when it does not parse.

    Cached: a served text query asks for its kind up to three times (the response's quality block,
    the calibration's kind correction, and again when a filter extends the hits), ~35 µs a parse."""
    try:
        return query_kind(parse_caption(text))
    except CaptionParseError:
        return None
