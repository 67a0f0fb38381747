"""Relevance labels given on served hits (the search page's "relevant" / "not relevant"), kept durably.

One SQLite file (``feedback.sqlite`` in the service's state directory), one row per judgement:
the index it was given on (its checkpoint sha256 and its ``created`` stamp, so labels of a rebuilt
index are not mixed in), the query text, the image id, the verdict, who gave it and when. A person
who judges the same hit again replaces their earlier verdict; several people's verdicts on one hit
become one label by majority (a tie counts as not relevant: no promise without evidence). SQLite
in WAL mode with ``synchronous=FULL``: an acknowledged label survives a crash of the server or of
the machine.

``icr index calibrate INDEX --from-feedback FILE`` and the service's refit read them as
:class:`icr.index.label_calibration.Label` rows.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
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
