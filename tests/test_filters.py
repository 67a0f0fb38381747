"""Filters on metadata fields of known kinds: the kinds an index records (against a Python pass over
the rows), filters of the wrong kind refused with a message that says what to send (against a naive
"could any stored value equal it" oracle), the OpenAPI schema of a typed filter (whatever it admits,
the parser accepts), and an index built before kinds were recorded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from icr.index.build import build_photo_index
from icr.index.filters import filter_schema, parse_filter, to_sql
from icr.index.manifest import MANIFEST_FILE, Manifest
from icr.index.metadata import METADATA_FILE, MetadataStore
from icr.service.loaded_index import load_index_folder

FIELDS = ["album", "year", "rating", "flag", "tags", "mixed", "empty"]


def _kind(value: Any) -> str | None:
    """The JSON kind of a Python value read from JSON, written out case by case."""
    if value is None:
        return None
    if value is True or value is False:
        return "boolean"
    if isinstance(value, str):
        return "string"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    return "object"


def _rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        fields: dict[str, Any] = {}
        if rng.random() < 0.9:
            fields["album"] = ["home", "trip", "2024"][int(rng.integers(3))]
        if rng.random() < 0.8:
            fields["year"] = int(rng.integers(2000, 2025))
        if rng.random() < 0.7:
            fields["rating"] = round(float(rng.random() * 5), 2)
        fields["flag"] = bool(rng.random() < 0.5)
        if rng.random() < 0.3:
            fields["tags"] = ["a", "b"][: int(rng.integers(1, 3))]
        fields["mixed"] = [1, "one", None][i % 3]
        fields["empty"] = None
        rows.append({"id": i, "source": f"{i}.png", "fields": fields if i % 13 else None})
    return rows


def _store(path: Path, rows: list[dict[str, Any]]) -> MetadataStore:
    with MetadataStore.create(path) as store:
        store.add(rows)
    return MetadataStore.open(path)


def test_field_types_are_the_kinds_a_pass_over_the_rows_finds(tmp_path: Path) -> None:
    rows = _rows(800, seed=0)
    expected: dict[str, set[str]] = {}
    for row in rows:
        for name, value in (row["fields"] or {}).items():
            kind = _kind(value)
            if kind is not None:
                expected.setdefault(name, set()).add(kind)
    with _store(tmp_path / "m.sqlite", rows) as store:
        got = store.field_types()
    assert got == {name: sorted(kinds) for name, kinds in expected.items()}
    assert got["rating"] == ["number"]  # 2.0 is stored as JSON 2.0, a real, not an integer
    assert "empty" not in got  # nothing but null: no kind


def _could_match(rows: list[dict[str, Any]], field: str, value: Any) -> bool:
    """The oracle: is there a stored value of ``field`` a filter value could equal, by JSON kind
    (integers and other numbers compare; true is not 1)?"""
    given_kind = _kind(value)
    numeric = {"integer", "number"}
    for row in rows:
        stored = _kind((row["fields"] or {}).get(field))
        if stored is None:
            continue
        if stored == given_kind or (stored in numeric and given_kind in numeric):
            return True
    return False


VALUES = [
    "home",
    "2024",
    "true",
    " 2019 ",
    2024,
    2024.0,
    2.5,
    True,
    False,
    "",
    "x" * 80,
]


def test_a_value_of_a_kind_the_field_does_not_hold_is_refused_and_only_then(tmp_path: Path) -> None:
    rows = _rows(400, seed=1)
    with _store(tmp_path / "m.sqlite", rows) as store:
        types = store.field_types()
        for field in FIELDS:
            held = [v for r in rows if (v := (r["fields"] or {}).get(field)) is not None]
            scalar = next((v for v in held if not isinstance(v, list | dict)), None)
            for value in VALUES:
                refused = bool(held) and not _could_match(rows, field, value)
                if refused:
                    with pytest.raises(ValueError, match=f'filter.{field}: the index stores .* in "{field}"'):
                        parse_filter({field: value}, FIELDS, types)
                    if scalar is not None:  # the same check for each value of a list
                        with pytest.raises(ValueError, match=rf"filter.{field}.in\[1\]: the index stores"):
                            parse_filter({field: {"in": [scalar, value]}}, FIELDS, types)
                else:
                    parsed = parse_filter({field: value}, FIELDS, types)
                    assert parsed is not None
                    store.matching_ids(*to_sql(parsed))  # it runs
            parse_filter({field: None}, FIELDS, types)  # "absent" asks about any field


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"year": "2024"},
            'filter.year: the index stores integers in "year"; got the string "2024" '
            r"\(send it without quotes: 2024\)",
        ),
        (
            {"album": 3},
            r'filter.album: the index stores strings in "album"; got the integer 3 \(send it quoted: "3"\)',
        ),
        ({"flag": 1}, r'filter.flag: the index stores booleans \(true/false\) in "flag"; got the integer 1$'),
        ({"flag": "true"}, r"got the string \"true\" \(send it without quotes: true\)"),
        ({"year": True}, 'filter.year: the index stores integers in "year"; got the boolean true$'),
        ({"mixed": False}, 'the index stores integers and strings in "mixed"; got the boolean false'),
        (
            {"album": {"gte": 3}},
            'filter.album.gte: the index stores strings in "album", and a range compares numbers',
        ),
        ({"tags": "a"}, 'filter.tags: the index stores lists in "tags"; got the string "a"'),
    ],
)
def test_wrong_kinds_say_what_the_field_holds_and_what_to_send(spec: dict[str, Any], message: str) -> None:
    types = {
        "album": ["string"],
        "year": ["integer"],
        "rating": ["number"],
        "flag": ["boolean"],
        "tags": ["array"],
        "mixed": ["integer", "string"],
    }
    with pytest.raises(ValueError, match=message):
        parse_filter(spec, list(types), types)


def test_numbers_compare_across_integers_and_floats_and_unknown_kinds_check_nothing() -> None:
    types = {"year": ["integer"], "rating": ["number"], "empty": []}
    for spec in (
        {"rating": 3},
        {"rating": {"gte": 1, "lt": 4.5}},
        {"year": 2019.0},
        {"year": {"in": [2019, 2020.5]}},
        {"empty": "anything"},
        {"empty": {"gt": 1}},
    ):
        assert parse_filter(spec, list(types), types) is not None
    assert parse_filter({"year": "2019"}, list(types)) is not None  # kinds unknown: not checked


FIELD_KINDS = {
    "album": ["string"],
    "year": ["integer"],
    "rating": ["integer", "number"],
    "flag": ["boolean"],
    "tags": ["array"],
    "mixed": ["integer", "string"],
    "empty": [],
}
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5)
)
CONDITIONS = SCALARS | st.dictionaries(
    st.sampled_from(["in", "gt", "gte", "lt", "lte"]),
    SCALARS | st.lists(SCALARS, min_size=0, max_size=3),
    min_size=0,
    max_size=2,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*FIELD_KINDS, "is_distractor"]), CONDITIONS, max_size=3))
def test_what_the_openapi_schema_admits_the_parser_accepts(spec: dict[str, Any]) -> None:
    """A schema-valid filter is never refused (Schemathesis sends such filters and expects 2xx)."""
    schema = filter_schema(list(FIELD_KINDS), FIELD_KINDS)
    try:
        jsonschema.validate(spec, schema)
    except jsonschema.ValidationError:
        return
    parse_filter(spec, list(FIELD_KINDS), FIELD_KINDS)


def test_an_untyped_schema_is_the_old_one() -> None:
    value = filter_schema(["year"])["properties"]["year"]
    assert [a.get("type") for a in value["anyOf"]] == ["string", "number", "boolean", "null", "object"]
    typed = filter_schema(["year", "tags"], {"year": ["integer"], "tags": ["array"]})["properties"]
    assert [a.get("type") for a in typed["year"]["anyOf"]] == ["number", "null", "object"]
    assert typed["tags"] == {"anyOf": [{"type": "null"}]}
    assert json.dumps(typed)  # plain JSON for the OpenAPI document


def test_an_index_records_its_field_kinds_and_one_built_before_gets_them_at_load(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    lines = ["file,album,year,rating"]
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(photos / f"{i}.png")
        lines.append(f"{i}.png,{['home', 'trip'][i % 2]},{2018 + i},{i / 2}")
    (tmp_path / "meta.csv").write_text("\n".join(lines) + "\n")
    index = tmp_path / "index"
    build_photo_index(
        tiny_checkpoint, images=photos, metadata=tmp_path / "meta.csv", out=index, gpu="off", progress=False
    )
    manifest = Manifest.read(index)
    expected = {"album": ["string"], "year": ["integer"], "rating": ["number"]}
    assert manifest.metadata_field_types == expected
    assert load_index_folder(index, "off", 8, 1).field_types == expected

    old = tmp_path / "old"
    shutil.copytree(index, old)
    recorded = json.loads((old / MANIFEST_FILE).read_text())
    del recorded["metadata_field_types"]  # as written before kinds were recorded
    (old / MANIFEST_FILE).write_text(json.dumps(recorded))
    assert Manifest.read(old).metadata_field_types is None
    loaded = load_index_folder(old, "off", 8, 1)
    assert loaded.field_types == expected  # read from metadata.sqlite at load
    with pytest.raises(ValueError, match='got the string "2020"'):
        parse_filter({"year": "2020"}, loaded.manifest.metadata_fields, loaded.field_types)
    assert (old / METADATA_FILE).read_bytes() == (index / METADATA_FILE).read_bytes()  # read, not written
