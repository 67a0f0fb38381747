"""SQLite metadata store of an index: what each vector id stands for.

One row per vector id: where it came from (image path, ``distractor:{k}``), its captions, whether it
is a distractor, the scene structure on the embedded benchmark, the split image it belongs to, and
the user's own fields (``--metadata FILE`` of a photo folder, the parquet of ``icr embed``), which
query-time filters select on (:mod:`index.filters`). Writers insert in chunked transactions;
readers open the file read-only, so a service can never modify an index it serves.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from icr.core.contracts import field_errors
from icr.index.manifest import FieldKind

METADATA_FILE = "metadata.sqlite"
# Bumped when the table layout changes; stored as SQLite's user_version. Version 1 (no ``fields``
# column) is still read: its rows have no fields.
SCHEMA_VERSION = 2
# Below SQLite's smallest limit on bound parameters (999 in older builds).
_QUERY_CHUNK = 900
_INSERT_CHUNK = 10_000

_SCHEMA = """
CREATE TABLE items (
    id INTEGER PRIMARY KEY,
    source TEXT NOT NULL,
    captions TEXT NOT NULL,
    is_distractor INTEGER NOT NULL,
    scene TEXT,
    image_id INTEGER,
    fields TEXT
)
"""
COLUMNS = ("id", "source", "captions", "is_distractor", "scene", "image_id", "fields")
_READABLE = {1: COLUMNS[:-1], SCHEMA_VERSION: COLUMNS}  # schema version -> its columns
# What a filter may compare a field's values with: SQLite's json_type of a stored value -> the JSON
# kind an index records (index.filters checks a filter's values against it). null is no kind: a
# filter on null asks for the field's absence, whatever the field holds elsewhere.
JSON_KINDS: dict[str, FieldKind] = {
    "text": "string",
    "integer": "integer",
    "real": "number",
    "true": "boolean",
    "false": "boolean",
    "array": "array",
    "object": "object",
}


class MetadataRow(BaseModel):
    """One vector id's row, as writers hand it to :meth:`MetadataStore.add` (numpy integers welcome)."""

    model_config = ConfigDict(extra="forbid")
    id: int = Field(ge=0)
    source: str = Field(min_length=1)  # image path, ``distractor:{k}``, ``features.npy#row``, ...
    captions: list[str] = Field(default_factory=list)
    is_distractor: bool = False
    scene: dict[str, Any] | None = None  # the embedded benchmark's scene structure
    image_id: int | None = None  # the split image a caption belongs to
    fields: dict[str, Any] | None = None  # the user's metadata (JSON values), filterable


def encode_row(row: dict[str, Any], path: Path) -> tuple[Any, ...]:
    try:
        r = MetadataRow.model_validate(row)
    except ValidationError as err:
        raise ValueError(f"{path}: metadata row {row.get('id')!r}: {field_errors(err.errors())}") from None
    return (
        r.id,
        r.source,
        json.dumps(r.captions, ensure_ascii=False),
        int(r.is_distractor),
        None if r.scene is None else json.dumps(r.scene, separators=(",", ":")),
        r.image_id,
        None if r.fields is None else json.dumps(r.fields, ensure_ascii=False, separators=(",", ":")),
    )


def decode_row(values: Sequence[Any]) -> dict[str, Any]:
    row = dict(zip(COLUMNS, values, strict=True))
    row["captions"] = json.loads(row["captions"])
    row["is_distractor"] = bool(row["is_distractor"])
    for key in ("scene", "fields"):
        row[key] = None if row[key] is None else json.loads(row[key])
    return row


