"""Labelling where the user is, against a real `icr serve`: hits labelled through POST /v1/feedback are
on disk (read back with FeedbackStore, and after a restart), GET /v1/feedback counts them, and POST
/v1/feedback/refit fits a calibration on them that the server serves before it answers. Bad input is
a 4xx naming the fix; a refit without labels is a 409 saying what to do."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from icr.client import ApiError, Client
from icr.index.feedback_labels import FEEDBACK_FILE, FeedbackStore, index_key
from icr.index.manifest import Manifest

QUERIES = ("a red circle", "a blue square", "a green triangle", "a yellow star")


def served_copy(artifacts, folder: Path) -> Path:
    """A copy of the session's image index: a refit replaces its calibration.json."""
    copy = folder / "images"
    shutil.copytree(artifacts.images, copy)
    return copy


def label_hits(c: httpx.Client, per_query: int = 8) -> tuple[int, set[str], int]:
    """Labels hits of several gallery captions as a user would: a hit is relevant when the query is
    one of its captions. Returns (judgements, queries, relevant)."""
    captions: list[str] = []
    for seed in QUERIES:
        for hit in c.post("/v1/search/text", json={"text": seed, "k": 20}).json()["hits"]:
            first = (hit["metadata"].get("captions") or [None])[0]
            if not hit["is_distractor"] and first and first not in captions:
                captions.append(first)
                break
    assert len(captions) >= 3, captions
    judged, relevant = 0, 0
    for query in captions:
        r = c.post("/v1/search/text", json={"text": query, "k": per_query})
        assert r.status_code == 200, r.text
        for hit in r.json()["hits"]:
            is_relevant = query in (hit["metadata"].get("captions") or [])
            body = {"query": query, "image_id": hit["id"], "relevant": is_relevant}
            answer = c.post("/v1/feedback", json=body)
            assert answer.status_code == 200, answer.text
            judged += 1
            relevant += is_relevant
            assert answer.json()["recorded"] == body
            assert answer.json()["counts"]["judgements"] == judged
    return judged, set(captions), relevant


