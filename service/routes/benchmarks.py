"""POST /v1/benchmarks (202 + job), GET /v1/benchmarks, GET and DELETE /v1/benchmarks/{id}."""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Query, Request

from icr.service.errors import ApiError
from icr.service.jobs import JobRow, JobStore, QueueFull, owner_alive
from icr.service.routes.deps import settings_of
from icr.service.schemas import BenchmarkJob, BenchmarkList, BenchmarkRequest, error_responses
from icr.service.strict_json import StrictJSONRoute
from icr.training.data.karpathy import find_karpathy_json, load_karpathy
from icr.training.data.precomp import available_precomp_splits, is_precomp
from icr.training.evaluation.metrics.protocols import protocol_folds

log = logging.getLogger("icr.service")
router = APIRouter(prefix="/v1/benchmarks", tags=["benchmarks"], route_class=StrictJSONRoute)


def _jobs(request: Request) -> JobStore:
    """The app's job store, typed: ``app.state`` is not, and this lets mypy check the routes' use of it."""
    jobs: JobStore = request.app.state.jobs
    return jobs


def job_body(job: JobRow) -> BenchmarkJob:
    """The API's view of a job: its public columns, field by field (not the attempt, worker pid or
    lease, which are the servers' bookkeeping; the report as read: None when read without it)."""
    return BenchmarkJob(
        id=job.id,
        status=job.status,
        dataset=job.dataset,
        split=job.split,
        protocol=job.protocol,
        distractors=job.distractors,
        progress=job.progress,
        stage=job.stage,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        error=job.error,
        metrics=job.metrics,
        report=job.report,
    )


def _splits(data: Path) -> dict[str, int]:
    """The splits a dataset folder offers and their image counts, read cheaply: precomp file names
    and array headers, or the Karpathy JSON (parsed once per file version; no image is opened or
    even looked up)."""
    data = data.expanduser()
    if is_precomp(data):
        return {
            s: int(np.load(data / f"{s}_ims.npy", mmap_mode="r").shape[0])
            for s in available_precomp_splits(data)
        }

    json_path = find_karpathy_json(data)
    stat = json_path.stat()
    return dict(_karpathy_splits(json_path, stat.st_mtime_ns, stat.st_size))


@lru_cache(maxsize=8)
def _karpathy_splits(json_path: Path, _mtime_ns: int, _size: int) -> tuple[tuple[str, int], ...]:
    """(split, images) of a Karpathy JSON; the file's mtime and size are only part of the cache key."""
    splits = load_karpathy(json_path, check_images=False).splits
    return tuple(sorted((name, len(split.images)) for name, split in splits.items()))


def _submit_responses() -> dict[int | str, dict[str, Any]]:
    """POST's responses: the job's id links to reading and cancelling it (OpenAPI links, which
    clients and Schemathesis's stateful phase follow), and what its 404, 409 and 429 mean here."""
    job_id = {"job_id": "$response.body#/id"}
    links = {
        "GetJob": {
            "operationId": "get_job_v1_benchmarks__job_id__get",
            "parameters": job_id,
            "description": "Poll the job for progress, metrics and report.",
        },
        "CancelJob": {
            "operationId": "cancel_job_v1_benchmarks__job_id__delete",
            "parameters": job_id,
            "description": "Cancel the job.",
        },
    }
    out = error_responses(401, 403, 404, 408, 409, 413, 422, 429)
    out[202] = {"description": "The job, queued.", "links": links}
    out[404]["description"] = (
        "The dataset is one a server may have but this one has not configured (the message lists the "
        "configured ones; the operator adds one with ICR_DATASETS or --dataset NAME=PATH)."
    )
    out[409]["description"] = "The configured dataset cannot be read on the server (the message says why)."
    out[429]["headers"] = {
        "Retry-After": {
            "description": "Seconds to wait before submitting again.",
            "schema": {"type": "integer"},
        }
    }
    return out


