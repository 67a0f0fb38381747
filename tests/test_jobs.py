"""Benchmark jobs: the SQLite job store, the runner with real worker processes, and the routes.

The store is checked for its transitions, the attempt guard (a stale worker's writes are ignored),
atomic oldest-first claiming under concurrent claimers, and refusing a file that is not its
database. The runner runs real ``icr.service.benchmark_worker`` processes on a 16/8/8-image embedded
benchmark with a tiny model trained for one step: a job that succeeds, one cut off by ``stop()``,
one with a broken checkpoint, and workers that crash or exit without a result. The routes run in a
bare app (no model or index) for their submission checks and the API-key rule.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from tiny_model import TINY_MODEL

from icr.service.access import AccessMiddleware
from icr.service.benchmark_worker import headline
from icr.service.config import Settings
from icr.service.errors import install_error_handlers
from icr.service.jobs import JobRow, JobRunner, JobStore, owner_alive
from icr.service.routes import benchmarks
from icr.training.config import load_config
from icr.training.data.synthetic.generate import write_dataset

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """(data, checkpoint): a tiny embedded benchmark and a tiny model trained for one step."""
    from icr.training.train import train

    root = tmp_path_factory.mktemp("jobs")
    write_dataset(root / "data", train=16, val=8, test=8, image_size=32, seed=0)
    cfg = load_config(None, [
        f'data.path="{root / "data"}"', f'train.out="{root / "run"}"', "train.batch_size=8",
        "train.epochs=1", "train.max_steps=1", "data.val_images=8", "train.threads=1", *TINY_MODEL,
    ])  # fmt: skip
    train(cfg, progress=False)
    return root / "data", root / "run" / "last"


@pytest.fixture
def store(tmp_path) -> JobStore:
    return JobStore(tmp_path / "jobs.sqlite")


def _wait(store: JobStore, job_id: str, until, timeout: float = 60.0) -> JobRow:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = store.get(job_id)
        if until(job):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never got there: {job}")


def _finished(job: JobRow) -> bool:
    return job.status in ("succeeded", "failed", "interrupted", "cancelled")


# --- the store -------------------------------------------------------------------------------


def test_a_job_goes_from_queued_to_succeeded(store):
    job = store.submit("synthetic", "test", "full", 0)
    benchmarks.job_body(job)  # the rows are the API's bodies
    assert job.status == "queued" and len(job.id) == 32 and job.progress == 0.0
    assert job.created_at.endswith("+00:00") and job.started_at is None and job.report is None

    claimed = store.claim_next()
    assert (claimed.id, claimed.status, claimed.attempt) == (job.id, "running", 1)
    assert claimed.started_at and claimed.stage == "starting"
    assert store.claim_next() is None  # nothing else queued

    assert store.set_progress(job.id, 1, 1.7, "metrics")  # clamped into [0, 1]
    assert (store.get(job.id).progress, store.get(job.id).stage) == (1.0, "metrics")
    assert store.set_progress(job.id, 1, -3, "embedding") and store.get(job.id).progress == 0.0

    report = {"annotations": {"retrieval": {"rsum": np.float64(300.5), "t2i_r1": float("nan")}},
              "counts": np.arange(3), "n": np.int64(8)}  # fmt: skip
    assert store.succeed(job.id, 1, {"rsum": 300.5, "pr_auc": float("inf")}, report)
    done = store.get(job.id)
    assert done.status == "succeeded" and done.progress == 1.0 and done.finished_at
    assert done.metrics == {"rsum": 300.5, "pr_auc": None}  # strict JSON: NaN/inf become null
    assert done.report == {"annotations": {"retrieval": {"rsum": 300.5, "t2i_r1": None}},
                              "counts": [0, 1, 2], "n": 8}  # fmt: skip
    assert store.get(job.id, with_report=False).report is None  # not read: it has one (above)
    benchmarks.job_body(done)
    # a finished job takes no more writes, even from its own attempt
    assert not store.fail(job.id, 1, "late") and store.get(job.id).status == "succeeded"


def test_list_is_newest_first_without_reports(store):
    ids = [store.submit("synthetic", split, "full", 0).id for split in ("test", "val", "train")]
    job = store.claim_next()
    store.succeed(job.id, job.attempt, {"rsum": 1.0}, {"big": list(range(10))})
    listed = store.list()
    assert [j.id for j in listed] == ids[::-1]
    assert all(j.report is None for j in listed) and listed[-1].metrics == {"rsum": 1.0}
    assert [j.id for j in store.list(limit=2)] == ids[:0:-1]
    assert store.get("no-such-job") is None


def test_a_stale_attempt_cannot_write(store):
    job = store.submit("synthetic", "test", "full", 0)
    attempt = store.claim_next().attempt
    assert not store.set_progress(job.id, attempt + 1, 0.5, "metrics")  # someone else's attempt
    assert store.reap(owner_alive) == 1  # its owner ("": no server) is gone
    cut = store.get(job.id)
    assert cut.status == "interrupted" and cut.finished_at
    assert "(its server was stopped or restarted: no lease renewal)" in cut.error
    assert "submit it again with POST /v1/benchmarks" in cut.error
    # the orphaned worker of that attempt goes on writing: all ignored
    assert not store.set_progress(job.id, attempt, 0.9, "distractors")
    assert not store.succeed(job.id, attempt, {"rsum": 1.0}, {})
    assert not store.fail(job.id, attempt, "boom")
    assert store.get(job.id) == cut
    assert store.reap(owner_alive) == 0


def test_claims_are_atomic_and_oldest_first(tmp_path):
    first = JobStore(tmp_path / "jobs.sqlite")
    ids = [first.submit("synthetic", "test", "full", i).id for i in range(24)]
    # several threads, each with its own JobStore (as the worker processes have), claim at once
    claimed: list[tuple[float, str]] = []
    lock = threading.Lock()

    def claim() -> None:
        mine = JobStore(tmp_path / "jobs.sqlite")
        while (job := mine.claim_next()) is not None:
            with lock:
                claimed.append((time.monotonic(), job.id))

    threads = [threading.Thread(target=claim) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for _, i in claimed) == sorted(ids)  # every job exactly once
    assert {j.status for j in first.list(limit=100)} == {"running"}

    # one claimer takes them in submission order, also within the same second
    again = JobStore(tmp_path / "again.sqlite")
    ids = [again.submit("synthetic", "test", "full", i).id for i in range(5)]
    assert [again.claim_next().id for _ in ids] == ids


def test_a_file_that_is_not_the_job_database_is_refused(tmp_path):
    junk = tmp_path / "index.faiss"
    junk.write_bytes(b"not sqlite at all, " * 100)
    with pytest.raises(ValueError, match=r"index\.faiss: not a job database.*ICR_JOBS_DB"):
        JobStore(junk)
    other = tmp_path / "metadata.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE images (id INTEGER)")
    with pytest.raises(ValueError, match="metadata.sqlite"):
        JobStore(other)
    newer = tmp_path / "newer.sqlite"
    JobStore(newer).submit("synthetic", "test", "full", 0)
    with sqlite3.connect(newer) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(ValueError, match="schema version 99"):
        JobStore(newer)
    # reopening a database of this version keeps its jobs
    kept = tmp_path / "kept.sqlite"
    job = JobStore(kept).submit("synthetic", "test", "full", 0)
    assert JobStore(kept).get(job.id).status == "queued"


def test_a_running_job_is_interrupted_only_when_its_lease_is_gone(store, monkeypatch):
    import socket

    here = socket.gethostname()
    dead_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    owners = {
        "elsewhere": "another-host:1:a",  # another machine: trusted until its lease expires
        "alive": f"{here}:{os.getpid()}:b",  # this process: alive
        "dead": f"{here}:{dead_pid}:c",  # a process of this host that has exited: gone at once
        "legacy": "",  # no owner (a server of schema 1): gone
    }
    ids = {}
    for name, owner in owners.items():
        ids[name] = store.submit("synthetic", "test", "full", 0).id
        assert store.claim_next(owner, lease_s=60).id == ids[name]
    assert store.reap(owner_alive) == 2
    status = {name: store.get(i).status for name, i in ids.items()}
    assert status == {
        "elsewhere": "running",
        "alive": "running",
        "dead": "interrupted",
        "legacy": "interrupted",
    }
    assert "no lease renewal" in store.get(ids["dead"]).error
    # the owner renews; nobody else can; once the lease has run out another server takes it away
    assert store.renew(ids["elsewhere"], 1, owners["elsewhere"], 60)
    assert not store.renew(ids["elsewhere"], 1, owners["alive"], 60)
    assert store.renew(ids["elsewhere"], 1, owners["elsewhere"], -1)  # expired a second ago
    assert store.reap(owner_alive) == 1 and store.get(ids["elsewhere"]).status == "interrupted"
    assert not store.renew(ids["elsewhere"], 1, owners["elsewhere"], 60)  # its owner learns it lost it
    assert store.get(ids["alive"]).status == "running"


def test_cancel_queue_count_and_retention(store):
    queued = store.submit("synthetic", "test", "full", 0)
    running = store.submit("synthetic", "test", "full", 0)
    assert [job.status for job in store.list()].count("queued") == 2
    assert store.claim_next("me", 60).id == queued.id
    assert store.cancel(queued.id).status == "cancelled"  # running: its owner's renewal now fails
    assert not store.renew(queued.id, 1, "me", 60)
    assert not store.set_progress(queued.id, 1, 0.5, "x")  # the worker's writes are ignored
    assert store.cancel(running.id).status == "cancelled"  # queued: never claimed
    assert store.claim_next("me", 60) is None
    assert [job.status for job in store.list()].count("queued") == 0
    done = store.submit("synthetic", "test", "full", 0)
    store.claim_next("me", 60)
    assert store.succeed(done.id, 1, {}, {})
    assert store.cancel(done.id).status == "succeeded"  # finished: left as it is
    assert store.cancel("nope") is None
    fresh = store.submit("synthetic", "test", "full", 0)
    with sqlite3.connect(store.path) as db:  # two jobs finished 40 days ago
        db.execute(
            "UPDATE jobs SET finished_at = '2000-01-01T00:00:00+00:00' WHERE id IN (?, ?)",
            (queued.id, done.id),
        )
    assert store.purge(30) == 2
    assert [store.get(i) is None for i in (queued.id, done.id, running.id, fresh.id)] == [
        True,
        True,
        False,
        False,
    ]


def test_a_schema_1_database_is_migrated_and_its_running_job_interrupted(tmp_path):
    path = tmp_path / "v1.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript("""
            CREATE TABLE jobs (id TEXT PRIMARY KEY, status TEXT NOT NULL, dataset TEXT NOT NULL,
                split TEXT NOT NULL, protocol TEXT NOT NULL, distractors INTEGER NOT NULL,
                progress REAL NOT NULL DEFAULT 0, stage TEXT, created_at TEXT NOT NULL, started_at TEXT,
                finished_at TEXT, error TEXT, metrics TEXT, report TEXT, attempt INTEGER NOT NULL DEFAULT 0,
                pid INTEGER);
            INSERT INTO jobs (id, status, dataset, split, protocol, distractors, created_at, attempt)
                VALUES ('old', 'running', 'synthetic', 'test', 'full', 0, '2026-01-01T00:00:00+00:00', 1);
            PRAGMA user_version = 1;
        """)
    store = JobStore(path)
    assert store.get("old").status == "running"
    assert store.reap() == 1 and store.get("old").status == "interrupted"
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2


# --- the runner and its worker processes ------------------------------------------------------


@pytest.mark.slow
def test_the_runner_marks_cut_off_jobs_and_runs_queued_ones(store, tiny):
    data, checkpoint = tiny
    cut_off = store.submit("synthetic", "test", "full", 0)
    store.claim_next()  # 'running' when the previous server stopped
    queued = store.submit("synthetic", "test", "full", 3)
    runner = JobRunner(store, checkpoint, {"synthetic": data}, poll_s=0.2)
    runner.start()
    try:
        assert store.get(cut_off.id).status == "interrupted"
        later = store.submit("synthetic", "val", "full", 0)
        runner.wake()
        job = _wait(store, queued.id, _finished)
        assert job.status == "succeeded", job
        assert job.progress == 1.0 and job.stage == "done" and job.error is None
        with sqlite3.connect(store.path) as db:
            pid = db.execute("SELECT pid FROM jobs WHERE id = ?", (job.id,)).fetchone()[0]
        assert pid and pid != os.getpid()
        metrics, report = job.metrics, job.report
        assert set(metrics) == {"annotations", "ground_truth", "distractors"}
        for labels in ("annotations", "ground_truth"):
            assert report[labels]["retrieval"]["rsum"] == metrics[labels]["rsum"]
            assert 0 <= metrics[labels]["pr_auc"] <= 1 and 0 <= metrics[labels]["t2i_r10"] <= 100
        assert metrics["distractors"]["count"] == 3
        assert report["format"] == "icr-evaluation" and report["data"]["images"] == 8
        assert report["checkpoint"]["path"] == str(checkpoint)
        json.dumps(report, allow_nan=False)  # servable as is
        second = _wait(store, later.id, _finished)
        assert second.status == "succeeded" and second.report["data"]["split"] == "val"
    finally:
        runner.stop()
    assert store.get(cut_off.id).status == "interrupted"  # still: nobody ran it


def test_stop_in_the_middle_interrupts_the_job_and_ends_its_process(store, tiny):
    data, checkpoint = tiny
    runner = JobRunner(store, checkpoint, {"synthetic": data}, poll_s=0.2)
    runner.start()
    job = store.submit("synthetic", "test", "full", 200_000)  # the distractors take minutes
    queued = store.submit("synthetic", "test", "full", 0)
    runner.wake()
    running = _wait(store, job.id, lambda j: j.status == "running" and j.stage == "distractors")
    assert 0 < running.progress < 1
    with sqlite3.connect(store.path) as db:
        pid, attempt = db.execute("SELECT pid, attempt FROM jobs WHERE id = ?", (job.id,)).fetchone()
    t0 = time.monotonic()
    runner.stop(timeout=5)
    assert time.monotonic() - t0 < 6
    cut = store.get(job.id)
    assert cut.status == "interrupted" and "server shut down" in cut.error, cut
    assert cut.metrics is None and cut.finished_at
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the worker is gone (and reaped)
    assert not store.succeed(job.id, attempt, {}, {})
    assert store.get(queued.id).status == "queued"  # left for the next start


def test_a_broken_checkpoint_fails_the_job_with_a_message(store, tiny, tmp_path):
    data, _ = tiny
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    runner = JobRunner(store, broken, {"synthetic": data}, poll_s=0.2)
    runner.start()
    try:
        job = store.submit("synthetic", "test", "full", 0)
        runner.wake()
        failed = _wait(store, job.id, _finished)
    finally:
        runner.stop()
    assert failed.status == "failed" and failed.metrics is None and failed.report is None
    # names the file, relative to the checkpoint: never where the server keeps it
    assert "\n" not in failed.error and "checkpoint/config.json" in failed.error, failed.error
    assert str(tmp_path) not in failed.error
    assert failed.error.split(":")[0].isidentifier()  # "ValueError: ...", not a traceback


class _Scripted(JobRunner):
    """A runner whose worker is a given Python snippet (crashes the real worker cannot stage)."""

    def __init__(self, store: JobStore, script: str):
        super().__init__(store, Path("unused"), {"synthetic": Path("unused")}, poll_s=0.2)
        self.script = script

    def command(self, _job_id: str, _attempt: int, _data: Path) -> list[str]:
        return [sys.executable, "-c", self.script]


@pytest.mark.parametrize(
    ("script", "says"),
    [
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "ended with signal SIGKILL"),
        ("import sys; print('out of memory here', file=sys.stderr); sys.exit(3)",
         "ended with exit status 3: out of memory here"),
        ("pass", "ended without writing a result"),
    ],
)  # fmt: skip
def test_a_worker_that_dies_without_a_result_fails_its_job(store, script, says):
    runner = _Scripted(store, script)
    runner.start()
    try:
        job = store.submit("synthetic", "test", "full", 0)
        runner.wake()
        failed = _wait(store, job.id, _finished, timeout=20)
    finally:
        runner.stop()
    assert failed.status == "failed" and says in failed.error, failed.error


def test_a_dataset_no_longer_configured_fails_the_job(store):
    job = store.submit("coco", "test", "full", 0)
    runner = JobRunner(store, Path("unused"), {"synthetic": Path("unused")}, poll_s=0.2)
    runner.start()
    try:
        failed = _wait(store, job.id, _finished, timeout=20)
    finally:
        runner.stop()
    assert failed.status == "failed" and "'coco' is no longer configured" in failed.error


_SERVER = """
import sys, time
from pathlib import Path
from icr.service.jobs import JobRunner, JobStore
runner = JobRunner(JobStore(sys.argv[1]), Path(sys.argv[2]), {"synthetic": Path(sys.argv[3])}, poll_s=0.1)
runner.start()
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie nobody reaped (no init in a container) counts as dead


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_a_killed_server_takes_its_worker_along(store, tiny):
    data, checkpoint = tiny
    job = store.submit("synthetic", "test", "full", 200_000)
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(store.path), str(checkpoint), str(data)])
    try:
        _wait(store, job.id, lambda j: j.stage == "distractors")
        with sqlite3.connect(store.path) as db:
            pid = db.execute("SELECT pid FROM jobs WHERE id = ?", (job.id,)).fetchone()[0]
        assert _alive(pid)
    finally:
        server.kill()  # no shutdown: SIGKILL
        server.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    assert store.get(job.id).status == "running"  # until a server sees its owner is gone
    assert store.reap(owner_alive) == 1


