"""What a user with their own photo collection asks of a real `icr serve`: filters whose values must
have the kinds the fields hold (text, image, similar and vector search alike), search from a stored
image and from an embedding (against numpy over the stored vectors, and against text search), each
image's stored metadata, and the client's wait for readiness."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import threading
from pathlib import Path
from typing import Any

import faiss
import httpx
import numpy as np
import pytest
import torch
from server_support import Artifacts

from icr.client import ApiError, Client
from icr.index.build import build_photo_index
from icr.index.manifest import MANIFEST_FILE
from icr.service.schemas import ImageMetadata, VectorSearchResponse
from icr.training.checkpoint import load_checkpoint

N_PHOTOS = 30
FIELDS = ["album", "year", "rating"]


@pytest.fixture(scope="module")
def photos(artifacts: Artifacts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An index over a photo folder (the synthetic test split's images, under names of the user's)
    with a metadata file: album (text), year (integers), rating (numbers)."""
    root = tmp_path_factory.mktemp("own-photos")
    folder = root / "my-photos"
    (folder / "trips").mkdir(parents=True)
    rows = []
    for i, source in enumerate(sorted(artifacts.data.rglob("synth_test_*.png"))[:N_PHOTOS]):
        name = f"trips/{i:02d}.png" if i % 3 == 0 else f"{i:02d}.png"
        shutil.copy(source, folder / name)
        rows.append({"file": name, "album": ["home", "trip"][i % 2], "year": 2015 + i % 10, "rating": i / 4})
    with open(root / "meta.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["file", *FIELDS])
        writer.writeheader()
        writer.writerows(rows)
    index = root / "index"
    build_photo_index(
        artifacts.checkpoint, images=folder, metadata=root / "meta.csv", out=index, gpu="off", progress=False
    )
    return {"index": index, "rows": rows, "root": root}


@pytest.fixture(scope="module")
def own(make_server, photos: dict[str, Any]):
    return make_server(index=photos["index"]).start()


def _stored_vectors(index: Path) -> np.ndarray:
    """(N, D): every vector the index folder stores, read with FAISS here, in the test."""
    loaded = faiss.read_index(str(index / "index.faiss"))
    return loaded.reconstruct_n(0, loaded.ntotal)


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "message", "detail"}
    return str(body["message"])


def test_a_filter_value_of_the_wrong_kind_is_a_422_on_every_search(own, photos) -> None:
    said = 'filter.year: the index stores integers in "year"; got the string "2024"'
    with httpx.Client(base_url=own.url, timeout=30) as c:
        info = c.get("/v1/info").json()["index"]
        assert info["metadata_field_types"] == {
            "album": ["string"],
            "year": ["integer"],
            "rating": ["number"],
        }
        bad = {"year": "2024"}
        assert said in _error(c.post("/v1/search/text", json={"text": "a red circle", "filter": bad}), 422)
        assert said in _error(
            c.post("/v1/search/vector", json={"vector": [1.0] * info["dim"], "filter": bad}), 422
        )
        assert said in _error(c.post("/v1/search/similar", json={"image_id": 0, "filter": bad}), 422)
        png = c.get("/v1/images/0").content
        form = {"include_images": "true", "filter": json.dumps(bad)}
        assert said in _error(c.post("/v1/search/image", data=form, files={"file": ("q.png", png)}), 422)
        # the same filters with values of the right kinds: integers and numbers compare
        for good in ({"year": 2024}, {"year": {"gte": 2019.5}}, {"rating": 2}, {"album": {"in": ["trip"]}}):
            r = c.post("/v1/search/text", json={"text": "a red circle", "filter": good})
            assert r.status_code == 200, (good, r.text)
        r = c.post("/v1/search/text", json={"text": "a circle", "filter": {"album": {"gt": 1}}})
        assert 'filter.album.gt: the index stores strings in "album", and a range compares' in _error(r, 422)


def test_image_search_filters_the_similar_images(own, photos) -> None:
    rows = photos["rows"]
    with Client(own.url) as icr:
        png = icr.image(3)
        found = icr.search_image(
            png, k=50, include_images=True, filter={"album": "trip", "year": {"gte": 2018}}
        )
        similar = found.similar_images
        assert similar is not None
        want = {r["file"] for r in rows if r["album"] == "trip" and r["year"] >= 2018}
        assert similar.matched == len(want) == similar.passed == len(similar.hits)
        assert {h.metadata["source"] for h in similar.hits} == want
        unfiltered = icr.search_image(png, k=50, include_images=True).similar_images
        assert unfiltered is not None
        assert [h.id for h in similar.hits] == [h.id for h in unfiltered.hits if h.metadata["source"] in want]
    with httpx.Client(base_url=own.url, timeout=30) as c:
        for form, says in (
            (
                {"filter": '{"album": "trip"}'},
                "filter: selects gallery images by their metadata, which image",
            ),
            ({"include_images": "true", "filter": "{album: trip}"}, "filter: not a JSON object"),
            ({"include_images": "true", "filter": '{"a": 1, "a": 2}'}, "a: given twice"),
            ({"include_images": "true", "filter": '{"albm": "x"}'}, "unknown field 'albm'"),
        ):
            r = c.post("/v1/search/image", data=form, files={"file": ("q.png", png)})
            assert says in _error(r, 422), form
        blank = c.post(
            "/v1/search/image", data={"filter": " ", "include_images": "true"}, files={"file": png}
        )
        assert blank.status_code == 200  # a form cannot send null: blank is no filter


