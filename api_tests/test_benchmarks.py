"""Benchmark jobs over HTTP: submission checks, lifecycle, API key, a restart mid-job, two servers on
one database, cancel and the queue limit."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest


def _wait(client: httpx.Client, job_id: str, statuses: set[str], timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/benchmarks/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.25)
    raise AssertionError(f"job {job_id} still {job['status']} after {timeout} s: {job}")


def test_a_job_runs_in_the_background_and_reports_metrics(client: httpx.Client) -> None:
    r = client.post("/v1/benchmarks", json={"dataset": "synthetic", "split": "test"})
    assert r.status_code == 202, r.text
    job = r.json()
    assert (
        job["status"] in ("queued", "running") and job["dataset"] == "synthetic" and job["protocol"] == "full"
    )
    seen_progress = set()
    deadline = time.monotonic() + 120
    while job["status"] in ("queued", "running") and time.monotonic() < deadline:
        # search keeps answering while the job runs
        assert client.post("/v1/search/text", json={"text": "a red circle", "k": 3}).status_code == 200
        job = client.get(f"/v1/benchmarks/{job['id']}").json()
        seen_progress.add((job["stage"], job["progress"]))
        time.sleep(0.1)
    assert job["status"] == "succeeded", job.get("error")
    assert job["progress"] == 1.0 and job["started_at"] and job["finished_at"] and job["error"] is None
    metrics = job["metrics"]
    assert set(metrics) == {"annotations", "ground_truth"}
    for labels in ("annotations", "ground_truth"):
        assert 0 <= metrics[labels]["rsum"] <= 600 and 0 <= metrics[labels]["pr_auc"] <= 1
    report = job["report"]
    assert report["format"] == "icr-evaluation" and report["data"]["images"] == 40
    assert report["annotations"]["retrieval"]["rsum"] == metrics["annotations"]["rsum"]
    listed = client.get("/v1/benchmarks").json()["jobs"]
    assert job["id"] in [j["id"] for j in listed] and all(j["report"] is None for j in listed)


def test_a_job_whose_evaluation_fails_says_why(make_server, artifacts, tmp_path) -> None:
    """Submission checks what it reads cheaply (name, split, its size for the protocol); a dataset
    whose images went missing after that fails in the worker, and the job says why."""
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(next(artifacts.data.glob("dataset_*.json")), broken)
    server = make_server(ICR_DATASETS=json.dumps({"synthetic": str(broken)})).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        job = c.post("/v1/benchmarks", json={"dataset": "synthetic"}).json()
        job = _wait(c, job["id"], {"succeeded", "failed"})
    assert job["status"] == "failed" and job["metrics"] is None
    assert str(broken) not in job["error"] and "image" in job["error"], job["error"]


def test_submissions_are_checked(client: httpx.Client) -> None:
    cases = [
        ({"dataset": "coco"}, 404, "not configured on this server (configured: synthetic)"),
        ({"dataset": "/etc/passwd"}, 422, "dataset: must be one of flickr30k, coco, synthetic"),
        ({"dataset": "synthetic", "split": "nope"}, 422, "has test, train, val"),
        ({"dataset": "synthetic", "protocol": "2k"}, 422, "protocol"),
        ({"dataset": "synthetic", "protocol": "5k"}, 422, "protocol: the 5k protocol needs the 5,000-image"),
        (
            {"dataset": "synthetic", "protocol": "1k"},
            422,
            "protocol: the 1k protocol cuts the split into folds",
        ),
        ({"dataset": "synthetic", "distractors": 10**9}, 422, "ICR_MAX_BENCHMARK_DISTRACTORS"),
        ({"dataset": "synthetic", "distractors": -1}, 422, "distractors"),
        ({}, 422, "dataset: Field required"),
    ]
    for body, status, says in cases:
        r = client.post("/v1/benchmarks", json=body)
        assert r.status_code == status and says in r.json()["message"], (body, r.text)
    missing = client.get("/v1/benchmarks/0123")
    assert missing.status_code == 404 and "GET /v1/benchmarks" in missing.json()["message"]
    assert client.get("/v1/benchmarks", params={"limit": 0}).status_code == 422


def test_the_schema_names_the_datasets_and_links_a_submission_to_its_job(client: httpx.Client) -> None:
    """The dataset is an enum of the ones this server has (the request model accepts any a server may
    have, so another is a 404 saying how to add it), and the 202's links name operations that exist,
    with the job's id as their path parameter."""
    schema = client.get("/openapi.json").json()
    dataset = schema["components"]["schemas"]["BenchmarkRequest"]["properties"]["dataset"]
    assert dataset["enum"] == ["synthetic"]
    submit = schema["paths"]["/v1/benchmarks"]["post"]["responses"]
    assert "ICR_DATASETS" in submit["404"]["description"] and "Retry-After" in submit["429"]["headers"]
    operations = {op["operationId"]: method for ops in schema["paths"].values() for method, op in ops.items()}
    links = submit["202"]["links"]
    assert {operations[link["operationId"]] for link in links.values()} == {"get", "delete"}
    assert all(link["parameters"] == {"job_id": "$response.body#/id"} for link in links.values())


