"""Query-time filters on an index's metadata: parse, check against the index's fields, turn into SQL.

A filter is a JSON object; every entry must hold (AND)::

    {"album": "holidays"}                    equality (string, number, boolean; null: field absent)
    {"camera": {"in": ["x100", "gr3"]}}      one of a list
    {"year": {"gte": 2019, "lt": 2023}}      numeric range (gt, gte, lt, lte; any combination)
    {"is_distractor": false}                 the built-in flag (distractors carry no user fields)

Field names are the index's metadata fields (``Manifest.metadata_fields``) and ``is_distractor``;
an unknown one is refused with the list of known ones, since a typo would otherwise match nothing.
For the same reason a value of another kind than the field stores (``{"year": "2024"}`` on a field
of integers: SQLite's text never equals a number) is refused, naming the field, the kind it holds
and the value given, when the index's field kinds (``Manifest.metadata_field_types``) are known.
Integers and other numbers compare with each other.
The service turns a filter into the sorted ids it selects (:meth:`MetadataStore.matching_ids`) and
searches only among them.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from threading import Lock
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # live_index imports this module
    from icr.index.live_index import LiveIndex
    from icr.index.live_state import LiveState

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

# The stored kinds a filter value of each kind can equal (numbers compare across int and float).
_COMPARABLE = {
    "string": {"string"},
    "integer": {"integer", "number"},
    "number": {"integer", "number"},
    "boolean": {"boolean"},
}
_NUMERIC = {"integer", "number"}
_PLURAL = {
    "string": "strings",
    "integer": "integers",
    "number": "numbers",
    "boolean": "booleans (true/false)",
    "array": "lists",
    "object": "objects",
}
# Field kinds as an index records them: field -> kinds of its non-null values (index.metadata).
FieldTypes = Mapping[str, Collection[str]]


def kind_of(value: Scalar) -> str | None:
    """The JSON kind of a filter value (None for null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return "string"
    return "integer" if isinstance(value, int) else "number"


def _holds(kinds: Collection[str]) -> str:
    names = [_PLURAL.get(k, k) for k in sorted(kinds)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _given(value: Scalar) -> str:
    kind = kind_of(value)
    shown = json.dumps(value, ensure_ascii=False)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"the {kind} {shown}"


def _fix(value: Scalar, kinds: set[str]) -> str:
    """How to send ``value`` so it can match a field of ``kinds``, when there is an obvious way:
    "2024" for a field of integers is 2024 unquoted; 3 for a field of strings is "3"."""
    if isinstance(value, str):
        text = value.strip()
        try:
            parsed = json.loads(text.lower() if text.lower() in ("true", "false") else text)
        except (ValueError, RecursionError):
            return ""
        if isinstance(parsed, float) and not math.isfinite(parsed):
            return ""
        if isinstance(parsed, bool | int | float) and kinds & _COMPARABLE[str(kind_of(parsed))]:
            return f" (send it without quotes: {json.dumps(parsed)})"
        return ""
    if "string" in kinds:
        return f' (send it quoted: "{json.dumps(value)}")'
    return ""


def _check_kind(value: Scalar, field: str, where: str, types: FieldTypes | None) -> None:
    """ValueError when ``value`` cannot equal any value ``field`` stores (no check when the field
    kinds are unknown, or the field holds nothing but null)."""
    kinds = set(types.get(field, ())) if types is not None else set()
    given = kind_of(value)
    if given is None or not kinds or kinds & _COMPARABLE[given]:
        return
    raise ValueError(
        f'{where}: the index stores {_holds(kinds)} in "{field}"; got {_given(value)}{_fix(value, kinds)}'
    )


def _check_range(field: str, where: str, types: FieldTypes | None) -> None:
    kinds = set(types.get(field, ())) if types is not None else set()
    if kinds and not kinds & _NUMERIC:
        raise ValueError(
            f'{where}: the index stores {_holds(kinds)} in "{field}", and a range compares numbers; '
            'filter on a value or {"in": [...]} instead'
        )


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


def _value_schema(kinds: Collection[str]) -> dict[str, Any]:
    """JSON Schema of a condition on a field whose values have ``kinds`` (empty: unknown, or only
    nulls: any scalar). JSON Schema's "number" includes integers, as the comparison does."""
    held = set(kinds)
    json_types = [
        t
        for t, fits in (("string", {"string"}), ("number", _NUMERIC), ("boolean", {"boolean"}))
        if not held or held & fits
    ]
    scalar = [{"type": t} for t in json_types]
    properties: dict[str, Any] = {}
    if scalar:
        properties["in"] = {"type": "array", "minItems": 1, "maxItems": IN_MAX, "items": {"anyOf": scalar}}
    if not held or held & _NUMERIC:
        properties.update({op: {"type": "number"} for op in RANGE_OPS})
    condition = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
        "minProperties": 1,
    }
    # a field of lists or objects only: no scalar equals them, and null (the field absent) is left
    return {"anyOf": [*scalar, {"type": "null"}, *([condition] if properties else [])]}


def filter_schema(fields: Sequence[str] | None, types: FieldTypes | None = None) -> dict[str, Any]:
    """JSON Schema of a filter on an index with these metadata ``fields`` (None: not known yet, any
    name allowed) holding ``types`` (None: unknown, any scalar), for the OpenAPI document."""
    schema: dict[str, Any] = {"type": "object", "properties": {"is_distractor": {"type": "boolean"}}}
    if fields is None:
        schema["additionalProperties"] = _value_schema(())
    else:
        schema["properties"].update(
            {name: _value_schema(types.get(name, ()) if types is not None else ()) for name in fields}
        )
        schema["additionalProperties"] = False
    return schema


def parse_filter(spec: Any, known_fields: Sequence[str], types: FieldTypes | None = None) -> Filter | None:
    """A :class:`Filter` from the request's JSON (None or {} -> None); ValueError saying what to fix.
    ``types``: the kinds each field stores (None: unknown, values of any kind are taken)."""
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
            value = _scalar(cond, where)
            _check_kind(value, field, where, types)
            conditions.append(Condition(field, "eq", value))
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
                for i, v in enumerate(values):
                    _check_kind(v, field, f"{where}.in[{i}]", types)
                conditions.append(Condition(field, "in", values))
            elif op in RANGE_OPS:
                bound = _number(value, f"{where}.{op}")
                _check_range(field, f"{where}.{op}", types)
                conditions.append(Condition(field, op, bound))
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
    """The ids a filter selects (ascending) and a FAISS selector over them (a bitmap of the index).
    Over a living index (:mod:`index.live_index`), as of one state of its write log: ``bitmap`` and
    ``selector`` cover the base index, ``added`` the images added since."""

    ids: Any  # (m,) int64
    selector: Any  # faiss.IDSelectorBitmap; reads `bitmap`, which must live as long as it
    bitmap: Any  # (ceil(ntotal / 8),) uint8, bit i (little-endian within bytes) = id i selected
    seconds: float  # what selecting cost (SQL + bitmap), for the response's timings
    added: Any = None  # (a,) bool over the state's added images; None: no images added
    seq: int = 0  # the write log's state it was made at

    @property
    def count(self) -> int:
        return len(self.ids)

    def contains(self, image_id: int) -> bool:
        at = int(np.searchsorted(self.ids, image_id))
        return at < len(self.ids) and int(self.ids[at]) == image_id


class FilterCache:
    """Selections of recent filters (a user paging through results repeats the same filter), LRU;
    thread-safe. With ``live`` (an :class:`index.live_index.LiveIndex`), a selection is made and
    cached per state of the write log, so each search filters as of the state it searches."""

    def __init__(self, metadata: Any, ntotal: int, size: int = 64, live: LiveIndex | None = None) -> None:
        self.metadata = metadata  # an index.metadata.MetadataStore
        self.ntotal = ntotal
        self.size = size
        self.live = live
        self._items: OrderedDict[tuple[str, int], Selection] = OrderedDict()
        self._lock = Lock()

    def select(self, filter_: Filter, state: LiveState | None = None) -> tuple[Selection, bool]:
        """(selection as of ``state`` (None: the base index alone), whether it came from the cache)."""
        key = (filter_.key, 0 if state is None else state.seq)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit, True
        selection = self._compute(filter_, state)
        with self._lock:
            self._items[key] = selection
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return selection, False

    def _compute(self, filter_: Filter, state: LiveState | None) -> Selection:
        import faiss  # noqa: PLC0415 (faiss: only this path needs it)

        t0 = time.perf_counter()
        if state is not None and state.seq and self.live is not None:
            live = self.live.select(filter_, state)
            ids = np.union1d(live.base_ids, state.ids[live.added])  # (m,)
            selector = faiss.IDSelectorBitmap(self.ntotal, faiss.swig_ptr(live.base_bitmap))
            seconds = time.perf_counter() - t0
            return Selection(ids, selector, live.base_bitmap, seconds, live.added, state.seq)
        where, params = to_sql(filter_)
        ids = self.metadata.matching_ids(where, params)  # (m,)
        mask = np.zeros(self.ntotal, bool)
        mask[ids] = True
        bitmap = np.packbits(mask, bitorder="little")  # (ceil(ntotal / 8),)
        selector = faiss.IDSelectorBitmap(self.ntotal, faiss.swig_ptr(bitmap))
        return Selection(ids, selector, bitmap, time.perf_counter() - t0)