def _text_vector(checkpoint: Path, text: str) -> list[float]:
    """A caption's embedding, computed here as a user would with the served checkpoint."""
    model, _ = load_checkpoint(checkpoint, "cpu")
    with torch.inference_mode():
        return [float(v) for v in model.encode_text(model.tokenize([text]))[0]]


def _same_hits(a: list[Any], b: list[Any]) -> None:
    """Equal ids and scores, except that tied scores may come in either order."""
    assert len(a) == len(b)
    np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=1e-5)
    for x, y in zip(a, b, strict=True):
        assert x.id == y.id or abs(x.score - y.score) < 1e-5


@pytest.mark.parametrize(
    "options",
    [{}, {"min_score": 0.1}, {"k": 7, "offset": 3}, {"filter": {"is_distractor": False}}],
    ids=["plain", "min_score", "page", "filter"],
)
def test_search_by_a_captions_embedding_is_text_search(server, artifacts: Artifacts, options) -> None:
    """The session's server, with its calibration: the vector search gives the text search's hits,
    with no relevance, and says why."""
    text = "a red circle left of a blue square"
    vector = _text_vector(artifacts.checkpoint, text)
    with Client(server.url) as icr:
        by_text = icr.search_text(text, **{"k": 20, **options})
        # not a unit vector as sent: the server normalises it
        by_vector = icr.search_vector([3.0 * v for v in vector], **{"k": 20, **options})
    assert isinstance(by_vector, VectorSearchResponse) and by_vector.query.kind == "vector"
    _same_hits(by_vector.hits, by_text.hits)
    for key in ("passed", "searched", "matched", "passed_is_exact", "k", "offset"):
        assert getattr(by_vector, key) == getattr(by_text, key), key
    assert by_text.calibration is not None and by_vector.calibration is None
    assert all(h.relevance is None for h in by_vector.hits)
    assert by_vector.expected_precision is None and by_vector.expected_relevant is None
    assert any("no calibrated relevance" in w for w in by_vector.quality.warnings)


def test_search_from_a_stored_image_is_an_exact_search_over_the_stored_vectors(own, photos) -> None:
    vectors = _stored_vectors(photos["index"])  # (N, D)
    n = len(vectors)
    with Client(own.url) as icr:
        for item in (0, 7, n - 1):
            found = icr.search_similar(item, k=n)
            assert (
                found.query.kind == "image" and found.query.image_id == item and not found.query.approximate
            )
            # the naive way: every other stored vector's cosine with this one, the best kept
            query = vectors[item] / np.linalg.norm(vectors[item])
            best_id, best_score = None, -2.0
            for other in range(n):
                score = float(np.dot(vectors[other], query))
                if other != item and score > best_score:
                    best_id, best_score = other, score
            top = found.hits[0]
            assert top.id == best_id or abs(top.score - best_score) < 1e-5
            assert abs(top.score - best_score) < 1e-5
            assert item not in [h.id for h in found.hits] and found.searched == found.passed == n - 1
            assert found.passed_is_exact
            with_self = icr.search_similar(item, k=3, include_self=True)
            assert with_self.hits[0].id == item and abs(with_self.hits[0].score - 1.0) < 1e-5
            assert [h.id for h in with_self.hits[1:]] == [h.id for h in found.hits[:2]]
        trips = icr.search_similar(0, k=n, filter={"album": "trip"}, min_score=-1.0)
        want = {r["file"] for r in photos["rows"] if r["album"] == "trip"}
        itself = icr.image_metadata(0).source
        assert {h.metadata["source"] for h in trips.hits} == want - {itself} and trips.matched == len(want)


