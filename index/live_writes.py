"""The write-ahead log of a living index: images added, metadata patched and images deleted after the
build, durable in SQLite in the server's state directory (``writes.sqlite``).

An index folder never changes once built (its files are hashed in its manifest). What happened to
it since is this log, one table for every index a state directory has served (``index_key``: the
checkpoint's hash and the build's time, as the labels file keys it):

* each write is one row with a sequence number ``seq``; a request's writes (an upsert's delete and
  add, a batch) commit in one transaction, acknowledged only once SQLite has it on disk
  (``synchronous=FULL``), so ``kill -9`` never loses an acknowledged write;
* an add or patch row carries the image's whole metadata row as it is from then on (the columns of
  ``metadata.sqlite``), a delete row none: the version of an id at sequence number S is its row
  of largest ``seq <= S``. Readers at S therefore see every write up to S and none after, which
  is what lets a search apply writes all at once (:mod:`index.live_state`);
* new images take ids from the base index's ``ntotal`` up, never reused; a caller's
  ``external_id`` names one live image at a time (adding it again replaces that image).

Several processes may write to one file (SQLite serialises writers; ``BEGIN IMMEDIATE`` takes the
write lock before the ids are chosen) and each reads what the others committed (:meth:`since`).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np

from icr.index.filters import kind_of
from icr.index.metadata import COLUMNS, MetadataStore, decode_row, encode_row

WRITES_FILE = "writes.sqlite"
UPLOADS_FOLDER = "uploads"  # uploaded images, content-addressed, beside the write log
UPLOAD_PREFIX = "upload:"  # the source of an uploaded image: its file name in UPLOADS_FOLDER
SCHEMA_VERSION = 1
_QUERY_CHUNK = 900  # below SQLite's smallest limit on bound parameters

Op = Literal["add", "patch", "delete"]
_ROW_COLUMNS = COLUMNS[1:]  # the metadata columns after id: source, captions, ..., fields
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS writes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    index_key TEXT NOT NULL,
    op TEXT NOT NULL CHECK (op IN ('add', 'patch', 'delete')),
    id INTEGER NOT NULL,
    external_id TEXT,
    vector BLOB,
    {", ".join(f"{c} {'INTEGER' if c in ('is_distractor', 'image_id') else 'TEXT'}" for c in _ROW_COLUMNS)},
    who TEXT NOT NULL,
    at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS writes_by_seq ON writes (index_key, seq);  -- tailing: what is new
CREATE INDEX IF NOT EXISTS writes_by_id ON writes (index_key, id, seq);
CREATE INDEX IF NOT EXISTS writes_by_external ON writes (index_key, external_id, seq)
    WHERE external_id IS NOT NULL;
"""
_METADATA = ", ".join(COLUMNS)
_INSERT = (
    f"INSERT INTO writes (index_key, op, id, external_id, vector, {', '.join(_ROW_COLUMNS)}, who, at) "
    f"VALUES ({', '.join('?' * (7 + len(_ROW_COLUMNS)))})"
)
# the latest version of each id written at or before a sequence number (parameters: key, seq)
_LATEST = (
    "SELECT w.* FROM writes AS w JOIN (SELECT id AS latest_id, MAX(seq) AS latest FROM writes "
    "WHERE index_key = ? AND seq <= ?{ids} GROUP BY id) ON w.seq = latest"
)


class UnknownImage(KeyError):
    """An id or external id that names no live image of the index (never added, or deleted)."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else "unknown image"


@dataclass(frozen=True)
class NewImage:
    """An image to add: its unit embedding, its metadata row (``source``, ``captions``, ``fields``,
    ...; no ``id``: the log chooses it), and the caller's own name for it, if any."""

    vector: np.ndarray  # (D,) float32, L2-normalised
    row: dict[str, Any]
    external_id: str | None = None


@dataclass(frozen=True)
class Write:
    """One row of the log as a reader replays it: what changed, not the metadata (read at a sequence
    number with :meth:`WriteLog.rows`)."""

    seq: int
    op: Op
    id: int
    vector: np.ndarray | None  # (D,) for an add


