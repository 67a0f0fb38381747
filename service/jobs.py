"""Benchmark jobs: their state in SQLite, and a runner that executes them one at a time.

Each job runs in its own low-priority process (``icr.service.benchmark_worker``): evaluation is
CPU-heavy numpy/torch work that would otherwise hold the GIL and the cores the search requests
need, and a crash in it must not take the server down. The worker writes progress and results
into the same SQLite file; every worker write names the job's ``attempt`` and only applies while
the job is still ``running`` under that attempt, so a worker orphaned by a server crash can never
overwrite the ``interrupted`` mark the restarted server gave its job.

Several servers may share one database (replicas). A claimed job carries a *lease*: its owner
(host, pid, a per-runner id) and an expiry that the owner renews while the worker runs. A server
marks a running job ``interrupted`` only when its lease has expired, or when its owner ran on this
host and that process is gone (a restart on the same machine need not wait for the expiry); claims
are atomic, so every job runs once. When that is noticed: every GET of a job or of the list checks
first, as does each server's runner every ``poll_s`` when idle and every third of the lease while it
runs a job. So a job whose server on this host was killed shows ``interrupted`` at the next read; one
whose server on another host was, once its lease (ICR_JOB_LEASE_SECONDS) has expired.

``DELETE`` cancels a queued or running job (the owner sees its renewal refused and stops the
worker); finished jobs older than the retention are deleted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("icr.service")
SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    dataset TEXT NOT NULL,
    split TEXT NOT NULL,
    protocol TEXT NOT NULL,
    distractors INTEGER NOT NULL,
    progress REAL NOT NULL DEFAULT 0,
    stage TEXT,
    created_at TEXT NOT NULL,
    started_at TEXT,
    finished_at TEXT,
    error TEXT,
    metrics TEXT,
    report TEXT,
    attempt INTEGER NOT NULL DEFAULT 0,
    pid INTEGER,
    lease_owner TEXT,
    lease_until REAL
);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created_at);
"""
# version 1 -> 2: the lease columns (a v1 job still running has no lease: it is interrupted)
_MIGRATE_1 = "ALTER TABLE jobs ADD COLUMN lease_owner TEXT; ALTER TABLE jobs ADD COLUMN lease_until REAL;"
JobStatus = Literal["queued", "running", "succeeded", "failed", "interrupted", "cancelled"]
FINISHED: tuple[JobStatus, ...] = ("succeeded", "failed", "interrupted", "cancelled")
# what a statement binds: the values SQLite stores in this table's columns
_SqlValue = str | int | float | None
RESTART_MESSAGE = (
    "the server stopped while this job ran ({reason}); its partial work is discarded: submit "
    "it again with POST /v1/benchmarks"
)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _plain(value: Any) -> Any:
    """``value`` as strict JSON data: NaN/inf become null (an HTTP response refuses them), numpy
    scalars and arrays become Python numbers and lists."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):  # numpy scalar or array
        return _plain(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _json(value: Any) -> str:
    return json.dumps(_plain(value), allow_nan=False)


def _parsed(column: str, text: str | None) -> dict[str, Any] | None:
    """A JSON column as its object (None stays None). Only :meth:`JobStore.succeed` writes these,
    always an object, so anything else means the file was edited by hand: a ValueError naming the column."""
    if text is None:
        return None
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"job column {column} holds {type(value).__name__}, not a JSON object")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRow:
    """One row of the ``jobs`` table, every column, its JSON columns parsed.

    Frozen: a snapshot of the row when it was read; every change goes through :class:`JobStore`,
    whose writes are guarded by ``status`` and ``attempt`` in SQL, never by this copy. The API's view
    of a job is its public part (``service.routes.benchmarks``): not ``attempt``, ``pid`` or the lease,
    which are the servers' bookkeeping (a lease owner names a host and a process).
    """

    id: str
    status: JobStatus
    dataset: str
    split: str
    protocol: str
    distractors: int
    progress: float  # in [0, 1]
    stage: str | None
    created_at: str  # ISO 8601, UTC, whole seconds
    started_at: str | None
    finished_at: str | None
    error: str | None  # what a client reads: no server paths (see without_server_paths)
    metrics: dict[str, Any] | None  # the headline numbers (a succeeded job)
    report: dict[str, Any] | None  # the whole report; also None when read without it (with_report=False)
    attempt: int  # claims so far; a worker's writes name theirs
    pid: int | None  # the worker process of the current attempt
    lease_owner: str | None  # host:pid:runner of the server running it
    lease_until: float | None  # Unix time the owner's lease runs out


# a directory part of an absolute path: "/" not after a word, a dot, a colon or another "/" (so
# not inside a relative path or a URL), then "name/" parts
_SERVER_DIRS = re.compile(r"(?<![\w.:/~])/(?:[^\s/'\"()]+/)+")


def without_server_paths(text: str, roots: Mapping[str, str | os.PathLike[str]] | None = None) -> str:
    """``text`` for a client: each of ``roots``' paths (``{name: path}``, e.g. a dataset's folder)
    becomes its name, and any other absolute path its last part, so a job's error never shows
    where the server keeps its files."""
    for name, path in (roots or {}).items():
        text = text.replace(os.path.abspath(path), name)
    return _SERVER_DIRS.sub("", text)


class QueueFull(Exception):
    """A submission found ``queued`` jobs waiting, the most the server takes."""

    def __init__(self, queued: int) -> None:
        super().__init__(f"{queued} jobs queued")
        self.queued = queued


class JobStore:
    """Job rows in a SQLite file, shared by the server's threads and the worker processes."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(
                f"{self.path}: cannot create the job database's folder ({err.strerror}); point ICR_JOBS_DB "
                "at a file in a writable folder"
            ) from None
        try:
            with self._connect() as db:
                version = db.execute("PRAGMA user_version").fetchone()[0]
                tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if version not in (0, 1, SCHEMA_VERSION) or (version == 0 and tables - {"jobs"}):
                    raise ValueError(f"schema version {version} with tables {sorted(tables)}")
                if version == 1:
                    db.executescript(_MIGRATE_1)
                db.executescript(_SCHEMA)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except (sqlite3.DatabaseError, ValueError) as err:
            raise ValueError(
                f"{self.path}: not a job database of this version ({err}); point ICR_JOBS_DB at another file "
                "or move this one away"
            ) from None

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # A connection per operation: safe across threads and processes, and WAL lets readers
        # (GET /v1/benchmarks) proceed while a worker writes.
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA busy_timeout=30000")
            db.row_factory = sqlite3.Row
            yield db
        finally:
            db.close()

    @staticmethod
    def _row(row: sqlite3.Row, with_report: bool) -> JobRow:
        """A ``SELECT *`` row as a JobRow; its report is parsed only ``with_report`` (it can run to
        megabytes, and neither the list nor the runner needs it)."""
        return JobRow(
            id=row["id"],
            status=row["status"],
            dataset=row["dataset"],
            split=row["split"],
            protocol=row["protocol"],
            distractors=row["distractors"],
            progress=row["progress"],
            stage=row["stage"],
            created_at=row["created_at"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            error=row["error"],
            metrics=_parsed("metrics", row["metrics"]),
            report=_parsed("report", row["report"]) if with_report else None,
            attempt=row["attempt"],
            pid=row["pid"],
            lease_owner=row["lease_owner"],
            lease_until=row["lease_until"],
        )

    def submit(
        self, dataset: str, split: str, protocol: str, distractors: int, max_queued: int | None = None
    ) -> JobRow:
        """Queue a job; with ``max_queued``, QueueFull when that many already wait (counted and
        inserted in one transaction: concurrent submissions, or replicas, cannot overfill the queue)."""
        job_id = uuid.uuid4().hex
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                if max_queued is not None:
                    queued = int(
                        db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued'").fetchone()[0]
                    )
                    if queued >= max_queued:
                        raise QueueFull(queued)
                db.execute(
                    "INSERT INTO jobs (id, status, dataset, split, protocol, distractors, created_at) "
                    "VALUES (?, 'queued', ?, ?, ?, ?, ?)",
                    (job_id, dataset, split, protocol, int(distractors), _now()),
                )
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        job = self.get(job_id)
        assert job is not None
        return job

    def get(self, job_id: str, with_report: bool = True) -> JobRow | None:
        """The job ``job_id`` (without its report unless ``with_report``), or None when there is none."""
        with self._connect() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return None if row is None else self._row(row, with_report)

    def list(self, limit: int = 50) -> list[JobRow]:
        """The ``limit`` newest jobs, newest first, without their reports."""
        with self._connect() as db:
            rows = db.execute("SELECT * FROM jobs ORDER BY created_at DESC, rowid DESC LIMIT ?", (limit,))
            return [self._row(r, with_report=False) for r in rows]

    def claim_next(self, owner: str = "", lease_s: float = 60.0) -> JobRow | None:
        """The oldest queued job, now running under a new attempt number and ``owner``'s lease of
        ``lease_s`` seconds (atomic: of several servers polling one database, one gets it)."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute(
                "SELECT id FROM jobs WHERE status = 'queued' ORDER BY created_at, rowid LIMIT 1"
            ).fetchone()
            if row is None:
                db.execute("COMMIT")
                return None
            db.execute(
                "UPDATE jobs SET status = 'running', attempt = attempt + 1, started_at = ?, progress = 0, "
                "stage = 'starting', lease_owner = ?, lease_until = ? WHERE id = ?",
                (_now(), owner, time.time() + lease_s, row["id"]),
            )
            # read before COMMIT: the row as this claim left it (attempt, lease), not as a cancel or
            # another server's reap may have changed it a moment later
            job = self._row(db.execute("SELECT * FROM jobs WHERE id = ?", (row["id"],)).fetchone(), False)
            db.execute("COMMIT")
            return job

    def _update_running(self, job_id: str, attempt: int, sets: str, values: tuple[_SqlValue, ...]) -> bool:
        with self._connect() as db:
            cursor = db.execute(
                f"UPDATE jobs SET {sets} WHERE id = ? AND status = 'running' AND attempt = ?",
                (*values, job_id, attempt),
            )
            return cursor.rowcount == 1

    def set_pid(self, job_id: str, attempt: int, pid: int) -> bool:
        return self._update_running(job_id, attempt, "pid = ?", (pid,))

    def set_progress(self, job_id: str, attempt: int, fraction: float, stage: str) -> bool:
        return self._update_running(
            job_id, attempt, "progress = ?, stage = ?", (min(1.0, max(0.0, float(fraction))), stage)
        )

    def succeed(self, job_id: str, attempt: int, metrics: dict[str, Any], report: dict[str, Any]) -> bool:
        return self._update_running(
            job_id,
            attempt,
            "status = 'succeeded', progress = 1, stage = 'done', finished_at = ?, metrics = ?, report = ?",
            (_now(), _json(metrics), _json(report)),
        )

    def fail(
        self,
        job_id: str,
        attempt: int,
        message: str,
        roots: Mapping[str, str | os.PathLike[str]] | None = None,
    ) -> bool:
        """Mark the job failed with ``message``, which clients read: ``roots`` (``{name: path}``)
        become their names and other absolute server paths their last part (see
        :func:`without_server_paths`)."""
        return self._update_running(
            job_id,
            attempt,
            "status = 'failed', finished_at = ?, error = ?",
            (_now(), without_server_paths(message, roots)),
        )

    def interrupt(self, job_id: str, attempt: int, reason: str) -> bool:
        return self._update_running(
            job_id,
            attempt,
            "status = 'interrupted', finished_at = ?, error = ?",
            (_now(), RESTART_MESSAGE.format(reason=reason)),
        )

    def renew(self, job_id: str, attempt: int, owner: str, lease_s: float) -> bool:
        """Extend ``owner``'s lease; False when the job is no longer running under it (cancelled,
        or interrupted by another server after the lease ran out)."""
        with self._connect() as db:
            cursor = db.execute(
                "UPDATE jobs SET lease_until = ? WHERE id = ? AND attempt = ? AND status = 'running' "
                "AND lease_owner = ?",
                (time.time() + lease_s, job_id, attempt, owner),
            )
            return cursor.rowcount == 1

    def reap(self, alive: Callable[[str], bool] = lambda _owner: True) -> int:
        """Mark interrupted every running job whose lease has expired, has no lease (a job of an older
        server), or whose owner ``alive`` says is gone; the number marked."""
        now = time.time()
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            rows = db.execute("SELECT id, lease_owner, lease_until FROM jobs WHERE status = 'running'")
            cut = [
                r["id"]
                for r in rows.fetchall()
                if r["lease_until"] is None or r["lease_until"] < now or not alive(r["lease_owner"] or "")
            ]
            message = RESTART_MESSAGE.format(reason="its server was stopped or restarted: no lease renewal")
            for job_id in cut:
                db.execute(
                    "UPDATE jobs SET status = 'interrupted', finished_at = ?, error = ? WHERE id = ?",
                    (_now(), message, job_id),
                )
            db.execute("COMMIT")
            return len(cut)

    def cancel(self, job_id: str) -> JobRow | None:
        """Cancel a queued or running job (a running one's owner stops its worker at its next
        renewal); the job as it is now, or None when there is no such job. A finished job is
        left as it is."""
        with self._connect() as db:
            db.execute(
                "UPDATE jobs SET status = 'cancelled', finished_at = ?, error = 'cancelled by a client' "
                "WHERE id = ? AND status IN ('queued', 'running')",
                (_now(), job_id),
            )
        return self.get(job_id, with_report=False)

    def purge(self, older_than_days: float) -> int:
        """Delete finished jobs that finished more than ``older_than_days`` ago; the number deleted."""
        cutoff = datetime.fromtimestamp(time.time() - older_than_days * 86400, UTC)
        cutoff_text = cutoff.isoformat(timespec="seconds")
        marks = ",".join("?" * len(FINISHED))
        with self._connect() as db:
            cursor = db.execute(
                f"DELETE FROM jobs WHERE status IN ({marks}) AND finished_at < ?", (*FINISHED, cutoff_text)
            )
            return cursor.rowcount


def owner_alive(owner: str) -> bool:
    """Whether a lease's owner (``host:pid:runner``) may still be running: a process on this host is
    checked; one elsewhere is trusted until its lease expires. An owner without that form is gone."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if not host or not pid_text.isdigit():
        return False
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process of that number: alive
        return True
    return True