def test_keys_guard_reading_and_jobs_before_the_body_is_read(make_server) -> None:
    server = make_server(ICR_API_KEY="reader", ICR_ADMIN_KEY="s3cret").start()
    read, admin = {"X-API-Key": "reader"}, {"X-API-Key": "s3cret"}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for path in ("/healthz", "/readyz", "/", "/openapi.json", "/metrics", "/docs"):
            assert c.get(path).status_code == 200, path  # open: probes, the page, the docs
        r = c.get("/v1/info")
        assert r.status_code == 401 and "ICR_API_KEY" in r.json()["message"]
        info = c.get("/v1/info", headers=read).json()
        assert info["search_needs_api_key"] is True and info["benchmarks_need_api_key"] is True
        assert c.get("/v1/images/0", headers={"X-API-Key": "nope"}).status_code == 403
        junk = {"content": b"{not json", "headers": {"content-type": "application/json"}}
        assert c.post("/v1/search/text", **junk).status_code == 401  # the key first, then the body
        assert c.post("/v1/search/text", json={"text": "a star"}, headers=read).status_code == 200
        assert c.post("/v1/search/text", json={"text": "a star"}, headers=admin).status_code == 200
        body = {"dataset": "synthetic"}
        assert c.post("/v1/benchmarks", json=body).status_code == 401
        r = c.post("/v1/benchmarks", json=body, headers=read)  # reading does not run jobs
        assert r.status_code == 403 and "ICR_ADMIN_KEY" in r.json()["message"]
        r = c.post("/v1/benchmarks", json=body, headers=admin)
        assert r.status_code == 202
        assert c.get("/v1/benchmarks", headers=read).status_code == 200
        assert c.delete(f"/v1/benchmarks/{r.json()['id']}", headers=read).status_code == 403
        assert c.delete(f"/v1/benchmarks/{r.json()['id']}", headers=admin).status_code == 200
        schema = c.get("/openapi.json").json()
        assert schema["components"]["securitySchemes"]["ApiKey"] == {
            "type": "apiKey",
            "in": "header",
            "name": "X-API-Key",
        }
        for path, method in (("/v1/search/text", "post"), ("/v1/benchmarks", "post"), ("/v1/info", "get")):
            operation = schema["paths"][path][method]
            assert operation["security"] == [{"ApiKey": []}] and {"401", "403"} <= set(operation["responses"])
        assert "security" not in schema["paths"]["/healthz"]["get"]
    server.stop()