def test_a_worker_whose_server_is_gone_does_nothing(store):
    job = store.submit("synthetic", "test", "full", 0)
    attempt = store.claim_next().attempt
    command = [
        sys.executable,
        "-m",
        "icr.service.benchmark_worker",
        "--db",
        str(store.path),
        "--job",
        job.id,
        "--attempt",
        str(attempt),
        "--checkpoint",
        "x",
        "--data",
        "y",
        "--parent-pid",
        "1",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert store.get(job.id).stage == "starting"  # not even 'loading checkpoint'


# --- the routes ------------------------------------------------------------------------------


class _Runner:
    woken = 0

    def wake(self) -> None:
        self.woken += 1


@pytest.fixture
def app(tiny, tmp_path) -> FastAPI:
    data, _ = tiny
    precomp = tmp_path / "coco_precomp"
    precomp.mkdir()
    for split in ("dev", "testall"):
        np.save(precomp / f"{split}_ims.npy", np.zeros((2, 4), np.float32))
        (precomp / f"{split}_caps.txt").write_text("a\nb\n")
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(benchmarks.router)
    app.add_middleware(AccessMiddleware)
    app.state.settings = Settings(
        index=tmp_path / "index",
        datasets={"synthetic": data, "coco": precomp},
        max_benchmark_distractors=1000,
    )
    app.state.jobs = JobStore(tmp_path / "jobs.sqlite")
    app.state.runner = _Runner()
    return app


def test_routes_submit_list_and_get(app):
    local = TestClient(app, client=("127.0.0.1", 40000))
    r = local.post("/v1/benchmarks", json={"dataset": "synthetic", "split": "val", "distractors": 10})
    assert r.status_code == 202, r.text
    job = r.json()
    assert (job["status"], job["split"], job["distractors"], job["protocol"]) == ("queued", "val", 10, "full")
    assert app.state.runner.woken == 1
    assert local.post("/v1/benchmarks", json={"dataset": "coco", "split": "testall"}).status_code == 202
    listed = local.get("/v1/benchmarks").json()["jobs"]
    assert [j["dataset"] for j in listed] == ["coco", "synthetic"] and listed[1]["report"] is None
    assert local.get(f"/v1/benchmarks/{job['id']}").json() == job
    missing = local.get("/v1/benchmarks/feedface")
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"
    assert local.get("/v1/benchmarks", params={"limit": 501}).status_code == 422


def test_routes_check_submissions(app):
    local = TestClient(app, client=("::1", 40000))
    cases = [
        ({"dataset": "flickr30k"}, 404, "configured: coco, synthetic"),
        ({"dataset": "flickr30k"}, 404, "ICR_DATASETS"),
        ({"dataset": "synthetic", "split": "dev"}, 422, "has test, train, val"),
        ({"dataset": "coco", "split": "test"}, 422, "has dev, testall"),
        ({"dataset": "coco", "split": "dev", "distractors": 5}, 422, "synthetic dataset only"),
        ({"dataset": "synthetic", "distractors": 1001}, 422, "at most 1000 (ICR_MAX_BENCHMARK_DISTRACTORS)"),
        ({"dataset": "synthetic", "protocol": "10k"}, 422, "protocol"),
    ]
    for body, status, says in cases:
        r = local.post("/v1/benchmarks", json=body)
        assert r.status_code == status and says in r.json()["message"], (body, r.text)
    assert app.state.jobs.list() == [] and app.state.runner.woken == 0


def test_routes_api_key_rule(app):
    remote = TestClient(app, client=("203.0.113.9", 40000))
    body = {"dataset": "synthetic"}
    r = remote.post("/v1/benchmarks", json=body)
    assert r.status_code == 403 and "set ICR_ADMIN_KEY" in r.json()["message"]
    assert (
        TestClient(app, client=("::ffff:127.0.0.1", 1)).post("/v1/benchmarks", json=body).status_code == 202
    )
    app.state.settings = app.state.settings.model_copy(update={"admin_key": "s3cret"})
    assert remote.post("/v1/benchmarks", json=body).status_code == 401
    assert remote.post("/v1/benchmarks", json=body, headers={"X-API-Key": "s3cre"}).status_code == 403
    assert remote.post("/v1/benchmarks", json=body, headers={"X-API-Key": "s3cret"}).status_code == 202
    # with a key, the loopback exemption is gone too
    assert TestClient(app, client=("127.0.0.1", 1)).post("/v1/benchmarks", json=body).status_code == 401
    assert remote.get("/v1/benchmarks").status_code == 200  # reading needs no key (no ICR_API_KEY)
    # the key is checked before the body is read: no validation detail for a client without it
    r = remote.post("/v1/benchmarks", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 401 and "ICR_ADMIN_KEY" in r.json()["message"]
    app.state.settings = app.state.settings.model_copy(update={"api_key": "reader"})
    assert remote.get("/v1/benchmarks").status_code == 401
    assert remote.get("/v1/benchmarks", headers={"X-API-Key": "reader"}).status_code == 200
    assert remote.get("/v1/benchmarks", headers={"X-API-Key": "s3cret"}).status_code == 200  # admin reads too
    assert remote.post("/v1/benchmarks", json=body, headers={"X-API-Key": "reader"}).status_code == 403
    assert len(app.state.jobs.list()) == 2


def test_headline_picks_retrieval_global_and_calibration_figures():
    section = {
        "retrieval": {"rsum": 100.0, "i2t_r1": 10.0, "i2t_medr": 3},
        "global": {"pr_auc": 0.2, "pairs": 9},
        "calibration": {"ece": 0.01, "bins": [1, 2]},
    }
    picked = headline({"annotations": section, "distractors": {"count": 5, "ids": [1, 2]}})
    assert picked == {
        "annotations": {"rsum": 100.0, "i2t_r1": 10.0, "pr_auc": 0.2, "ece": 0.01},
        "distractors": {"count": 5},
    }


def test_job_errors_show_no_server_paths(tmp_path) -> None:
    """A failed job's error is read by clients: configured roots become their names, any other
    absolute path its last part; relative paths and URLs stay as they are."""
    from icr.service.jobs import without_server_paths

    data = tmp_path / "coco"
    text = f"DatasetError: {data}/captions.json: 3 missing (looked under {data}): {data}/images/a.png"
    assert without_server_paths(text, {"coco": data}) == (
        "DatasetError: coco/captions.json: 3 missing (looked under coco): coco/images/a.png"
    )
    assert without_server_paths('File "/usr/lib/python3.11/x.py", line 3') == 'File "x.py", line 3'
    kept = "see images/a.png or https://example.org/a/b"
    assert without_server_paths(kept) == kept
    store = JobStore(tmp_path / "jobs.sqlite")
    job = store.submit("coco", "test", "full", 0)
    claimed = store.claim_next("server-a", lease_s=60)
    assert claimed is not None and claimed.id == job.id
    store.fail(job.id, claimed.attempt, f"ValueError: {tmp_path}/secret/model.pt is corrupt")
    assert store.get(job.id).error == "ValueError: model.pt is corrupt"
