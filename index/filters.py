"""Query-time filters on an index's metadata: parse, check against the index's fields, turn into SQL.

A filter is a JSON object; every entry must hold (AND)::

    {"album": "holidays"}                    equality (string, number, boolean; null: field absent)
    {"camera": {"in": ["x100", "gr3"]}}      one of a list
    {"year": {"gte": 2019, "lt": 2023}}      numeric range (gt, gte, lt, lte; any combination)
    {"is_distractor": false}                 the built-in flag (distractors carry no user fields)

Field names are the index's metadata fields (``Manifest.metadata_fields``) and ``is_distractor``;
an unknown one is refused with the list of known ones, since a typo would otherwise match nothing.
The service turns a filter into the sorted ids it selects (:meth:`MetadataStore.matching_ids`) and
searches only among them.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from threading import Lock
from typing import Any

import numpy as np

BUILTIN_FIELDS = ("is_distractor",)
RANGE_OPS = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}
IN_MAX = 1000  # values in one "in" list (the SQL statement binds each)
Scalar = str | int | float | bool | None


@dataclass(frozen=True)
class Condition:
    field: str
    op: str  # "eq", "in", or a key of RANGE_OPS
    value: Any  # a scalar, a list of scalars (in), or a number (ranges)


@dataclass(frozen=True)
class Filter:
    """A checked filter; ``key`` is its canonical JSON (equal filters share cached results)."""

    conditions: tuple[Condition, ...]
    key: str


_INT64 = 2**63 - 1


def _scalar(value: Any, where: str) -> Scalar:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: not UTF-8 text (a lone surrogate); send the value as UTF-8") from None
        return value
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):  # SQLite integers are 64-bit; a larger one compares as a float
        return value if abs(value) <= _INT64 else float(value)
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise ValueError(f"{where}: expected a string, number, boolean or null, got {json.dumps(value)[:60]}")


def _number(value: Any, where: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: a range bound must be a finite number, got {json.dumps(value)[:60]}")
    return value if abs(value) <= _INT64 else float(value)


def filter_schema(fields: Sequence[str] | None) -> dict[str, Any]:
    """JSON Schema of a filter on an index with these metadata ``fields`` (None: not known yet, any
    name allowed), for the OpenAPI document."""
    scalar = [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]
    condition = {
        "type": "object",
        "properties": {
            "in": {"type": "array", "minItems": 1, "maxItems": IN_MAX, "items": {"anyOf": scalar}},
            **{op: {"type": "number"} for op in RANGE_OPS},
        },
        "additionalProperties": False,
        "minProperties": 1,
    }
    value = {"anyOf": [*scalar, {"type": "null"}, condition]}
    schema: dict[str, Any] = {"type": "object", "properties": {"is_distractor": {"type": "boolean"}}}
    if fields is None:
        schema["additionalProperties"] = value
    else:
        schema["properties"].update(dict.fromkeys(fields, value))
        schema["additionalProperties"] = False
    return schema


def parse_filter(spec: Any, known_fields: Sequence[str]) -> Filter | None:
    """A :class:`Filter` from the request's JSON (None or {} -> None); ValueError saying what to fix."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError('filter: a JSON object of field -> condition, e.g. {"album": "holidays"}')
    known = [*known_fields, *BUILTIN_FIELDS]
    conditions: list[Condition] = []
    for field, cond in spec.items():
        if field not in known:
            listed = ", ".join(known) if known else "none"
            raise ValueError(f"filter: unknown field {field!r}; this index's fields are: {listed}")
        where = f"filter.{field}"
        if field == "is_distractor" and not isinstance(cond, bool):
            raise ValueError(f"{where}: true or false")
        if not isinstance(cond, dict):
            conditions.append(Condition(field, "eq", _scalar(cond, where)))
            continue
        if not cond:
            raise ValueError(f'{where}: an empty condition; give a value, {{"in": [...]}} or a range')
        for op, value in cond.items():
            if op == "in":
                if not isinstance(value, list) or not 1 <= len(value) <= IN_MAX:
                    raise ValueError(f"{where}.in: a list of 1 to {IN_MAX} values")
                values = [_scalar(v, f"{where}.in") for v in value]
                if any(v is None for v in values):
                    raise ValueError(f"{where}.in: null cannot be listed; filter on {{{field!r}: null}}")
                conditions.append(Condition(field, "in", values))
            elif op in RANGE_OPS:
                conditions.append(Condition(field, op, _number(value, f"{where}.{op}")))
            else:
                raise ValueError(f"{where}: unknown operator {op!r}; use in, {', '.join(RANGE_OPS)}")
    if not conditions:
        return None
    return Filter(tuple(conditions), json.dumps(spec, sort_keys=True, separators=(",", ":")))