@pytest.mark.slow
def test_a_restart_in_the_middle_marks_the_running_job_and_keeps_the_queued_one(
    make_server, tmp_path
) -> None:
    jobs_db = tmp_path / "jobs.sqlite"
    first = make_server(jobs_db=jobs_db).start()
    with httpx.Client(base_url=first.url, timeout=30) as c:
        # distractors make the first job long enough to be cut off
        long_job = c.post("/v1/benchmarks", json={"dataset": "synthetic", "distractors": 50000}).json()
        queued = c.post("/v1/benchmarks", json={"dataset": "synthetic"}).json()
        running = _wait(c, long_job["id"], {"running"})
        deadline = time.monotonic() + 60
        while running["stage"] in (None, "starting", "loading checkpoint") and time.monotonic() < deadline:
            running = c.get(f"/v1/benchmarks/{long_job['id']}").json()
            time.sleep(0.1)
        assert (
            running["status"] == "running"
            and c.get(f"/v1/benchmarks/{queued['id']}").json()["status"] == "queued"
        )
    assert first.stop() is not None  # SIGTERM: graceful shutdown

    second = make_server(jobs_db=jobs_db).start()
    with httpx.Client(base_url=second.url, timeout=30) as c:
        cut = c.get(f"/v1/benchmarks/{long_job['id']}").json()
        assert cut["status"] == "interrupted" and "submit it again" in cut["error"], cut
        assert cut["metrics"] is None and cut["finished_at"]
        done = _wait(c, queued["id"], {"succeeded", "failed"})
        assert done["status"] == "succeeded", done
        # the interrupted job stays interrupted: no orphaned worker finished it behind our back
        assert c.get(f"/v1/benchmarks/{long_job['id']}").json()["status"] == "interrupted"
    second.stop()


@pytest.mark.slow
def test_a_killed_server_leaves_no_job_running(make_server, tmp_path) -> None:
    jobs_db = tmp_path / "jobs.sqlite"
    first = make_server(jobs_db=jobs_db).start()
    with httpx.Client(base_url=first.url, timeout=30) as c:
        job = c.post("/v1/benchmarks", json={"dataset": "synthetic", "distractors": 50000}).json()
        _wait(c, job["id"], {"running"})
    first.process.kill()  # no graceful shutdown: the job is still 'running' in the database
    first.process.wait()
    second = make_server(jobs_db=jobs_db).start()
    with httpx.Client(base_url=second.url, timeout=30) as c:
        cut = c.get(f"/v1/benchmarks/{job['id']}").json()
        assert cut["status"] == "interrupted" and "restart" in cut["error"]
        time.sleep(2)  # the orphaned worker died with its parent, or can no longer write
        assert c.get(f"/v1/benchmarks/{job['id']}").json()["status"] == "interrupted"
    second.stop()


