"""Threshold semantics: applied before pagination, every hit meets it, results shrink as it rises;
what the response says about its results (expected precision and relevant count, query kind,
warnings, the evidence a query has), with the session's calibration, a modified per-kind table, a
format-2 file (no evidence) and a format-1 file."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from server_support import index_with_calibration

QUERIES = ["a red circle", "a big blue square on a dark background", "a green star left of a yellow disc"]
RELEVANCES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8)


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
        # the reported raw-score equivalent is this query's: the lowest retrieved score that passed
        if body["passed"] == 0:
            assert body["threshold"]["score"] is None
        else:
            assert all(h["score"] >= body["threshold"]["score"] for h in body["hits"])
            if body["passed"] <= 100:
                assert body["threshold"]["score"] == body["hits"][-1]["score"]
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
    # relevance 1.0 may be reached (a map can saturate), so it may pass hits, but only hits whose
    # relevance is exactly 1
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


def _png(client: httpx.Client, image_id: int) -> bytes:
    return client.get(f"/v1/images/{image_id}").content


@pytest.mark.parametrize("text", QUERIES)
def test_relevance_meets_the_threshold_and_never_rises_down_the_hits(client: httpx.Client, text: str) -> None:
    for p in RELEVANCES:
        # three pages of 20: relevance is non-increasing within and across them (a prefix passes)
        relevances = []
        for offset in (0, 20, 40):
            body = _search(client, text, k=20, offset=offset, min_relevance=p)
            assert body["calibration"] == "per_query"
            assert all(h["relevance"] >= p for h in body["hits"])
            relevances += [h["relevance"] for h in body["hits"]]
        assert all(a >= b for a, b in zip(relevances, relevances[1:], strict=False)), (p, relevances)
    png = _png(client, 7)
    for p in (0.0, 0.02, 0.1):
        form = {"k": "50", "min_relevance": str(p)}
        r = client.post("/v1/search/image", files={"file": ("q.png", png, "image/png")}, data=form)
        body = r.json()
        # image queries get the global map: the per-query map is fitted on text queries
        assert r.status_code == 200 and body["calibration"] == "global"
        relevances = [h["relevance"] for h in body["hits"]]
        assert all(x >= p for x in relevances)
        assert all(a >= b for a, b in zip(relevances, relevances[1:], strict=False))


@pytest.mark.parametrize("text", QUERIES)
def test_expected_precision_is_the_page_mean_and_expected_relevant_covers_every_passing_hit(
    client: httpx.Client, text: str
) -> None:
    for params in ({}, {"min_relevance": 0.05}, {"min_relevance": 0.2}, {"min_score": 0.0}, {"offset": 30}):
        body = _search(client, text, k=25, **params)
        page = [h["relevance"] for h in body["hits"]]
        if page:
            assert body["expected_precision"] == pytest.approx(float(np.mean(page)), abs=1e-12)
        else:
            assert body["expected_precision"] is None
        assert body["expected_relevant"] >= sum(page) - 1e-9
        assert body["expected_relevant"] <= body["passed"]
    # one page holding every passing hit: expected_relevant is exactly their sum
    body = _search(client, text, k=100, min_relevance=0.05)
    if body["passed"] <= 100:
        assert body["expected_relevant"] == pytest.approx(sum(h["relevance"] for h in body["hits"]), abs=1e-9)
    png = _png(client, 11)
    r = client.post("/v1/search/image", files={"file": ("q.png", png, "image/png")}, data={"k": "10"})
    body = r.json()
    assert body["expected_precision"] == pytest.approx(float(np.mean([h["relevance"] for h in body["hits"]])))
    assert body["expected_relevant"] >= sum(h["relevance"] for h in body["hits"]) - 1e-9
    assert body["quality"]["kind"] is None  # an image has no query kind


@pytest.mark.parametrize("text", [*QUERIES, "three shapes: a red circle"])
def test_few_likely_relevant_results_are_said_so(client: httpx.Client, text: str) -> None:
    """The warning is there exactly when the top 10's mean relevance (before threshold) is < 0.5."""
    top = _search(client, text, k=10)
    mean = float(np.mean([h["relevance"] for h in top["hits"]]))
    warning = f"few results are likely relevant: expected precision of the top 10 is {mean:.2f}"
    for params in ({}, {"min_relevance": 0.3}, {"offset": 20}):  # the same whatever the page and threshold
        warnings = _search(client, text, k=10, **params)["quality"]["warnings"]
        assert (warning in warnings) == (mean < 0.5), (mean, warnings)


def test_query_kinds_and_vocabulary_on_the_embedded_benchmark(client: httpx.Client) -> None:
    info = client.get("/v1/info").json()["calibration"]
    kinds = info["kinds"]
    body = _search(client, "three shapes: a red circle", k=5)
    assert body["quality"]["kind"] == "count"
    assert body["quality"]["kind_p_at_10"] == kinds["count"]["p_at_10"]
    # a word the model cannot read: still answered, with no relevance and one warning naming the word
    body = _search(client, "a purple unicorn", k=5)
    assert body["quality"]["kind"] is None and body["quality"]["kind_p_at_10"] is None and body["hits"]
    assert body["quality"]["warnings"] == [body["quality"]["evidence"]["reason"]]
    assert "'unicorn'" in body["quality"]["warnings"][0]
    body = _search(client, "a red", k=5, min_relevance=0.1)  # known words, but no noun: outside the grammar
    assert body["quality"]["evidence"]["inside"]
    assert any("vocabulary" in w for w in body["quality"]["warnings"])


NO_EVIDENCE = ["qwerty", "!!!", "\u200b", "the eiffel tower at night", "circle circle red red square"]