@dataclass(frozen=True)
class Ack:
    """What one acknowledged write did: ``replaced`` is the id an add with a known external id
    deleted in the same transaction."""

    seq: int
    op: Op
    id: int
    external_id: str | None = None
    replaced: int | None = None


class WriteLog:
    """The writes of one index (``key``) in ``path``. Thread-safe; several processes may share the file.
    ``holes``: base ids with no image (a compacted folder's; ascending) and ``own``: [lo, hi), the
    base ids this index may hold (a shard's range; default all below ``base_ntotal``): a base id
    outside it or among the holes is never live unless the log adds it."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        key: str,
        base: MetadataStore,
        base_ntotal: int,
        dim: int,
        holes: np.ndarray | None = None,
        own: tuple[int, int] | None = None,
    ):
        self.path, self.key, self.base, self.base_ntotal, self.dim = Path(path), key, base, base_ntotal, dim
        self.holes = np.zeros(0, np.int64) if holes is None else holes
        self.own = (0, base_ntotal) if own is None else own
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._opened: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        db = self._connection()
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise ValueError(
                f"{self.path}: writes schema version {version}, this code reads {SCHEMA_VERSION}; use the "
                "icr release that wrote it, or move the file aside"
            )
        db.executescript(_SCHEMA)  # IF NOT EXISTS: several processes may open a new file at once
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # --- connections ------------------------------------------------------------------------------
    def _connection(self) -> sqlite3.Connection:
        """This thread's connection (SQLite connections are not shared between threads)."""
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            # check_same_thread off only so that close() can close every thread's connection
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer
            db.execute("PRAGMA synchronous=FULL")  # acknowledged means on disk
            self._local.db = db
            with self._lock:
                self._opened.append(db)
        return db

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction holding SQLite's write lock from its start (ids are chosen inside)."""
        db = self._connection()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        """Close every thread's connection (the log is not used after this)."""
        with self._lock:
            for db in self._opened:
                db.close()
            self._opened.clear()
        self._local = threading.local()

    def export(self, target: str | os.PathLike[str], seq: int) -> int:
        """Copy this index's writes up to ``seq`` into a new log file ``target`` (a snapshot's), one
        file with no WAL beside it; returns how many rows it holds."""
        copy = WriteLog(target, self.key, self.base, self.base_ntotal, self.dim, self.holes, self.own)
        try:
            db = copy._connection()
            db.execute("ATTACH DATABASE ? AS source", (str(self.path),))
            db.execute("BEGIN IMMEDIATE")
            copied = db.execute(
                "INSERT INTO writes SELECT * FROM source.writes WHERE index_key = ? AND seq <= ?",
                (self.key, seq),
            ).rowcount
            db.execute("COMMIT")
            db.execute("DETACH DATABASE source")
            db.execute("PRAGMA journal_mode=DELETE")  # folds the WAL in: a self-contained file
        finally:
            copy.close()
        return int(copied)

    # --- writing ----------------------------------------------------------------------------------
    def add(self, images: Sequence[NewImage], who: str) -> list[Ack]:
        """Add ``images`` in one transaction; an external id already naming a live image replaces it
        (that image is deleted in the same transaction). Returns one ack per image, in order."""
        for k, image in enumerate(images):
            if image.vector.shape != (self.dim,):
                raise ValueError(
                    f"image {k}: a vector of shape {image.vector.shape}, this index holds ({self.dim},)"
                )
        names = [image.external_id for image in images if image.external_id is not None]
        if len(set(names)) != len(names):
            raise ValueError("external_id: each may appear once per request")
        at = _now()
        acks = []
        with self._transaction() as tx:
            next_id = self._next_id(tx)
            for image in images:
                replaced = None
                if image.external_id is not None:
                    replaced = self._live_external(tx, image.external_id)
                    if replaced is not None:
                        self._append(tx, "delete", replaced, image.external_id, None, None, who, at)
                row = encode_row({**image.row, "id": next_id}, self.path)[1:]
                vector = np.ascontiguousarray(image.vector, np.float32).tobytes()
                seq = self._append(tx, "add", next_id, image.external_id, vector, row, who, at)
                acks.append(Ack(seq, "add", next_id, image.external_id, replaced))
                next_id += 1
        return acks

    def patch(self, image_id: int, fields: dict[str, Any], who: str) -> Ack:
        """Merge ``fields`` into the user fields of a live image (a value of None removes that field)."""
        with self._transaction() as tx:
            row = self._current_row(tx, image_id)
            merged = {**(row.get("fields") or {}), **fields}
            row["fields"] = {k: v for k, v in merged.items() if v is not None} or None
            encoded = encode_row(row, self.path)[1:]
            seq = self._append(
                tx, "patch", image_id, self._external_of(tx, image_id), None, encoded, who, _now()
            )
        return Ack(seq, "patch", image_id)

    def delete(self, ids: Sequence[int], who: str) -> list[Ack]:
        """Delete the live images among ``ids`` in one transaction (the others are not live: no ack)."""
        at = _now()
        acks = []
        with self._transaction() as tx:
            for image_id in dict.fromkeys(int(i) for i in ids):
                if self._is_live(tx, image_id):
                    external = self._external_of(tx, image_id)
                    acks.append(
                        Ack(
                            self._append(tx, "delete", image_id, external, None, None, who, at),
                            "delete",
                            image_id,
                            external,
                        )
                    )
        return acks

    def _append(
        self,
        tx: sqlite3.Connection,
        op: Op,
        image_id: int,
        external_id: str | None,
        vector: bytes | None,
        row: tuple[Any, ...] | None,
        who: str,
        at: str,
    ) -> int:
        values = row if row is not None else (None,) * len(_ROW_COLUMNS)
        cursor = tx.execute(
            _INSERT,
            (self.key, op, image_id, external_id, vector, *values, who, at),
        )
        assert cursor.lastrowid is not None
        return int(cursor.lastrowid)

    def _next_id(self, tx: sqlite3.Connection) -> int:
        (largest,) = tx.execute(
            "SELECT MAX(id) FROM writes WHERE index_key = ? AND op = 'add'", (self.key,)
        ).fetchone()
        return max(self.base_ntotal, -1 if largest is None else int(largest) + 1)

    def _latest_op(self, tx: sqlite3.Connection, image_id: int) -> str | None:
        found = tx.execute(
            "SELECT op FROM writes WHERE index_key = ? AND id = ? ORDER BY seq DESC LIMIT 1",
            (self.key, image_id),
        ).fetchone()
        return None if found is None else str(found[0])

    def _is_live(self, tx: sqlite3.Connection, image_id: int) -> bool:
        if not 0 <= image_id < 2**63:  # beyond SQLite's integers: no id
            return False
        op = self._latest_op(tx, image_id)
        if op is not None:
            return op != "delete"
        lo, hi = self.own
        at = int(np.searchsorted(self.holes, image_id))
        return lo <= image_id < hi and not (at < len(self.holes) and self.holes[at] == image_id)

    def _live_external(self, tx: sqlite3.Connection, external_id: str) -> int | None:
        found = tx.execute(
            "SELECT id, op FROM writes WHERE index_key = ? AND external_id = ? ORDER BY seq DESC LIMIT 1",
            (self.key, external_id),
        ).fetchone()
        return None if found is None or found[1] == "delete" else int(found[0])

    def _external_of(self, tx: sqlite3.Connection, image_id: int) -> str | None:
        found = tx.execute(
            "SELECT external_id FROM writes WHERE index_key = ? AND id = ? AND op = 'add'",
            (self.key, image_id),
        ).fetchone()
        return None if found is None else found[0]

    def _current_row(self, tx: sqlite3.Connection, image_id: int) -> dict[str, Any]:
        if not self._is_live(tx, image_id):
            raise UnknownImage(f"no live image {image_id} in this index")
        found = tx.execute(
            f"SELECT {_METADATA} FROM writes WHERE index_key = ? AND id = ? ORDER BY seq DESC LIMIT 1",
            (self.key, image_id),
        ).fetchone()
        return decode_row(found) if found is not None else self.base.get([image_id])[0]

    # --- reading ----------------------------------------------------------------------------------
    def last_seq(self) -> int:
        (seq,) = (
            self._connection()
            .execute("SELECT MAX(seq) FROM writes WHERE index_key = ?", (self.key,))
            .fetchone()
        )
        return 0 if seq is None else int(seq)

    def since(self, seq: int, limit: int = 100_000) -> list[Write]:
        """This index's writes after ``seq``, oldest first, at most ``limit`` (a reader tailing the
        log calls again until it gets none). Only committed transactions are visible, whole."""
        rows = self._connection().execute(
            "SELECT seq, op, id, vector FROM writes WHERE index_key = ? AND seq > ? ORDER BY seq LIMIT ?",
            (self.key, seq, limit),
        )
        return [
            Write(int(s), op, int(i), None if v is None else np.frombuffer(v, np.float32).copy())
            for s, op, i, v in rows
        ]

    def rows(self, ids: Sequence[int], seq: int) -> dict[int, dict[str, Any] | None]:
        """{id: its metadata row as of ``seq`` (None: deleted by then)} for the ``ids`` the log has
        written at or before ``seq``; ids it has not are absent (their row is the base index's)."""
        out: dict[int, dict[str, Any] | None] = {}
        unique = list(dict.fromkeys(int(i) for i in ids))
        db = self._connection()
        for start in range(0, len(unique), _QUERY_CHUNK):
            chunk = unique[start : start + _QUERY_CHUNK]
            query = _LATEST.format(ids=f" AND id IN ({','.join('?' * len(chunk))})")
            for found in db.execute(f"SELECT op, {_METADATA} FROM ({query})", (self.key, seq, *chunk)):
                out[int(found[1])] = None if found[0] == "delete" else decode_row(found[1:])
        return out

    def matching(self, where: str, params: Sequence[Any], seq: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids whose version at ``seq`` is live and satisfies the SQL condition ``where`` over the
        metadata columns (:func:`index.filters.to_sql`), every id the log has written by ``seq``),
        both ascending int64: a filter's selection is the base's matches less the written ids, plus
        the first."""
        db = self._connection()
        latest = _LATEST.format(ids="")
        matched = db.execute(
            f"SELECT id FROM ({latest}) WHERE op != 'delete' AND ({where}) ORDER BY id",
            (self.key, seq, *params),
        )
        written = db.execute(
            "SELECT DISTINCT id FROM writes WHERE index_key = ? AND seq <= ? ORDER BY id", (self.key, seq)
        )
        return (
            np.fromiter((r[0] for r in matched), np.int64),
            np.fromiter((r[0] for r in written), np.int64),
        )

    def resolve_external(self, external_id: str) -> int:
        """The live image ``external_id`` names; UnknownImage if none."""
        found = self._live_external(self._connection(), external_id)
        if found is None:
            raise UnknownImage(f"no live image with external_id {json.dumps(external_id)} in this index")
        return found


def _kind(value: Any) -> str | None:
    """The JSON kind of a field value, as ``metadata_field_types`` names kinds (None for null)."""
    if isinstance(value, list | dict):
        return "array" if isinstance(value, list) else "object"
    return kind_of(value)


def check_fields(
    fields: dict[str, Any] | None, known: Sequence[str], kinds: Mapping[str, Sequence[str]], where: str
) -> dict[str, Any] | None:
    """``fields`` (None when empty) when each is one of the index's fields (``known``) with a value
    of a kind it holds (``kinds``; integers and other numbers count as one), so that filters select
    it; null values pass (they remove a field). ValueError naming the field and the fix otherwise."""
    if not fields:
        return None
    numbers = {"integer", "number"}
    for name, value in fields.items():
        if name not in known:
            listed = ", ".join(known) if known else "none: it was built without a metadata file"
            raise ValueError(f"{where}.{name}: not a field of this index (its fields: {listed})")
        held, kind = set(kinds.get(name, [])), _kind(value)
        if kind is None or not held or kind in held or (kind in numbers and held & numbers):
            continue
        raise ValueError(
            f"{where}.{name}: a {kind}, where the field holds {' or '.join(sorted(held))}; send a value "
            "of that kind, so filters on the field select it"
        )
    return fields


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
