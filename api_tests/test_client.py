"""icr.client against real `icr serve` processes: typed results equal to the raw JSON, every error
as ApiError with the server's message, API keys, and retries while a server starts."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_support import free_port

from icr.client import ApiError, Client, ServerUnavailable
from icr.service.schemas import ImageSearchResponse, TextSearchResponse


def test_search_results_are_typed_and_equal_the_raw_answer(server) -> None:
    with Client(server.url) as icr:
        found = icr.search_text("a red circle", k=5, min_score=-1.0)
        raw = httpx.post(
            server.url + "/v1/search/text", json={"text": "a red circle", "k": 5, "min_score": -1.0}
        )
        assert isinstance(found, TextSearchResponse) and len(found.hits) == 5
        assert [h.id for h in found.hits] == [h["id"] for h in raw.json()["hits"]]
        assert found.passed == raw.json()["passed"] and found.threshold.kind == "min_score"

        second = icr.search_text("a red circle", k=2, offset=2, min_score=-1.0)
        assert [h.id for h in second.hits] == [h.id for h in found.hits[2:4]]  # pagination

        png = icr.image(found.hits[0].id)
        thumb = icr.image(found.hits[0].id, thumbnail=True)  # the 32 px test images are below thumbnail size
        assert png[:8] == thumb[:8] == b"\x89PNG\r\n\x1a\n"
        captions = icr.search_image(png, k=3, include_images=True)
        assert isinstance(captions, ImageSearchResponse) and len(captions.hits) == 3
        assert captions.similar_images is not None and captions.similar_images.hits[0].id == found.hits[0].id
        assert icr.ready() and icr.info()["index"]["ntotal"] > 0


def test_filters_search_only_matching_items(server) -> None:
    with Client(server.url) as icr:
        info = icr.info()["index"]
        assert info["metadata_fields"] == []  # the synthetic index has only the built-in flag
        unfiltered = icr.search_text("a red circle", k=50)
        found = icr.search_text("a red circle", k=50, filter={"is_distractor": False})
        assert found.matched == info["gallery_count"] and unfiltered.matched is None
        assert found.hits and not any(h.is_distractor for h in found.hits)
        assert found.passed == min(found.matched, found.searched)
        # the gallery's hits, in the unfiltered order, with the relevance they have there
        expected = [h for h in unfiltered.hits if not h.is_distractor]
        assert [h.id for h in found.hits[: len(expected)]] == [h.id for h in expected]
        assert [h.relevance for h in found.hits[: len(expected)]] == [h.relevance for h in expected]
        with pytest.raises(ApiError) as err:
            icr.search_text("a red circle", filter={"album": "trip"})
        assert (
            err.value.status == 422
            and "unknown field 'album'; this index's fields are: is_distractor" in err.value.message
        )


def test_errors_carry_the_servers_message(server) -> None:
    with Client(server.url, retries=0) as icr:
        with pytest.raises(ApiError) as err:
            icr.search_text("a red circle", k=0)
        assert err.value.status == 422 and err.value.error == "invalid_request" and "k" in err.value.message
        with pytest.raises(ApiError) as err:
            icr.image(10**9)
        assert err.value.status == 404 and "no image" in err.value.message
        with pytest.raises(ApiError) as err:
            icr.benchmark("no-such-job")
        assert err.value.status == 404


def test_benchmark_jobs_from_submission_to_report(server) -> None:
    with Client(server.url) as icr:
        job = icr.submit_benchmark("synthetic", split="test")
        assert job.status in ("queued", "running") and job.dataset == "synthetic"
        done = icr.wait_for_benchmark(job.id, timeout=120, poll=0.2)
        assert done.status == "succeeded", done.error
        assert done.metrics and done.report is not None
        assert any(j.id == job.id for j in icr.benchmarks())


def test_the_api_key_goes_with_every_request(make_server) -> None:
    server = make_server(ICR_API_KEY="reader").start()
    with Client(server.url, retries=0) as anonymous:
        with pytest.raises(ApiError) as err:
            anonymous.search_text("a red circle")
        assert err.value.status == 401 and "ICR_API_KEY" in err.value.message
    with Client(server.url, api_key="reader") as keyed:
        assert keyed.search_text("a red circle", k=1).hits


def test_requests_wait_for_a_starting_server(make_server) -> None:
    """Started before the server: connection refused, then 503 while it loads, then the answer."""
    server = make_server()
    ready = threading.Event()
    starter = threading.Thread(target=lambda: (time.sleep(0.5), server.start(), ready.set()))
    starter.start()
    try:
        with Client(server.url, retries=12, backoff=0.25) as icr:  # up to ~17 min of backoff in all
            found = icr.search_text("a red circle", k=1)
        assert found.hits
    finally:
        starter.join()
    assert ready.is_set()


def test_an_unreachable_server_fails_after_the_retries() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", retries=2, backoff=0.1) as icr:
        started = time.monotonic()
        with pytest.raises(ServerUnavailable) as err:
            icr.search_text("a red circle")
        waited = time.monotonic() - started
    assert err.value.status == 0 and "unreachable" in str(err.value)
    assert waited >= 0.1 + 0.2  # two backoffs before the third and last attempt
