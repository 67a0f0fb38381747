"""Relevance labels given on served hits (the search page's "relevant" / "not relevant"), kept durably.

One SQLite file (``feedback.sqlite`` in the service's state directory), one row per judgement:
the index it was given on (its checkpoint sha256 and its ``created`` stamp, so labels of a rebuilt
index are not mixed in), the query text, the image id, the verdict, who gave it and when. A person
who judges the same hit again replaces their earlier verdict; several people's verdicts on one hit
become one label by majority (a tie counts as not relevant: no promise without evidence). SQLite
in WAL mode with ``synchronous=FULL``: an acknowledged label survives a crash of the server or of
the machine.

``icr index calibrate INDEX --from-feedback FILE`` and the service's refit read them as
:class:`icr.index.label_calibration.Label` rows; the search page reads those of one query's hits
(:meth:`FeedbackStore.query_labels`, GET /v1/feedback/labels) to show them on the hits again.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from icr.index.label_calibration import Label

FEEDBACK_FILE = "feedback.sqlite"
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS labels (
    index_key TEXT NOT NULL,
    query TEXT NOT NULL,
    image_id INTEGER NOT NULL,
    relevant INTEGER NOT NULL,
    who TEXT NOT NULL,
    at TEXT NOT NULL,
    PRIMARY KEY (index_key, query, image_id, who)
);
"""
# The labels of one query's hits, in one statement on the primary key's prefix (index_key, query):
# each judged hit with its judgements, the relevant ones among them, and one judge's own verdict.
# ``:ids`` is a JSON array of image ids, or null for every hit of the query.
QUERY_LABELS_SQL = (
    "SELECT image_id, COUNT(*), SUM(relevant), MAX(CASE WHEN who = :who THEN relevant END) FROM labels "
    "WHERE index_key = :key AND query = :query "
    "AND (:ids IS NULL OR image_id IN (SELECT value FROM json_each(:ids))) "
    "GROUP BY image_id ORDER BY image_id"
)


def index_key(checkpoint_sha256: str, created: str) -> str:
    """Which index a label was given on: its checkpoint and its build stamp."""
    return f"{checkpoint_sha256}:{created}"


@dataclass(frozen=True)
class FeedbackCounts:
    """What the labels of one index hold: judgements, the hits and queries they cover, how many
    hits are relevant by majority."""

    judgements: int
    hits: int
    queries: int
    relevant: int


@dataclass(frozen=True)
class HitLabel:
    """The label of one judged hit of a query: the verdict by majority of its judges (a tie: not
    relevant), how many judged it and how many of them said relevant, and one judge's own verdict
    (None: that judge has not judged it)."""

    image_id: int
    relevant: bool
    judgements: int
    relevant_judgements: int
    mine: bool | None


class FeedbackStore:
    """The labels file; every method opens its own connection (safe from any thread)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise ValueError(
                    f"{self.path}: feedback schema version {version}, this code reads {SCHEMA_VERSION}; "
                    "use the icr release that wrote it, or move the file aside"
                )
            db.executescript(_SCHEMA)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # acknowledged means on disk
            with db:  # one transaction: committed on success, rolled back on error
                yield db
        finally:
            db.close()

    def add(self, key: str, query: str, image_id: int, relevant: bool, who: str) -> None:
        """Record one judgement (replacing this person's earlier one on the same hit)."""
        at = datetime.now(UTC).isoformat(timespec="seconds")
        with self._connect() as db:
            db.execute(
                "INSERT INTO labels (index_key, query, image_id, relevant, who, at) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (index_key, query, image_id, who) "
                "DO UPDATE SET relevant = excluded.relevant, at = excluded.at",
                (key, query, int(image_id), int(relevant), who, at),
            )

    def labels(self, key: str) -> list[Label]:
        """One label per judged hit of the index ``key``, by majority of its judges, oldest first."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT query, image_id, SUM(relevant), COUNT(*), MIN(at) FROM labels WHERE index_key = ? "
                "GROUP BY query, image_id ORDER BY MIN(at), query, image_id",
                (key,),
            ).fetchall()
        return [Label(q, int(i), 2 * int(yes) > int(n), row) for row, (q, i, yes, n, _) in enumerate(rows, 1)]

    def counts(self, key: str) -> FeedbackCounts:
        """Counted in SQL (every label click asks): the hits grouped as :meth:`labels` groups them."""
        with self._connect() as db:
            row = db.execute(
                "SELECT COALESCE(SUM(n), 0), COUNT(*), COUNT(DISTINCT query), COALESCE(SUM(2 * yes > n), 0) "
                "FROM (SELECT query, SUM(relevant) AS yes, COUNT(*) AS n FROM labels WHERE index_key = ? "
                "GROUP BY query, image_id)",
                (key,),
            ).fetchone()
        return FeedbackCounts(
            judgements=int(row[0]), hits=int(row[1]), queries=int(row[2]), relevant=int(row[3])
        )

    def query_labels(
        self, key: str, query: str, image_ids: Iterable[int] | None = None, who: str | None = None
    ) -> list[HitLabel]:
        """The labels given on the index ``key`` to hits of ``query`` (the text as stored: stripped),
        by image id: every judged hit, or those among ``image_ids``; ``mine`` is the verdict of the
        judge ``who``. One SQL statement on the primary key's prefix: it reads only this query's
        rows, never every label."""
        ids = None if image_ids is None else json.dumps(sorted({int(i) for i in image_ids}))
        with self._connect() as db:
            rows = db.execute(
                QUERY_LABELS_SQL, {"key": key, "query": query, "ids": ids, "who": who}
            ).fetchall()
        return [
            HitLabel(
                image_id=int(image_id),
                relevant=2 * int(yes) > int(n),
                judgements=int(n),
                relevant_judgements=int(yes),
                mine=None if mine is None else bool(mine),
            )
            for image_id, n, yes, mine in rows
        ]
