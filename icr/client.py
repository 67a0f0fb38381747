"""A Python client of the icr HTTP API (v1), with typed results.

    from icr.client import Client

    with Client("http://127.0.0.1:8000", api_key="...") as icr:
        found = icr.search_text("a red circle left of a blue square", k=5, min_relevance=0.5)
        for hit in found.hits:
            print(hit.rank, hit.relevance, hit.metadata["source"])
        captions = icr.search_image("photo.jpg", k=3)
        near = icr.search_similar(found.hits[0].id, k=5, filter={"album": "trip"})
        job = icr.wait_for_benchmark(icr.submit_benchmark("synthetic").id)

Results are the server's own response models (``icr.service.schemas``). Every error is an
:class:`ApiError` carrying the status and the server's ``{error, message, detail}`` body. A request
that finds the server starting or overloaded (503) or cannot connect is retried with exponential
backoff (``retries`` times, honouring ``Retry-After``); other errors are raised at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from icr.service.schemas import (
    LABELS_IDS_MAX,
    BenchmarkJob,
    BenchmarkList,
    CompactResult,
    ImageMetadata,
    ImageSearchResponse,
    QueryLabels,
    SnapshotResult,
    TextSearchResponse,
    VectorSearchResponse,
    WriteResult,
)

KEY_HEADER = "X-API-Key"
FINISHED = frozenset({"succeeded", "failed", "interrupted", "cancelled"})


class ApiError(Exception):
    """An error answer of the server: ``status`` and its ``{error, message, detail}`` body."""

    def __init__(self, status: int, error: str, message: str, detail: Any = None) -> None:
        super().__init__(f"{status} {error}: {message}")
        self.status, self.error, self.message, self.detail = status, error, message, detail


class ServerUnavailable(ApiError):
    """No answer after every retry: the server could not be reached, or kept answering 503."""


class Client:
    """A connection to one icr server. Thread-safe for concurrent requests (one httpx client)."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
    ) -> None:
        if retries < 0 or backoff < 0:
            raise ValueError("retries and backoff must be >= 0")
        headers = {KEY_HEADER: api_key} if api_key else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
        self.retries, self.backoff = retries, backoff

    # --- search -----------------------------------------------------------------------------------
    def search_text(
        self,
        text: str,
        *,
        k: int = 10,
        offset: int = 0,
        min_score: float | None = None,
        min_relevance: float | None = None,
        filter: dict[str, Any] | None = None,  # noqa: A002 - the API's own name for it
    ) -> TextSearchResponse:
        """Images for a caption, thresholded by cosine score or calibrated relevance, paginated;
        ``filter`` searches only items whose metadata match, e.g. ``{"album": "trip", "year":
        {"gte": 2019}}`` (see the API's description of ``filter``)."""
        body = _without_none(
            text=text, k=k, offset=offset, min_score=min_score, min_relevance=min_relevance, filter=filter
        )
        return TextSearchResponse.model_validate(self._request("POST", "/v1/search/text", json=body).json())

    def search_image(
        self,
        image: bytes | str | Path,
        *,
        k: int = 10,
        offset: int = 0,
        min_score: float | None = None,
        min_relevance: float | None = None,
        include_images: bool = False,
        filter: dict[str, Any] | None = None,  # noqa: A002 - the API's own name for it
    ) -> ImageSearchResponse:
        """Captions for an image (bytes of an image file, or its path); with ``include_images``, also
        similar gallery images, of which ``filter`` (as in :meth:`search_text`) selects the ones
        searched."""
        content = image if isinstance(image, bytes) else Path(image).read_bytes()
        form = _without_none(
            k=k,
            offset=offset,
            min_score=min_score,
            min_relevance=min_relevance,
            include_images=include_images,
            # a form field carries text: the filter goes as its JSON
            filter=json.dumps(filter) if filter is not None else None,
        )
        response = self._request(
            "POST",
            "/v1/search/image",
            data={
                key: str(value).lower() if isinstance(value, bool) else str(value)
                for key, value in form.items()
            },
            files={"file": ("query", content, "application/octet-stream")},
        )
        return ImageSearchResponse.model_validate(response.json())

    def search_similar(
        self,
        image_id: int,
        *,
        k: int = 10,
        offset: int = 0,
        min_score: float | None = None,
        filter: dict[str, Any] | None = None,  # noqa: A002 - the API's own name for it
        include_self: bool = False,
    ) -> VectorSearchResponse:
        """The images nearest to a stored image (a hit's ``id``), itself left out unless
        ``include_self``; thresholded by cosine only (no calibrated relevance without text)."""
        body = _without_none(image_id=image_id, k=k, offset=offset, min_score=min_score, filter=filter)
        body["include_self"] = include_self
        response = self._request("POST", "/v1/search/similar", json=body)
        return VectorSearchResponse.model_validate(response.json())

    def search_vector(
        self,
        vector: Iterable[float],
        *,
        k: int = 10,
        offset: int = 0,
        min_score: float | None = None,
        filter: dict[str, Any] | None = None,  # noqa: A002 - the API's own name for it
    ) -> VectorSearchResponse:
        """The images nearest to an embedding computed with the served checkpoint (a list, or a
        1-D numpy array: anything iterable of numbers), normalised by the server; thresholded by
        cosine only."""
        values = [float(v) for v in vector]  # numpy floats are not JSON
        body = _without_none(vector=values, k=k, offset=offset, min_score=min_score, filter=filter)
        response = self._request("POST", "/v1/search/vector", json=body)
        return VectorSearchResponse.model_validate(response.json())

    def image(self, image_id: int, *, thumbnail: bool = False) -> bytes:
        """The PNG of an indexed image (or its thumbnail)."""
        params = {"size": "thumb" if thumbnail else "full"}
        return self._request("GET", f"/v1/images/{int(image_id)}", params=params).content

    def image_metadata(self, image_id: int) -> ImageMetadata:
        """What the index stores about an image: its file relative to the gallery, fields, captions."""
        response = self._request("GET", f"/v1/images/{int(image_id)}/metadata")
        return ImageMetadata.model_validate(response.json())

    # --- writes (admin) ---------------------------------------------------------------------------
    def add_images(self, images: Iterable[dict[str, Any]]) -> WriteResult:
        """Add images by their embeddings, in one transaction: each a dict with ``vector`` (a list or
        numpy array of the served checkpoint's embedding) and optionally ``external_id`` (adding it
        again replaces that image), ``source``, ``fields``, ``captions``. Answers once durable."""
        body = [{**image, "vector": [float(x) for x in image["vector"]]} for image in images]
        response = self._request("POST", "/v1/images", json={"images": body})
        return WriteResult.model_validate(response.json())

    def upload_image(
        self,
        image: bytes | str | Path,
        *,
        external_id: str | None = None,
        fields: dict[str, Any] | None = None,
    ) -> WriteResult:
        """Add an image file (bytes or a path): the server embeds it and keeps the file."""
        content = image if isinstance(image, bytes) else Path(image).read_bytes()
        form = _without_none(external_id=external_id, fields=json.dumps(fields) if fields else None)
        files = {"file": ("image", content, "application/octet-stream")}
        response = self._request("POST", "/v1/images:upload", data=form, files=files)
        return WriteResult.model_validate(response.json())

    def patch_image(self, image_id: int, fields: dict[str, Any]) -> ImageMetadata:
        """Set fields of an image (None removes one); returns its metadata from now on."""
        response = self._request("PATCH", f"/v1/images/{int(image_id)}", json={"fields": fields})
        return ImageMetadata.model_validate(response.json())

    def delete_images(
        self,
        ids: Iterable[int] | None = None,
        *,
        filter: dict[str, Any] | None = None,  # noqa: A002 - the API's own name for it
    ) -> WriteResult:
        """Delete the live images among ``ids``, or every live image ``filter`` selects."""
        body = {"ids": [int(i) for i in ids]} if ids is not None else {"filter": filter}
        response = self._request("POST", "/v1/images:delete", json=body)
        return WriteResult.model_validate(response.json())

    def snapshot(self, name: str | None = None) -> SnapshotResult:
        """Write a snapshot of the served image index and its writes (STATE_DIR/snapshots/<name>), a
        folder that ``icr serve --index`` starts from; needs the admin key."""
        response = self._request("POST", "/v1/admin/snapshot", json={"name": name})
        return SnapshotResult.model_validate(response.json())

    def compact(self) -> CompactResult:
        """Fold the write log into a fresh index folder and serve it (POST /v1/admin/compact);
        answers once the new folder is served. Needs the admin key."""
        response = self._request("POST", "/v1/admin/compact")
        return CompactResult.model_validate(response.json())

    # --- server -----------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """What the server serves: model, indices, calibration, limits."""
        info: dict[str, Any] = self._request("GET", "/v1/info").json()
        return info

    def ready(self) -> bool:
        """Whether the model and indices are loaded (GET /readyz); never retries or raises on 503."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """The /readyz body once the server is ready, polling with backoff (``backoff`` seconds,
        doubling up to 5 s, or the server's Retry-After); TimeoutError after ``timeout`` seconds,
        saying what the server last answered (why it is not ready, or that it could not be
        reached). Other error answers (401, 403: a key is needed) raise ApiError at once."""
        deadline = time.monotonic() + timeout
        delay = max(self.backoff, 0.05)
        while True:
            try:
                response = self._http.get("/readyz")
            except httpx.TransportError as err:
                last = f"no answer from {self._http.base_url} ({type(err).__name__}: {err})"
                wait = None
            else:
                if response.status_code == 200:
                    body: dict[str, Any] = response.json()
                    return body
                if response.status_code != 503:
                    raise _error(response)
                last = f"503: {_error(response).message}"
                wait = _retry_after(response)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the server was not ready after {timeout:g} s; it last said: {last}")
            time.sleep(min(wait if wait is not None else delay, left))
            delay = min(2 * delay, 5.0)

    # --- labels -----------------------------------------------------------------------------------
    def label(self, query: str, image_id: int, relevant: bool) -> dict[str, Any]:
        """Record whether a hit is relevant to a query (admin rights, as on the search page); the
        answer says what was recorded and what the labels now hold."""
        body = {"query": query, "image_id": int(image_id), "relevant": bool(relevant)}
        recorded: dict[str, Any] = self._request("POST", "/v1/feedback", json=body).json()
        return recorded

    def feedback(self) -> dict[str, Any]:
        """The labels of the served index: counts, whether this client may label, and what a
        calibration fitted on them supports at each min_relevance."""
        held: dict[str, Any] = self._request("GET", "/v1/feedback").json()
        return held

    def labels(self, query: str, image_ids: Iterable[int] | None = None) -> QueryLabels:
        """The labels already given on the served index to hits of ``query`` (every judged hit, or
        those among ``image_ids``, asked for 100 at a time): each hit's majority verdict, its
        judgements, and ``mine``, the verdict given with this client's admin rights."""
        if image_ids is None:
            return self._query_labels([("query", query)])
        ids = sorted({int(i) for i in image_ids})
        chunks = [ids[i : i + LABELS_IDS_MAX] for i in range(0, len(ids), LABELS_IDS_MAX)] or [[]]
        answers = [
            self._query_labels([("query", query), *(("image_id", i) for i in chunk)]) for chunk in chunks
        ]
        wanted = set(ids)  # none: the query is still checked, and no hit is
        found = [hit for answer in answers for hit in answer.labels if hit.image_id in wanted]
        return answers[0].model_copy(update={"labels": found})

    def _query_labels(self, params: list[tuple[str, str | int]]) -> QueryLabels:
        return QueryLabels.model_validate(self._request("GET", "/v1/feedback/labels", params=params).json())

    def refit(self) -> dict[str, Any]:
        """Fit the calibration on the labels and serve it (admin rights); answers once it is served."""
        refitted: dict[str, Any] = self._request("POST", "/v1/feedback/refit").json()
        return refitted

    # --- benchmark jobs ---------------------------------------------------------------------------
    def submit_benchmark(
        self, dataset: str, *, split: str = "test", protocol: str = "full", distractors: int = 0
    ) -> BenchmarkJob:
        """Queue an evaluation of the served model on a dataset the server knows (GET /v1/info)."""
        body = {"dataset": dataset, "split": split, "protocol": protocol, "distractors": distractors}
        return BenchmarkJob.model_validate(self._request("POST", "/v1/benchmarks", json=body).json())

    def benchmark(self, job_id: str) -> BenchmarkJob:
        """One job, with its full report once it succeeded."""
        return BenchmarkJob.model_validate(self._request("GET", f"/v1/benchmarks/{job_id}").json())

    def benchmarks(self) -> list[BenchmarkJob]:
        """The most recent jobs, newest first."""
        return BenchmarkList.model_validate(self._request("GET", "/v1/benchmarks").json()).jobs

    def cancel_benchmark(self, job_id: str) -> BenchmarkJob:
        """Cancel a queued or running job."""
        return BenchmarkJob.model_validate(self._request("DELETE", f"/v1/benchmarks/{job_id}").json())

    def wait_for_benchmark(self, job_id: str, *, timeout: float = 3600.0, poll: float = 1.0) -> BenchmarkJob:
        """The job once it has finished (succeeded, failed, interrupted or cancelled); TimeoutError
        after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.benchmark(job_id)
            if job.status in FINISHED:
                return job
            if time.monotonic() >= deadline:
                raise TimeoutError(f"benchmark job {job_id} still {job.status} after {timeout:.0f} s")
            time.sleep(poll)

    # --- plumbing ---------------------------------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = self._http.request(method, path, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                # nothing was sent: retrying cannot repeat a request the server acted on
                if last:
                    raise ServerUnavailable(0, "unreachable", f"{self._http.base_url}: {err}") from None
                time.sleep(self.backoff * 2**attempt)
                continue
            if response.status_code == 503 and not last:
                time.sleep(_retry_after(response) or self.backoff * 2**attempt)
                continue
            if response.status_code >= 400:
                raise _error(response)
            return response
        raise AssertionError("unreachable: the last attempt returns or raises")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _without_none(**fields: Any) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if value is not None}


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers.get("Retry-After", "")))
    except ValueError:
        return None


def _error(response: httpx.Response) -> ApiError:
    """The server's error body as an exception (its message says how to fix the request)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or "message" not in body:
        body = {"error": "http_error", "message": response.text[:500] or response.reason_phrase}
    kind = ServerUnavailable if response.status_code == 503 else ApiError
    return kind(response.status_code, str(body.get("error")), str(body["message"]), body.get("detail"))