@pytest.mark.parametrize("text", NO_EVIDENCE)
def test_no_promise_without_evidence(client: httpx.Client, text: str) -> None:
    """Nonsense, a zero-width space, another domain, word salad of known words: the calibration has
    no evidence for them, so no relevance is shown, no min_relevance passes anything (not even 0),
    and the response says why in plain words."""
    body = _search(client, text, k=10)
    evidence = body["quality"]["evidence"]
    assert evidence["inside"] is False
    assert evidence["reason"].startswith("no relevance is given for this query")
    assert body["quality"]["warnings"][0] == evidence["reason"]
    assert body["hits"] and all(h["relevance"] is None for h in body["hits"])  # still ranked by score
    assert body["calibration"] is None and body["expected_precision"] is None
    assert body["expected_relevant"] is None
    for p in (0.0, 0.5, 0.9):
        passed = _search(client, text, k=10, min_relevance=p)
        assert (passed["passed"], passed["hits"], passed["passed_is_exact"]) == (0, [], True)
        assert passed["threshold"] == {"kind": "min_relevance", "value": p, "score": None}
    filtered = _search(client, text, k=10, min_relevance=0.0, filter={"is_distractor": True})
    assert filtered["passed"] == 0 and filtered["quality"]["evidence"]["inside"] is False
    by_score = _search(client, text, k=10, min_score=-1.0)  # a raw-score threshold still applies
    assert by_score["passed"] > 0 and all(h["relevance"] is None for h in by_score["hits"])


def test_queries_inside_the_evidence_are_promised(client: httpx.Client) -> None:
    for text in QUERIES:
        body = _search(client, text, k=10)
        evidence = body["quality"]["evidence"]
        assert evidence["inside"] and evidence["reason"] is None and evidence["unknown_words"] == []
        assert 0 < evidence["p_value"] <= 1 and all(h["relevance"] is not None for h in body["hits"])


def test_a_format_2_calibration_serves_without_the_check_and_says_so(artifacts, make_server, tmp_path):
    calibration = json.loads((artifacts.images / "calibration.json").read_text())
    calibration["format_version"] = 2
    del calibration["evidence"]
    server = make_server(index=index_with_calibration(artifacts, tmp_path, calibration)).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        body = _search(c, "qwerty", k=5)
        assert body["quality"]["evidence"] is None and body["hits"][0]["relevance"] is not None
        assert any("predates the evidence check" in w for w in body["quality"]["warnings"])
    server.stop()


def test_a_kind_the_model_handles_poorly_gets_a_warning(artifacts, make_server, tmp_path) -> None:
    calibration = json.loads((artifacts.images / "calibration.json").read_text())
    for kind, row in calibration["kinds"].items():
        row.update(handled_well=kind != "count", p_at_10=0.31 if kind == "count" else 0.9)
    note = "labels are the annotations: relevance is underestimated"
    calibration["labels_note"] = note  # as a Flickr30k / COCO calibration has it
    server = make_server(index=index_with_calibration(artifacts, tmp_path, calibration)).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        count = _search(c, "three shapes: a red circle left of a blue square", k=5)
        assert count["quality"]["kind"] == "count" and count["quality"]["kind_p_at_10"] == 0.31
        assert (
            "'count' queries (they state how many objects there are) are handled poorly by this model: "
            "on held-out captions its P@10 for them is 0.31; expect wrong images even at high relevance"
        ) in count["quality"]["warnings"]
        fine = _search(c, "a red circle", k=5)
        assert fine["quality"]["kind"] == "one_object" and fine["quality"]["kind_p_at_10"] == 0.9
        assert not any("handled poorly" in w for w in fine["quality"]["warnings"])
        assert fine["quality"]["warnings"][-1] == note  # the labels' bias, on every answer
        png = _png(c, 4)
        r = c.post("/v1/search/image", files={"file": ("q.png", png, "image/png")}, data={"k": "5"})
        assert r.status_code == 200 and note in r.json()["quality"]["warnings"]
        info = c.get("/v1/info").json()["calibration"]
        assert info["kinds"]["count"]["handled_well"] is False and info["labels_note"] == note
    server.stop()


def test_a_format_1_calibration_still_serves_with_its_global_map(artifacts, make_server, tmp_path) -> None:
    from icr.training.evaluation.metrics.calibration import Calibration

    sha256 = json.loads((artifacts.images / "calibration.json").read_text())["checkpoint_sha256"]
    x, y = (-1.0, 0.0, 0.3, 0.6, 1.0), (0.0, 0.05, 0.2, 0.6, 0.95)
    old = {**Calibration("isotonic", x, y, fit={"pairs": 1}).to_dict(), "checkpoint_sha256": sha256}
    server = make_server(index=index_with_calibration(artifacts, tmp_path, old)).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        info = c.get("/v1/info").json()["calibration"]
        assert (info["method"], info["global_method"], info["format_version"]) == ("global", "isotonic", 1)
        assert info["kinds"] == {} and info["labels_note"] is None
        for p in (0.0, 0.05, 0.1):
            body = _search(c, QUERIES[0], k=50, min_relevance=p)
            assert body["calibration"] == "global"
            for h in body["hits"]:
                assert h["relevance"] >= p and h["relevance"] == pytest.approx(np.interp(h["score"], x, y))
            relevances = [h["relevance"] for h in body["hits"]]
            assert all(a >= b for a, b in zip(relevances, relevances[1:], strict=False))
        body = _search(c, "three shapes: a red circle", k=5)
        assert body["quality"]["kind"] == "count" and body["quality"]["kind_p_at_10"] is None
        assert not any("handled poorly" in w for w in body["quality"]["warnings"])
        png = _png(c, 2)
        r = c.post("/v1/search/image", files={"file": ("q.png", png, "image/png")}, data={"k": "5"})
        assert r.status_code == 200 and r.json()["calibration"] == "global"
    server.stop()