class MetadataUnreadable(KeyError):
    """Rows the index names that the store cannot give: absent, or not decodable (a store rewritten
    or damaged under an open handle). A KeyError, as an absent key is."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else "metadata unreadable"


class MetadataStore:
    """Rows ``{id, source, captions (list), is_distractor (bool), scene (dict | None), image_id,
    fields (dict | None)}``.

    ``image_id``: the index of the split image the item belongs to (an image row: itself; a caption
    row: the image it describes; a distractor: None). Use :meth:`create` to write a new store and
    :meth:`open` to read one.
    """

    def __init__(
        self, connection: sqlite3.Connection, path: Path, writable: bool, version: int = SCHEMA_VERSION
    ):
        self._db = connection
        self.path = path
        self.writable = writable
        self.version = version
        # a version-1 store has no fields column: select NULL in its place
        self._select = ", ".join(c if c in _READABLE[version] else "NULL" for c in COLUMNS)

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> MetadataStore:
        """A new, empty store at ``path`` (which must not exist)."""
        path = Path(path)
        if path.exists():
            raise FileExistsError(f"{path}: metadata store already exists")
        db = sqlite3.connect(path)
        # The store is written inside a temporary build folder that is discarded if the build
        # fails, so crash safety comes from the folder rename, not from SQLite's journal.
        db.execute("PRAGMA journal_mode=OFF")
        db.execute("PRAGMA synchronous=OFF")
        db.execute(_SCHEMA)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.commit()
        return cls(db, path, writable=True)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> MetadataStore:
        """Open ``path`` read-only (shared between threads: SQLite serialises access)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: metadata store not found; rebuild the index with `icr index build`"
            )
        try:
            db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
            version = db.execute("PRAGMA user_version").fetchone()[0]
            columns = [r[1] for r in db.execute("PRAGMA table_info(items)")]
        except sqlite3.DatabaseError as err:
            raise ValueError(
                f"{path}: not a readable metadata store ({err}); rebuild the index with `icr index build`"
            ) from None
        if tuple(columns) != _READABLE.get(version):
            db.close()
            raise ValueError(
                f"{path}: metadata schema version {version} with columns {columns}, this code reads versions "
                f"{sorted(_READABLE)}; rebuild the index with `icr index build`"
            )
        return cls(db, path, writable=False, version=version)

    def add(self, rows: Iterable[dict[str, Any]]) -> int:
        """Insert ``rows`` in transactions of 10,000; returns how many were inserted."""
        if not self.writable:
            raise ValueError(f"{self.path}: opened read-only")
        count = 0
        batch: list[tuple[Any, ...]] = []
        for row in rows:
            batch.append(encode_row(row, self.path))
            if len(batch) >= _INSERT_CHUNK:
                count += self._insert(batch)
                batch = []
        if batch:
            count += self._insert(batch)
        return count

    def _insert(self, batch: list[tuple[Any, ...]]) -> int:
        with self._db:  # one transaction per chunk: commits, or rolls back on error
            self._db.executemany(f"INSERT INTO items VALUES ({','.join('?' * len(COLUMNS))})", batch)
        return len(batch)

    def get(self, ids: Sequence[int] | Iterable[int]) -> list[dict[str, Any]]:
        """Rows for ``ids`` in the order given (repeats allowed); MetadataUnreadable (a KeyError)
        names absent ids, or a row that cannot be decoded."""
        wanted = [int(i) for i in ids]
        found: dict[int, dict[str, Any]] = {}
        unique = list(dict.fromkeys(wanted))
        for start in range(0, len(unique), _QUERY_CHUNK):
            chunk = unique[start : start + _QUERY_CHUNK]
            marks = ",".join("?" * len(chunk))
            for values in self._db.execute(f"SELECT {self._select} FROM items WHERE id IN ({marks})", chunk):
                try:
                    found[values[0]] = decode_row(values)
                except (ValueError, TypeError) as err:  # JSON columns that are not JSON any more
                    message = f"{self.path}: row {values[0]} cannot be decoded ({err})"
                    raise MetadataUnreadable(message) from None
        missing = [i for i in unique if i not in found]
        if missing:
            raise MetadataUnreadable(f"{self.path}: no metadata for ids {missing[:10]}")
        return [dict(found[i]) for i in wanted]  # copies: a repeated id is not one shared dict

    def matching_ids(self, where: str, params: Sequence[Any]) -> np.ndarray:
        """(m,) int64 ids of the rows satisfying the SQL condition ``where`` (built by
        :func:`index.filters.to_sql`, with ``?`` placeholders for ``params``), ascending."""
        cursor = self._db.execute(f"SELECT id FROM items WHERE {where} ORDER BY id", list(params))
        return np.fromiter((r[0] for r in cursor), dtype=np.int64)

    def gallery_sources(self) -> Iterator[tuple[int, str]]:
        """(id, source) of every gallery row (not distractors), in id order: the two columns alone,
        nothing decoded, for naming a user's files among a large index's rows."""
        for image_id, source in self._db.execute(
            "SELECT id, source FROM items WHERE is_distractor = 0 ORDER BY id"
        ):
            yield int(image_id), str(source)

    def field_types(self) -> dict[str, list[FieldKind]]:
        """{field: the sorted JSON kinds (string, integer, number, boolean, array, object) its
        non-null values have}, over every row: one pass over the table in SQLite (about 2 s per
        million rows). A field whose every value is null has no entry; a version-1 store has none."""
        if self.version < 2:
            return {}
        kinds: dict[str, set[FieldKind]] = {}
        cursor = self._db.execute(
            "SELECT j.key, j.type FROM items, json_each(items.fields) AS j "
            "WHERE items.fields IS NOT NULL GROUP BY j.key, j.type"
        )
        for key, sql_type in cursor:
            kind = JSON_KINDS.get(sql_type)
            if kind is not None:
                kinds.setdefault(str(key), set()).add(kind)
        return {key: sorted(found) for key, found in sorted(kinds.items())}

    def count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM items").fetchone()[0])

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> MetadataStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
