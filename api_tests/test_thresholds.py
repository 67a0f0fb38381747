"""Threshold semantics: applied before pagination, every hit meets it, results shrink as it rises."""

from __future__ import annotations

import httpx
import pytest

QUERIES = ["a red circle", "a big blue square on a dark background", "a green star left of a yellow disc"]


def _search(client: httpx.Client, text: str, **params) -> dict:
    r = client.post("/v1/search/text", json={"text": text, **params})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("text", QUERIES)
def test_every_hit_meets_the_threshold_and_results_shrink_as_it_rises(
    client: httpx.Client, text: str
) -> None:
    previous = None
    for min_score in (-1.0, 0.0, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0):
        body = _search(client, text, k=100, min_score=min_score)
        assert body["threshold"] == {"kind": "min_score", "value": min_score, "score": min_score}
        assert all(h["score"] >= min_score for h in body["hits"])
        assert len(body["hits"]) == min(100, body["passed"])
        if previous is not None:
            assert body["passed"] <= previous
        previous = body["passed"]
    previous = None
    for p in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0):
        body = _search(client, text, k=100, min_relevance=p)
        assert body["threshold"]["kind"] == "min_relevance" and body["threshold"]["value"] == p
        assert all(h["relevance"] >= p for h in body["hits"])
        if body["threshold"]["score"] is not None:  # the reported equivalent raw score holds too
            assert all(h["score"] >= body["threshold"]["score"] - 1e-6 for h in body["hits"])
        if previous is not None:
            assert body["passed"] <= previous
        previous = body["passed"]


def test_threshold_counts_match_an_unthresholded_search(client: httpx.Client) -> None:
    everything = _search(client, QUERIES[0], k=100, offset=0)
    assert everything["passed"] == everything["searched"] == 440
    # the first 100 of the unthresholded ranking, filtered here, agree with the server's filter
    cutoff = everything["hits"][30]["score"]
    body = _search(client, QUERIES[0], k=100, min_score=cutoff)
    expected = [h["id"] for h in everything["hits"] if h["score"] >= cutoff]
    assert [h["id"] for h in body["hits"]] == expected and body["passed"] == len(expected)
    assert body["passed_is_exact"] is True


def test_an_unreachable_threshold_is_a_200_with_zero_hits(client: httpx.Client) -> None:
    body = _search(client, QUERIES[1], min_score=1.0)  # no caption embedding equals an image embedding
    assert body["hits"] == [] and body["passed"] == 0 and body["passed_is_exact"] is True
    png = client.get("/v1/images/1").content
    r = client.post(
        "/v1/search/image", files={"file": ("q.png", png, "image/png")}, data={"min_score": "1.0"}
    )
    assert r.status_code == 200 and r.json()["hits"] == [] and r.json()["passed"] == 0
    # relevance 1.0 is reachable (the isotonic map can hit it on a small fit), so it may pass hits,
    # but only hits whose relevance is exactly 1
    body = _search(client, QUERIES[1], k=100, min_relevance=1.0)
    assert all(h["relevance"] == 1.0 for h in body["hits"])


def test_pages_of_a_thresholded_search_tile_the_single_large_page(client: httpx.Client) -> None:
    full = _search(client, QUERIES[2], k=100, min_score=0.0)
    passed = full["passed"]
    assert passed > 25  # enough to page through
    ids = []
    for offset in range(0, min(passed, 100), 7):
        page = _search(client, QUERIES[2], k=7, offset=offset, min_score=0.0)
        assert page["passed"] == passed and page["offset"] == offset
        assert [h["rank"] for h in page["hits"]] == list(range(offset + 1, offset + 1 + len(page["hits"])))
        ids += [h["id"] for h in page["hits"]]
    full_ids = [h["id"] for h in full["hits"]]  # the first min(passed, 100)
    assert ids[: len(full_ids)] == full_ids and len(ids) == min(
        passed, len(range(0, min(passed, 100), 7)) * 7
    )
    beyond = _search(client, QUERIES[2], k=10, offset=passed, min_score=0.0)
    assert beyond["hits"] == [] and beyond["passed"] == passed


def test_image_search_thresholds_captions_the_same_way(client: httpx.Client) -> None:
    png = client.get("/v1/images/5").content
    previous = None
    for p in (0.0, 0.1, 0.3, 1.0):
        r = client.post(
            "/v1/search/image",
            files={"file": ("q.png", png, "image/png")},
            data={"k": "50", "min_relevance": str(p), "include_images": "true"},
        )
        body = r.json()
        assert r.status_code == 200 and all(h["relevance"] >= p for h in body["hits"])
        similar = body["similar_images"]  # image-image scores: no calibrated relevance to threshold
        assert similar["threshold"]["kind"] == "none" and all(h["relevance"] is None for h in similar["hits"])
        if previous is not None:
            assert body["passed"] <= previous
        previous = body["passed"]
