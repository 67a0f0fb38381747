"""Benchmark jobs: their state in SQLite, and a runner that executes them one at a time.

Each job runs in its own low-priority process (``service.benchmark_worker``): evaluation is
CPU-heavy numpy/torch work that would otherwise hold the GIL and the cores the search requests
need, and a crash in it must not take the server down. The worker writes progress and results
into the same SQLite file; every worker write names the job's ``attempt`` and only applies while
the job is still ``running`` under that attempt, so a worker orphaned by a server crash can never
overwrite the ``interrupted`` mark the restarted server gave its job.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("icr.service")
SCHEMA_VERSION = 1
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
    pid INTEGER
);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created_at);
"""
_PUBLIC = (
    "id",
    "status",
    "dataset",
    "split",
    "protocol",
    "distractors",
    "progress",
    "stage",
    "created_at",
    "started_at",
    "finished_at",
    "error",
    "metrics",
)
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
                if version not in (0, SCHEMA_VERSION) or (version == 0 and tables - {"jobs"}):
                    raise ValueError(f"schema version {version} with tables {sorted(tables)}")
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
    def _row(row: sqlite3.Row | None, with_report: bool) -> dict[str, Any] | None:
        if row is None:
            return None
        job = {key: row[key] for key in _PUBLIC}
        job["metrics"] = None if row["metrics"] is None else json.loads(row["metrics"])
        if with_report:
            job["report"] = None if row["report"] is None else json.loads(row["report"])
        return job

    def submit(self, dataset: str, split: str, protocol: str, distractors: int) -> dict[str, Any]:
        job_id = uuid.uuid4().hex
        with self._connect() as db:
            db.execute(
                "INSERT INTO jobs (id, status, dataset, split, protocol, distractors, created_at) "
                "VALUES (?, 'queued', ?, ?, ?, ?, ?)",
                (job_id, dataset, split, protocol, int(distractors), _now()),
            )
        job = self.get(job_id)
        assert job is not None
        return job

    def get(self, job_id: str, with_report: bool = True) -> dict[str, Any] | None:
        with self._connect() as db:
            return self._row(db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone(), with_report)

    def list(self, limit: int = 50) -> list[dict[str, Any]]:
        with self._connect() as db:
            rows = db.execute("SELECT * FROM jobs ORDER BY created_at DESC, rowid DESC LIMIT ?", (limit,))
            return [self._row(r, with_report=False) for r in rows]

    def claim_next(self) -> dict[str, Any] | None:
        """The oldest queued job, now running under a new attempt number (atomic)."""
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
                "stage = 'starting' WHERE id = ?",
                (_now(), row["id"]),
            )
            db.execute("COMMIT")
            job = self._row(db.execute("SELECT * FROM jobs WHERE id = ?", (row["id"],)).fetchone(), False)
            job["attempt"] = db.execute("SELECT attempt FROM jobs WHERE id = ?", (row["id"],)).fetchone()[0]
            return job

    def _update_running(self, job_id: str, attempt: int, sets: str, values: tuple[Any, ...]) -> bool:
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

    def fail(self, job_id: str, attempt: int, message: str) -> bool:
        return self._update_running(
            job_id, attempt, "status = 'failed', finished_at = ?, error = ?", (_now(), message)
        )

    def interrupt(self, job_id: str, attempt: int, reason: str) -> bool:
        return self._update_running(
            job_id,
            attempt,
            "status = 'interrupted', finished_at = ?, error = ?",
            (_now(), RESTART_MESSAGE.format(reason=reason)),
        )

    def interrupt_running(self, reason: str) -> int:
        """Mark every running job interrupted (at start-up: they were cut off by the last stop)."""
        with self._connect() as db:
            cursor = db.execute(
                "UPDATE jobs SET status = 'interrupted', finished_at = ?, error = ? WHERE status = 'running'",
                (_now(), RESTART_MESSAGE.format(reason=reason)),
            )
            return cursor.rowcount


def _worker_env() -> dict[str, str]:
    """This environment, with the folder this ``service`` package was imported from on the path
    (``-m service.benchmark_worker`` then works uninstalled and from any working directory)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


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
    ):
        self.store = store
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
        cut_off = self.store.interrupt_running("restart")
        if cut_off:
            log.warning("%d benchmark job(s) were cut off by the last stop; marked interrupted", cut_off)
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

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self.store.claim_next()
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
                log.exception("benchmark job %s", job["id"])
                self.store.fail(job["id"], job["attempt"], f"the runner failed: {type(err).__name__}: {err}")

    def command(self, job_id: str, attempt: int, data: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "service.benchmark_worker",
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

    def _run(self, job: dict[str, Any]) -> None:
        job_id, attempt = job["id"], job["attempt"]
        data = self.datasets.get(job["dataset"])
        if data is None:  # configured at submission, gone after a restart with other settings
            self.store.fail(
                job_id, attempt, f"dataset {job['dataset']!r} is no longer configured on the server"
            )
            return
        with self._lock:
            if self._stopping.is_set():
                self.store.interrupt(job_id, attempt, reason="server shut down")
                return
            # No preexec_fn (unsafe in a threaded server): the worker renices itself.
            self._process = subprocess.Popen(
                self.command(job_id, attempt, data),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=_worker_env(),
            )
            self._current = (job_id, attempt)
        self.store.set_pid(job_id, attempt, self._process.pid)
        _, stderr = self._process.communicate()
        code = self._process.returncode
        with self._lock:
            self._process, self._current = None, None
        if self._stopping.is_set():
            return  # stop() marked the job interrupted
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