class JobRunner:
    """One background thread running queued jobs one at a time, each in a worker process.

    The worker lowers its own priority (``nice``: search requests come first), runs in its own
    session (a Ctrl-C meant for the server reaches the server only, which then interrupts the job
    cleanly) and dies with the thread that started it (Linux parent-death signal).
    """

    def __init__(
        self,
        store: JobStore,
        checkpoint: Path,
        datasets: dict[str, Path],
        device: str = "cpu",
        nice: int = 10,
        poll_s: float = 5.0,
        lease_s: float = 60.0,
        retention_days: float = 30.0,
    ):
        self.store = store
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lease_s = lease_s  # renewed every lease_s / 3 while a worker runs
        self.retention_days = retention_days
        self.checkpoint = Path(checkpoint)
        self.datasets = {name: Path(path) for name, path in datasets.items()}
        self.device = device
        self.nice = nice
        self.poll_s = poll_s  # also picks up jobs that another process queued
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._current: tuple[str, int] | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self._housekeeping()
        self._thread = threading.Thread(target=self._loop, name="icr-jobs", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Look for queued jobs now (call after a submit)."""
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop taking jobs; terminate a running worker (SIGTERM, then SIGKILL after ``timeout``)
        and mark its job interrupted. Queued jobs stay queued for the next start."""
        self._stopping.set()
        self._wake.set()
        with self._lock:
            process, current = self._process, self._current
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if current is not None:
            self.store.interrupt(*current, reason="server shut down")
        if self._thread is not None:
            self._thread.join(timeout)

    def _housekeeping(self) -> None:
        """Interrupt the jobs whose server is gone; delete finished jobs past the retention."""
        self._reap()
        self.store.purge(self.retention_days)

    def _reap(self) -> None:
        cut_off = self.store.reap(owner_alive)
        if cut_off:
            log.warning("%d benchmark job(s) lost their server; marked interrupted", cut_off)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self._housekeeping()
                job = self.store.claim_next(self.owner, self.lease_s)
            except Exception:  # e.g. the database is locked for longer than busy_timeout
                log.exception("claiming a benchmark job")
                self._stopping.wait(self.poll_s)
                continue
            if job is None:
                self._wake.wait(timeout=self.poll_s)
                self._wake.clear()
                continue
            try:
                self._run(job)
            except Exception as err:  # the thread must survive anything one job does
                log.exception("benchmark job %s", job.id)
                self.store.fail(job.id, job.attempt, f"the runner failed: {type(err).__name__}: {err}")

    def command(self, job_id: str, attempt: int, data: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "icr.service.benchmark_worker",
            "--db",
            os.path.abspath(self.store.path),
            "--job",
            job_id,
            "--attempt",
            str(attempt),
            "--checkpoint",
            os.path.abspath(self.checkpoint),
            "--data",
            os.path.abspath(data),
            "--device",
            self.device,
            "--nice",
            str(self.nice),
            "--parent-pid",
            str(os.getpid()),
        ]

    def _run(self, job: JobRow) -> None:
        job_id, attempt = job.id, job.attempt
        data = self.datasets.get(job.dataset)
        if data is None:  # configured at submission, gone after a restart with other settings
            self.store.fail(job_id, attempt, f"dataset {job.dataset!r} is no longer configured on the server")
            return
        with self._lock:
            if self._stopping.is_set():
                self.store.interrupt(job_id, attempt, reason="server shut down")
                return
            # No preexec_fn (unsafe in a threaded server): the worker renices itself. Its stderr goes
            # to a file: a pipe nobody reads while the lease is renewed could fill and block it.
            errors = tempfile.TemporaryFile()
            self._process = subprocess.Popen(
                self.command(job_id, attempt, data),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=errors,
                start_new_session=True,
            )
            self._current = (job_id, attempt)
        process = self._process
        self.store.set_pid(job_id, attempt, process.pid)
        cancelled = False
        while True:
            try:
                process.wait(self.lease_s / 3)
                break
            except subprocess.TimeoutExpired:
                if cancelled:
                    process.kill()  # it did not stop within a third of the lease after SIGTERM
                elif not self.store.renew(job_id, attempt, self.owner, self.lease_s):
                    cancelled = True  # cancelled by a client (or interrupted by a server that saw it expire)
                    log.info("benchmark job %s is no longer ours; stopping its worker", job_id)
                    process.terminate()
                else:  # busy with a job, this server still notices other servers' lost jobs
                    self._reap()
        code = process.returncode
        errors.seek(0)
        stderr = errors.read()
        errors.close()
        with self._lock:
            self._process, self._current = None, None
        if self._stopping.is_set() or cancelled:
            return  # stop() marked the job interrupted; a cancelled job keeps its mark
        if code == 0:
            reason = "without writing a result"
        elif code < 0:
            try:
                reason = f"with signal {signal.Signals(-code).name}"
            except ValueError:
                reason = f"with signal {-code}"
        else:
            reason = f"with exit status {code}"
        text = stderr.decode(errors="replace").strip()
        if code != 0 and text:
            log.warning("benchmark job %s: the worker ended with code %s:\n%s", job_id, code, text[-20000:])
        tail = text.splitlines()[-5:]
        # a no-op when the worker recorded its result or its own failure
        self.store.fail(
            job_id,
            attempt,
            f"the benchmark process ended {reason}" + (": " + " | ".join(tail) if tail else ""),
        )
