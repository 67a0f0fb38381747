"""Benchmark job state in SQLite: transitions, the attempt guard against stale workers, restarts,
and the runner with a real worker process (a job that fails says why)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from service.benchmark_worker import headline
from service.jobs import JobRunner, JobStore


def test_a_job_goes_from_queued_to_succeeded_with_its_results(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite")
    job = store.submit("synthetic", "test", "full", 0)
    assert (job["status"], job["progress"], job["metrics"], job["report"]) == ("queued", 0.0, None, None)
    claimed = store.claim_next()
    assert claimed["id"] == job["id"] and claimed["status"] == "running" and claimed["attempt"] == 1
    assert store.claim_next() is None  # one running, none queued
    assert store.set_progress(job["id"], 1, 0.4, "metrics")
    assert store.get(job["id"])["stage"] == "metrics"
    assert store.succeed(job["id"], 1, {"annotations": {"rsum": 12.5}}, {"format": "icr-evaluation"})
    done = store.get(job["id"])
    assert done["status"] == "succeeded" and done["progress"] == 1.0 and done["finished_at"]
    assert done["metrics"] == {"annotations": {"rsum": 12.5}} and done["report"] == {
        "format": "icr-evaluation"
    }
    assert store.list()[0]["id"] == job["id"] and "report" not in store.list()[0]


def test_jobs_are_claimed_oldest_first_and_each_once(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite")
    ids = [store.submit("synthetic", "test", "full", i)["id"] for i in range(6)]
    claimed: list[str] = []
    lock = threading.Lock()

    def claim() -> None:
        while (job := JobStore(tmp_path / "jobs.sqlite").claim_next()) is not None:
            with lock:
                claimed.append(job["id"])

    threads = [threading.Thread(target=claim) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == sorted(ids) and len(claimed) == len(set(claimed))
    assert [j["id"] for j in store.list()] == ids[::-1]  # newest first


def test_a_stale_worker_cannot_overwrite_an_interrupted_job(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite")
    job = store.submit("synthetic", "test", "full", 0)
    store.claim_next()
    assert store.interrupt_running("restart") == 1
    cut = store.get(job["id"])
    assert cut["status"] == "interrupted" and "submit it again" in cut["error"] and "restart" in cut["error"]
    # the orphaned worker (attempt 1) finishes later: nothing changes
    assert not store.set_progress(job["id"], 1, 0.9, "metrics")
    assert not store.succeed(job["id"], 1, {"x": 1}, {})
    assert not store.fail(job["id"], 1, "late")
    assert store.get(job["id"])["status"] == "interrupted"
    assert store.interrupt_running("restart") == 0


def test_a_file_that_is_not_a_job_database_is_named(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE other (x)")
    with pytest.raises(ValueError, match="jobs.sqlite: not a job database"):
        JobStore(path)
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not sqlite at all, " * 100)
    with pytest.raises(ValueError, match="ICR_JOBS_DB"):
        JobStore(junk)


def test_headline_picks_retrieval_and_global_figures() -> None:
    section = {
        "retrieval": {"rsum": 100.0, "i2t_r1": 10.0, "i2t_medr": 3},
        "global": {"pr_auc": 0.2, "pairs": 9},
    }
    picked = headline({"annotations": section, "distractors": {"count": 5}})
    assert picked == {
        "annotations": {"rsum": 100.0, "i2t_r1": 10.0, "pr_auc": 0.2},
        "distractors": {"count": 5},
    }


def _wait(store: JobStore, job_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = store.get(job_id)
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job still {job['status']}")


def test_the_runner_fails_a_job_whose_checkpoint_is_missing_and_keeps_going(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite")
    data = tmp_path / "data"
    runner = JobRunner(store, tmp_path / "no-checkpoint", {"synthetic": data}, nice=0)
    first = store.submit("synthetic", "test", "full", 0)
    gone = store.submit("coco", "test", "full", 0)  # a dataset configured at submission, gone since
    runner.start()
    try:
        runner.wake()
        failed = _wait(store, first["id"])
        assert failed["status"] == "failed" and "no-checkpoint" in failed["error"], failed
        assert "no longer configured" in _wait(store, gone["id"])["error"]
    finally:
        runner.stop()