def test_the_queue_limit_holds_under_a_burst_of_submissions(make_server) -> None:
    """30 submissions at once against ICR_MAX_QUEUED_JOBS=2: the count and the insert are one
    transaction, so never more than 2 jobs wait (the runner may take one of them meanwhile)."""
    import threading

    server = make_server(ICR_MAX_QUEUED_JOBS="2").start()
    statuses: list[int] = []
    accepted: list[str] = []
    go = threading.Barrier(30)

    def submit() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            go.wait()
            r = c.post("/v1/benchmarks", json={"dataset": "synthetic", "distractors": 50000})
        statuses.append(r.status_code)
        if r.status_code == 202:
            accepted.append(r.json()["id"])

    threads = [threading.Thread(target=submit) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        jobs = c.get("/v1/benchmarks").json()["jobs"]
        for job_id in accepted:  # leave nothing running
            c.delete(f"/v1/benchmarks/{job_id}")
    assert set(statuses) <= {202, 429} and statuses.count(429) >= 27, statuses
    assert 2 <= len(accepted) <= 3 and sum(j["status"] == "queued" for j in jobs) <= 2, jobs
    server.stop()


def _running_pid(jobs_db, job_id: str) -> int:
    import sqlite3

    with sqlite3.connect(jobs_db) as db:
        return db.execute("SELECT pid FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]


@pytest.mark.slow
def test_two_servers_share_one_job_database(make_server, tmp_path) -> None:
    """Replicas: a full queue answers 429; a second server leaves the first one's running job alone
    (its lease is renewed) and runs the queued one; DELETE through one server cancels the other's
    job and stops its worker; a killed server's job is marked interrupted by the other."""
    import os
    import signal

    jobs_db = tmp_path / "jobs.sqlite"
    env = {"ICR_JOB_LEASE_SECONDS": "1.5", "ICR_MAX_QUEUED_JOBS": "1"}
    first = make_server(jobs_db=jobs_db, **env).start()
    a = httpx.Client(base_url=first.url, timeout=30)
    long_job = a.post("/v1/benchmarks", json={"dataset": "synthetic", "distractors": 50000}).json()
    _wait(a, long_job["id"], {"running"})
    queued = a.post("/v1/benchmarks", json={"dataset": "synthetic", "distractors": 50000}).json()
    assert queued["status"] == "queued"  # the only server is busy
    full = a.post("/v1/benchmarks", json={"dataset": "synthetic"})
    assert full.status_code == 429 and full.headers["retry-after"] == "60", full.text
    assert "ICR_MAX_QUEUED_JOBS" in full.json()["message"]

    second = make_server(jobs_db=jobs_db, **env).start()
    b = httpx.Client(base_url=second.url, timeout=30)
    _wait(b, queued["id"], {"running"})  # the free server takes the queued job
    assert _owner_pid(jobs_db, queued["id"]) == second.process.pid
    time.sleep(4)  # more than two lease periods: renewed by the first server, never taken away
    assert b.get(f"/v1/benchmarks/{long_job['id']}").json()["status"] == "running"
    assert _owner_pid(jobs_db, long_job["id"]) == first.process.pid
    # each job claimed exactly once (every claim counts an attempt): neither server ran the other's
    assert _attempt(jobs_db, long_job["id"]) == _attempt(jobs_db, queued["id"]) == 1

    # cancel the first server's job through the second: its worker stops within a lease period
    worker = _running_pid(jobs_db, long_job["id"])
    r = b.delete(f"/v1/benchmarks/{long_job['id']}")
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the cancelled job's worker is still running")
    assert a.get(f"/v1/benchmarks/{long_job['id']}").json()["status"] == "cancelled"
    assert a.delete(f"/v1/benchmarks/{long_job['id']}").status_code == 409  # already ended
    assert a.delete("/v1/benchmarks/no-such-job").status_code == 404

    # kill the second server while the first runs a job of its own: the first GET through the first
    # server already says interrupted (its owner's process is gone), not one lease later
    busy = a.post("/v1/benchmarks", json={"dataset": "synthetic", "distractors": 50000}).json()
    _wait(a, busy["id"], {"running"})
    assert _owner_pid(jobs_db, busy["id"]) == first.process.pid
    second.process.send_signal(signal.SIGKILL)
    second.process.wait()
    cut = a.get(f"/v1/benchmarks/{queued['id']}").json()
    assert cut["status"] == "interrupted" and "restart" in cut["error"], cut
    assert _attempt(jobs_db, queued["id"]) == 1  # marked, not run again by the surviving server
    a.close()
    b.close()
    first.stop()


def _owner_pid(jobs_db, job_id: str) -> int:
    import sqlite3

    with sqlite3.connect(jobs_db) as db:
        owner = db.execute("SELECT lease_owner FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
    return int(owner.split(":")[1])


def _attempt(jobs_db, job_id: str) -> int:
    import sqlite3

    with sqlite3.connect(jobs_db) as db:
        return int(db.execute("SELECT attempt FROM jobs WHERE id = ?", (job_id,)).fetchone()[0])