def to_sql(filter_: Filter) -> tuple[str, list[Any]]:
    """(SQL condition over the ``items`` table, its parameters). Field names travel as bound JSON
    paths, never spliced into the statement."""
    clauses: list[str] = []
    params: list[Any] = []
    for c in filter_.conditions:
        if c.field == "is_distractor":
            column = "is_distractor"
        else:
            column = "json_extract(fields, ?)"
            params.append(json_path(c.field))
        if c.op == "eq" and c.value is None:
            clauses.append(f"{column} IS NULL")
        elif c.op == "eq":
            clauses.append(f"{column} = ?")
            params.append(c.value)
        elif c.op == "in":
            clauses.append(f"{column} IN ({','.join('?' * len(c.value))})")
            params.extend(c.value)
        else:
            # typeof: a range never matches text (SQLite orders every string above every number)
            clauses.append(f"({column} {RANGE_OPS[c.op]} ? AND typeof({column}) IN ('integer', 'real'))")
            params += [c.value, json_path(c.field)]
    return " AND ".join(clauses), params


def json_path(field: str) -> str:
    """SQLite JSON path of a top-level key, quoted so dots and spaces in names are literal
    (:func:`check_field_name` keeps double quotes out of names)."""
    return f'$."{field}"'


def check_field_name(name: Any, source: str) -> str:
    """``name`` if it can be a metadata field; ValueError naming ``source`` otherwise."""
    if not isinstance(name, str) or not name or '"' in name or not name.isprintable():
        raise ValueError(f"{source}: field name {name!r} must be non-empty printable text without '\"'")
    if name in BUILTIN_FIELDS:
        raise ValueError(f"{source}: field name {name!r} is reserved; rename that column")
    return name


@dataclass
class Selection:
    """The ids a filter selects (ascending) and a FAISS selector over them (a bitmap of the index)."""

    ids: Any  # (m,) int64
    selector: Any  # faiss.IDSelectorBitmap; reads `bitmap`, which must live as long as it
    bitmap: Any  # (ceil(ntotal / 8),) uint8, bit i (little-endian within bytes) = id i selected
    seconds: float  # what selecting cost (SQL + bitmap), for the response's timings


class FilterCache:
    """Selections of recent filters (a user paging through results repeats the same filter), LRU;
    thread-safe."""

    def __init__(self, metadata: Any, ntotal: int, size: int = 64) -> None:
        self.metadata = metadata  # an index.metadata.MetadataStore
        self.ntotal = ntotal
        self.size = size
        self._items: OrderedDict[str, Selection] = OrderedDict()
        self._lock = Lock()

    def select(self, filter_: Filter) -> tuple[Selection, bool]:
        """(selection, whether it came from the cache)."""
        with self._lock:
            hit = self._items.get(filter_.key)
            if hit is not None:
                self._items.move_to_end(filter_.key)
                return hit, True
        selection = self._compute(filter_)
        with self._lock:
            self._items[filter_.key] = selection
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return selection, False

    def _compute(self, filter_: Filter) -> Selection:
        import faiss  # noqa: PLC0415 (faiss: only this path needs it)

        t0 = time.perf_counter()
        where, params = to_sql(filter_)
        ids = self.metadata.matching_ids(where, params)  # (m,)
        mask = np.zeros(self.ntotal, bool)
        mask[ids] = True
        bitmap = np.packbits(mask, bitorder="little")  # (ceil(ntotal / 8),)
        selector = faiss.IDSelectorBitmap(self.ntotal, faiss.swig_ptr(bitmap))
        return Selection(ids, selector, bitmap, time.perf_counter() - t0)