@router.post(
    "",
    status_code=202,
    response_model=BenchmarkJob,
    summary="Queue an evaluation job",
    responses=_submit_responses(),
)
def submit(body: BenchmarkRequest, request: Request) -> BenchmarkJob:
    """Evaluate the served checkpoint on a dataset configured on the server (never a client path).
    The job runs in the background; poll GET /v1/benchmarks/{id} for progress and metrics."""
    settings = settings_of(request)
    data = settings.datasets.get(body.dataset)
    if data is None:
        configured = ", ".join(sorted(settings.datasets)) or "none"
        raise ApiError(
            404,
            "unknown_dataset",
            f"dataset {body.dataset!r} is not configured on this server "
            f"(configured: {configured}); the operator adds one with ICR_DATASETS or --dataset NAME=PATH",
        )
    try:
        splits = _splits(data)
    except (FileNotFoundError, ValueError) as err:
        raise ApiError(
            409, "dataset_unavailable", f"dataset {body.dataset!r} cannot be read on the server: {err}"
        ) from None
    if body.split not in splits:
        raise ApiError(
            422,
            "invalid_request",
            f"split: {body.split!r} is not in {body.dataset} (has {', '.join(splits)})",
        )

    try:  # refused here, not failed in the worker: a 1k or 5k protocol needs a split of that size
        protocol_folds(splits[body.split], body.protocol)
    except ValueError as err:
        raise ApiError(422, "invalid_request", f"protocol: {err} ({body.dataset} {body.split})") from None
    if body.distractors and body.dataset != "synthetic":
        raise ApiError(
            422, "invalid_request", "distractors: generated distractors exist for the synthetic dataset only"
        )
    if body.distractors > settings.max_benchmark_distractors:
        raise ApiError(
            422,
            "invalid_request",
            f"distractors: at most {settings.max_benchmark_distractors} (ICR_MAX_BENCHMARK_DISTRACTORS)",
        )
    try:
        job = _jobs(request).submit(
            body.dataset, body.split, body.protocol, body.distractors, max_queued=settings.max_queued_jobs
        )
    except QueueFull as full:
        raise ApiError(
            429,
            "queue_full",
            f"{full.queued} benchmark jobs are queued, the most this server takes (ICR_MAX_QUEUED_JOBS); "
            "retry later or cancel one with DELETE /v1/benchmarks/{id}",
            headers={"Retry-After": "60"},
        ) from None
    request.app.state.runner.wake()
    return job_body(job)


@router.get(
    "",
    response_model=BenchmarkList,
    summary="Recent jobs, newest first (without reports)",
    responses=error_responses(422),
)
def list_jobs(
    request: Request, limit: Annotated[int, Query(ge=1, le=500, description="How many jobs.")] = 50
) -> BenchmarkList:
    _reap(request)
    return BenchmarkList(jobs=[job_body(j) for j in _jobs(request).list(limit)])


def _reap(request: Request) -> None:
    """Before a job is shown: a running job whose server process on this host is gone is marked
    interrupted now, not when its lease expires (a server on another host: when it expires)."""
    if _jobs(request).reap(owner_alive):
        log.warning("benchmark job(s) whose server is gone marked interrupted")


@router.get(
    "/{job_id}",
    response_model=BenchmarkJob,
    summary="A job: status, progress, metrics, report",
    responses=error_responses(404),
)
def get_job(job_id: str, request: Request) -> BenchmarkJob:
    _reap(request)
    job = _jobs(request).get(job_id)
    if job is None:
        raise ApiError(404, "not_found", f"no benchmark job {job_id!r}; GET /v1/benchmarks lists them")
    return job_body(job)


@router.delete(
    "/{job_id}",
    response_model=BenchmarkJob,
    summary="Cancel a queued or running job",
    responses=error_responses(401, 403, 404, 409),
)
def cancel_job(job_id: str, request: Request) -> BenchmarkJob:
    """Cancel a job (the admin key, as for submission: service.access). A queued job never runs; a
    running one's worker is stopped by the server that runs it within a third of the job lease. A
    finished job: 409."""
    before = _jobs(request).get(job_id, with_report=False)
    if before is None:
        raise ApiError(404, "not_found", f"no benchmark job {job_id!r}; GET /v1/benchmarks lists them")
    job = _jobs(request).cancel(job_id)
    if job is None:  # deleted between the two reads: only the retention purge deletes, finished jobs
        raise ApiError(409, "job_finished", f"job {job_id} already ended; nothing to cancel")
    if job.status != "cancelled" or before.status not in ("queued", "running"):
        raise ApiError(409, "job_finished", f"job {job_id} already ended ({job.status}); nothing to cancel")
    return job_body(job)