def test_searches_without_text_refuse_what_they_cannot_do(own, server) -> None:
    with httpx.Client(base_url=own.url, timeout=30) as c:
        dim = c.get("/v1/info").json()["index"]["dim"]
        n = c.get("/v1/info").json()["index"]["ntotal"]
        for body, status, says in (
            ({"image_id": n}, 404, f"image_id: no image {n}: ids run from 0 to {n - 1}"),
            ({"image_id": 2**70}, 404, "ids run from 0 to"),
            ({"image_id": -1}, 422, "image_id: Input should be greater than or equal to 0"),
            ({"image_id": "3"}, 422, "image_id: Input should be a valid integer"),
            (
                {"image_id": 0, "min_relevance": 0.5},
                422,
                "min_relevance: no calibrated relevance for a search",
            ),
            ({"image_id": 0, "include_self": "yes"}, 422, "include_self: Input should be a valid boolean"),
        ):
            assert says in _error(c.post("/v1/search/similar", json=body), status), body
        for vector, says in (
            ([0.5] * (dim - 1), f"vector: {dim - 1} values; this index's vectors have {dim}"),
            ([0.0] * dim, "vector: every value is 0 (norm 0)"),
            ([1e400] + [0.0] * (dim - 1), "vector[0]: not a finite number"),
            (["1"] + [0.0] * (dim - 1), "vector.0: Input should be a valid number"),
            ([True] * dim, "vector.0: Input should be a valid number"),
            ([], "vector: List should have at least 1 item"),
        ):
            content = json.dumps({"vector": vector}).replace("Infinity", "1e400")
            r = c.post("/v1/search/vector", content=content, headers={"content-type": "application/json"})
            assert says in _error(r, 422), vector[:2]
        r = c.post("/v1/search/vector", json={"vector": [1.0] * dim, "min_relevance": 0.1})
        assert "min_relevance: no calibrated relevance" in _error(r, 422)
        r = c.post("/v1/search/vector", json={"vector": [1.0] * dim, "k": 10_000})
        assert "k: " in _error(r, 422)
        # tiny and huge values are directions like any other
        for scale in (1e-300, 1e300):
            r = c.post("/v1/search/vector", json={"vector": [scale] * dim})
            assert r.status_code == 200 and r.json()["hits"], r.text


def test_an_index_that_cannot_give_vectors_back_says_what_to_do(
    make_server, photos, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A FAISS index with an id map cannot reconstruct by id: similar search is a 409 that says what
    to do instead, and vector search still works."""
    folder = tmp_path_factory.mktemp("no-vectors") / "index"
    shutil.copytree(photos["index"], folder)
    vectors = _stored_vectors(folder)
    mapped = faiss.IndexIDMap(faiss.IndexFlatIP(vectors.shape[1]))
    mapped.add_with_ids(vectors, np.arange(len(vectors), dtype=np.int64))
    faiss.write_index(mapped, str(folder / "index.faiss"))
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    manifest["files"]["index.faiss"] = _sha256(folder / "index.faiss")
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    server = make_server(index=folder).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        message = _error(c.post("/v1/search/similar", json={"image_id": 1}), 409)
        assert "cannot give back its stored vectors" in message and "POST /v1/search/vector" in message
        assert c.post("/v1/search/vector", json={"vector": vectors[1].tolist()}).status_code == 200
    server.stop()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_images_metadata_is_its_stored_row_without_server_paths(own, photos, server) -> None:
    rows = photos["rows"]
    with Client(own.url) as icr:
        # ids follow the folder's listing, sorted by relative path
        listed = sorted(rows, key=lambda r: r["file"])
        for i in (0, 3, len(rows) - 1):
            meta = icr.image_metadata(i)
            assert isinstance(meta, ImageMetadata) and meta.id == i
            row = listed[i]
            assert meta.source == row["file"] and meta.file_name == Path(row["file"]).name
            assert meta.fields == {"album": row["album"], "year": row["year"], "rating": row["rating"]}
            assert meta.is_distractor is False and meta.image_url == f"/v1/images/{i}"
            assert str(photos["root"]) not in meta.model_dump_json()
        for bad in (len(rows), -1, 2**70):
            with pytest.raises(ApiError) as err:
                icr.image_metadata(bad)
            assert err.value.status == 404
            assert f"no image {bad}: ids run from 0 to {len(rows) - 1}" in err.value.message
    with Client(server.url) as icr:  # the session's index: a generated distractor has no file
        last = icr.info()["index"]["ntotal"] - 1
        distractor = icr.image_metadata(last)
        assert distractor.is_distractor and distractor.file_name is None
        assert distractor.source.startswith("distractor:") and distractor.image_url == f"/v1/images/{last}"


def test_wait_ready_returns_once_a_starting_server_is_ready(make_server, photos) -> None:
    server = make_server(index=photos["index"])
    starting = threading.Thread(target=server.start)
    with Client(server.url, backoff=0.05) as icr:
        starting.start()  # the client asks before the process listens, and while it loads
        ready = icr.wait_ready(timeout=90)
        assert ready["status"] == "ready"
    starting.join()
    server.stop()
    with Client(server.url, backoff=0.05) as icr, pytest.raises(TimeoutError, match="no answer from"):
        icr.wait_ready(timeout=0.3)