def test_labels_are_stored_counted_kept_and_refit(make_server, artifacts, tmp_path) -> None:
    index = served_copy(artifacts, tmp_path)
    state = tmp_path / "state"
    server = make_server(index=index, ICR_STATE_DIR=str(state)).start()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        ntotal = c.get("/v1/info").json()["index"]["ntotal"]
        # bad input first, while there are no labels
        r = c.post("/v1/feedback/refit")
        assert r.status_code == 409 and r.json()["error"] == "no_labels", r.text
        assert "mark hits relevant or not" in r.json()["message"]
        r = c.post("/v1/feedback", json={"query": "a red circle", "image_id": ntotal, "relevant": True})
        assert r.status_code == 404 and f"ids run from 0 to {ntotal - 1}" in r.json()["message"], r.text
        for body, says in (
            ({"query": "a red circle", "image_id": "3", "relevant": True}, "image_id"),
            ({"query": "a red circle", "image_id": 3, "relevant": "yes"}, "relevant"),
            ({"query": " \t", "image_id": 3, "relevant": True}, "query: empty"),
            ({"query": "x" * 20_000, "image_id": 3, "relevant": True}, "ICR_MAX_TEXT_CHARS"),
            ({"query": "a red circle", "image_id": 3}, "relevant"),
            ({"query": "a red circle", "image_id": 3, "relevant": True, "who": "me"}, "who"),
            ({"query": "a\x00b", "image_id": 3, "relevant": True}, "control character"),
        ):
            r = c.post("/v1/feedback", json=body)
            assert r.status_code in (413, 422) and says in r.json()["message"], (body, r.text)
        empty = c.get("/v1/feedback").json()
        assert empty["counts"] == {"judgements": 0, "hits": 0, "queries": 0, "relevant": 0}
        assert empty["can_label"] is True  # localhost, no ICR_ADMIN_KEY

        judged, queries, relevant = label_hits(c)
        assert judged >= 20 and relevant >= 1
        counts = c.get("/v1/feedback").json()["counts"]
        assert counts == {"judgements": judged, "hits": judged, "queries": len(queries), "relevant": relevant}
        # judging a hit again replaces the verdict: no new judgement
        query = sorted(queries)[0]
        first_id = c.post("/v1/search/text", json={"text": query, "k": 1}).json()["hits"][0]["id"]
        again = c.post("/v1/feedback", json={"query": query, "image_id": first_id, "relevant": True})
        assert again.json()["counts"]["judgements"] == judged
        relevant = again.json()["counts"]["relevant"]

    # on disk: read by the store itself, then by a restarted server
    manifest = Manifest.read(index)
    key = index_key(manifest.checkpoint_sha256, manifest.created)
    labels = FeedbackStore(state / FEEDBACK_FILE).labels(key)
    assert len(labels) == judged and {label.query for label in labels} == queries
    server.stop()
    server = make_server(index=index, ICR_STATE_DIR=str(state)).start()
    with httpx.Client(base_url=server.url, timeout=120) as c:
        assert c.get("/v1/feedback").json()["counts"]["judgements"] == judged
        assert c.get("/v1/info").json()["calibration"]["labels"] != "user"

        r = c.post("/v1/feedback/refit")
        assert r.status_code == 200, r.text
        result = r.json()
        assert result["status"] == "refitted" and result["calibration"]["labels"] == "user"
        assert result["supports"]["used"] == judged and result["supports"]["relevant"] == relevant
        for target in ("0.5", "0.8", "0.9"):
            entry = result["supports"]["thresholds"][target]
            assert "reached" in entry and ("more_labels" in entry or "best_bound" in entry), entry
        # served already when the refit answered
        assert c.get("/v1/info").json()["calibration"]["labels"] == "user"
        feedback = c.get("/v1/feedback").json()
        assert feedback["calibration_labels"] == "user" and feedback["supports"] == result["supports"]
        r = c.post("/v1/search/text", json={"text": query, "k": 5, "min_relevance": 0.5})
        assert r.status_code == 200, r.text
        assert r.json()["calibration"] is not None
    server.stop()
    assert "Traceback" not in server.log_text()


def test_labelling_needs_the_admin_key_when_one_is_set(make_server, artifacts, tmp_path) -> None:
    index = served_copy(artifacts, tmp_path)
    server = make_server(index=index, ICR_ADMIN_KEY="admin", ICR_STATE_DIR=str(tmp_path / "state")).start()
    body = {"query": "a red circle", "image_id": 0, "relevant": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/feedback", json=body)
        assert r.status_code == 401 and "ICR_ADMIN_KEY" in r.json()["message"], r.text
        assert c.post("/v1/feedback/refit", headers={"X-API-Key": "wrong"}).status_code == 403
        assert c.get("/v1/feedback").json()["can_label"] is False  # reading is open
        r = c.post("/v1/feedback", json=body, headers={"X-API-Key": "admin"})
        assert r.status_code == 200, r.text
        assert c.get("/v1/feedback", headers={"X-API-Key": "admin"}).json()["can_label"] is True
    manifest = Manifest.read(index)
    key = index_key(manifest.checkpoint_sha256, manifest.created)
    with FeedbackStore(tmp_path / "state" / FEEDBACK_FILE)._connect() as db:
        assert db.execute("SELECT who FROM labels WHERE index_key = ?", (key,)).fetchall() == [("admin-key",)]


def test_the_labels_of_a_querys_hits_are_read_back(make_server, artifacts, tmp_path) -> None:
    """GET /v1/feedback/labels: each judged hit of a query with the majority's verdict (a tie: not
    relevant), its judgements and the caller's own verdict; read access, as GET /v1/feedback. Other
    people's judgements are written into the server's labels file beside it (every request of the
    server opens the file: it reads them)."""
    state = tmp_path / "state"
    server = make_server(ICR_API_KEY="reader", ICR_ADMIN_KEY="admin", ICR_STATE_DIR=str(state)).start()
    admin, reader = {"X-API-Key": "admin"}, {"X-API-Key": "reader"}
    manifest = Manifest.read(artifacts.images)
    key = index_key(manifest.checkpoint_sha256, manifest.created)
    query = QUERIES[0]
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.get("/v1/feedback/labels", params={"query": query})
        assert r.status_code == 401 and "ICR_API_KEY" in r.json()["message"], r.text
        assert (
            c.get("/v1/feedback/labels", params={"query": query}, headers={"X-API-Key": "x"}).status_code
            == 403
        )
        r = c.get("/v1/feedback/labels", params={"query": f" {query}\t"}, headers=reader)
        assert r.status_code == 200, r.text
        assert r.json() == {"index": artifacts.images.name, "query": query, "labels": []}

        ids = [
            h["id"]
            for h in c.post("/v1/search/text", json={"text": query, "k": 6}, headers=reader).json()["hits"]
        ]
        assert len(ids) == 6
        for i, image_id in enumerate(ids[:4]):  # the admin: relevant, not, relevant, not
            body = {"query": query, "image_id": image_id, "relevant": i % 2 == 0}
            assert c.post("/v1/feedback", json=body, headers=admin).status_code == 200
        store = FeedbackStore(state / FEEDBACK_FILE)
        store.add(key, query, ids[0], False, "ana")  # 1 of 2 relevant: a tie, not relevant
        store.add(key, query, ids[1], True, "ana")
        store.add(key, query, ids[1], True, "bo")  # 2 of 3 relevant
        store.add(key, query, ids[4], True, "ana")  # judged by ana only
        store.add(key, QUERIES[1], ids[5], True, "ana")  # another query's label: not this one's
        expected = {  # image_id -> (relevant, judgements, relevant_judgements, mine)
            ids[0]: (False, 2, 1, True),
            ids[1]: (True, 3, 2, False),
            ids[2]: (True, 1, 1, True),
            ids[3]: (False, 1, 0, False),
            ids[4]: (True, 1, 1, None),
        }

        def read(headers: dict[str, str], **params: object) -> dict[int, tuple[bool, int, int, bool | None]]:
            r = c.get("/v1/feedback/labels", params={"query": query, **params}, headers=headers)
            assert r.status_code == 200, r.text
            labels = r.json()["labels"]
            assert [x["image_id"] for x in labels] == sorted(x["image_id"] for x in labels)
            return {
                x["image_id"]: (x["relevant"], x["judgements"], x["relevant_judgements"], x["mine"])
                for x in labels
            }

        assert read(admin) == expected
        # a reader has no admin identity: no verdict of its own
        assert read(reader) == {i: (*v[:3], None) for i, v in expected.items()}
        some = [ids[1], ids[4], ids[5], 10**9]
        assert read(admin, image_id=some) == {i: expected[i] for i in some if i in expected}
        # the admin changes a verdict: still one judgement of theirs, and the tie becomes a majority
        c.post("/v1/feedback", json={"query": query, "image_id": ids[0], "relevant": False}, headers=admin)
        assert read(admin, image_id=[ids[0]]) == {ids[0]: (False, 2, 0, False)}
        c.post("/v1/feedback", json={"query": query, "image_id": ids[3], "relevant": True}, headers=admin)
        assert read(admin, image_id=[ids[3]]) == {ids[3]: (True, 1, 1, True)}

        # bad input: a 4xx naming the parameter and the fix, as POST /v1/feedback's
        for params, says in (
            ({}, "query: Field required"),
            ({"query": " \t"}, "query: empty"),
            ({"query": "x" * 1001}, "ICR_MAX_TEXT_CHARS"),
            ({"query": "a\x00b"}, "control character U+0000"),
            ({"query": query, "image_id": "-1"}, "image_id.0: Input should be greater than or equal to 0"),
            ({"query": query, "image_id": "three"}, "image_id.0: Input should be a valid integer"),
            ({"query": query, "image_id": str(2**63)}, "image_id.0: Input should be less than or equal to"),
            ({"query": query, "image_id": list(range(101))}, "image_id: List should have at most 100 items"),
        ):
            r = c.get("/v1/feedback/labels", params=params, headers=admin)
            assert r.status_code == 422 and says in r.json()["message"], (params, r.text)
            assert r.json()["error"] == "invalid_request"

    # the client: typed, any number of ids (asked for 100 at a time)
    with Client(server.url, api_key="admin") as icr:
        found = icr.labels(f"  {query}")
        assert found.query == query and [hit.image_id for hit in found.labels] == sorted(expected)
        assert {hit.image_id: hit.mine for hit in found.labels}[ids[3]] is True
        many = icr.labels(query, [*range(250), *ids])
        assert [hit.image_id for hit in many.labels] == sorted(expected)
        assert icr.labels(query, []).labels == []
        with pytest.raises(ApiError) as refused:
            icr.labels(" ")
        assert refused.value.status == 422 and "query: empty" in refused.value.message
    with Client(server.url, api_key="reader") as icr:
        assert all(hit.mine is None for hit in icr.labels(query).labels)
    server.stop()
    assert "Traceback" not in server.log_text()


def test_the_client_labels_and_refits(make_server, artifacts, tmp_path) -> None:
    server = make_server(
        index=served_copy(artifacts, tmp_path), ICR_STATE_DIR=str(tmp_path / "state")
    ).start()
    with Client(server.url, timeout=120) as icr:
        with pytest.raises(ApiError) as refused:
            icr.refit()
        assert refused.value.status == 409 and refused.value.error == "no_labels"
        # a gallery caption as the query: its own image is among the hits, relevant
        seed = icr.search_text(QUERIES[0], k=20)
        query = next(
            h.metadata["captions"][0] for h in seed.hits if not h.is_distractor and h.metadata.get("captions")
        )
        hits = icr.search_text(query, k=6).hits
        for n, hit in enumerate(hits, 1):
            answer = icr.label(query, hit.id, relevant=query in (hit.metadata.get("captions") or []))
            assert answer["counts"]["judgements"] == n
        held = icr.feedback()
        assert held["can_label"] and held["counts"]["hits"] == len(hits) and held["counts"]["relevant"] >= 1
        given = icr.labels(query, [hit.id for hit in hits]).labels  # read back, each with this client's own
        assert [x.image_id for x in given] == sorted(hit.id for hit in hits)
        assert all(x.judgements == 1 and x.mine == x.relevant for x in given)
        assert sum(x.relevant for x in given) == held["counts"]["relevant"]
        result = icr.refit()
        assert result["status"] == "refitted" and result["calibration"]["labels"] == "user"
        assert icr.info()["calibration"]["labels"] == "user"
    server.stop()


def test_an_image_added_since_the_build_is_labelled_and_counts_in_the_refit(
    make_server, artifacts, tmp_path
) -> None:
    """A living index: labels name added images as any other, the refit scores them as served now
    (they are not in the index folder), and a deleted image can no longer be labelled."""
    index = served_copy(artifacts, tmp_path)
    server = make_server(index=index, ICR_STATE_DIR=str(tmp_path / "state")).start()
    with httpx.Client(base_url=server.url, timeout=120) as c:
        judged, queries, relevant = label_hits(c)
        query = sorted(queries)[0]
        # the added image: the query's own embedding, so it is that query's top hit
        import icr

        vector = icr.load(artifacts.checkpoint, device="cpu").encode_text([query])[0]
        r = c.post("/v1/images", json={"images": [{"vector": vector.tolist(), "source": "new.jpg"}]})
        assert r.status_code == 200, r.text
        added = r.json()["written"][0]["id"]
        assert c.post("/v1/search/text", json={"text": query, "k": 1}).json()["hits"][0]["id"] == added
        r = c.post("/v1/feedback", json={"query": query, "image_id": added, "relevant": True})
        assert r.status_code == 200, r.text
        r = c.post("/v1/feedback/refit")
        assert r.status_code == 200, r.text
        supports = r.json()["supports"]
        assert supports["used"] == judged + 1 and supports["relevant"] == relevant + 1
        assert c.delete(f"/v1/images/{added}").status_code == 200
        r = c.post("/v1/feedback", json={"query": query, "image_id": added, "relevant": False})
        assert r.status_code == 404 and "less deleted ones" in r.json()["message"], r.text
    server.stop()
    assert "Traceback" not in server.log_text()
