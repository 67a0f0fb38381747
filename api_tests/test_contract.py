"""The contract of every endpoint, and a valid OpenAPI schema."""

from __future__ import annotations

import io
import json

import httpx
from openapi_spec_validator import validate
from PIL import Image
from server_support import N_DISTRACTORS

IMAGE_HIT_KEYS = {"id", "rank", "score", "relevance", "is_distractor", "image_url", "metadata"}
PAGE_KEYS = {"threshold", "passed", "passed_is_exact", "searched", "k", "offset", "matched"}
ASSESSMENT_KEYS = {"calibration", "expected_precision", "expected_relevant", "quality"}


def _png(color=(200, 30, 30), size=(32, 32)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def test_health_readiness_and_info(client: httpx.Client, artifacts) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready", "calibrated": True}
    info = client.get("/v1/info").json()
    assert info["checkpoint"]["objective"]["name"] == "ntxent"
    assert info["checkpoint"]["embed_dim"] == 32 and info["checkpoint"]["accepts_images"] is True
    index = info["index"]
    assert (index["modality"], index["factory"], index["gallery_count"], index["distractor_count"]) == (
        "image",
        "Flat",
        40,
        N_DISTRACTORS,
    )
    assert index["ntotal"] == 40 + N_DISTRACTORS
    assert info["caption_index"]["modality"] == "text" and info["caption_index"]["ntotal"] == 200
    calibration = info["calibration"]
    assert (calibration["format_version"], calibration["method"], calibration["global_method"]) == (
        3,
        "per_query",
        "isotonic",
    )
    assert calibration["labels"] == "ground_truth" and calibration["labels_note"] is None
    assert calibration["evidence"] == {"alpha": 0.01, "queries": calibration["fit"]["queries"]}
    assert calibration["fit"]["split"] == "val" and calibration["fit"]["gallery"] == "this index"
    evaluation = calibration["evaluation"]
    assert evaluation["split"] == "test" and set(evaluation["maps"]) == {"per_query", "global"}
    for pooled in evaluation["maps"].values():  # pooled figures only: no per-kind or reliability bins
        assert {"p_at_10", "ece", "thresholds"} <= set(pooled) and "by_kind" not in pooled
    assert calibration["kinds"] and all(
        {"queries", "p_at_10", "precision_at_0.5", "recall_at_0.5", "handled_well"} == set(row)
        for row in calibration["kinds"].values()
    )
    assert info["device"] == "cpu" and info["faiss_threads"] == 1
    assert info["limits"]["max_k"] == 100 and info["datasets"] == ["synthetic"]
    assert info["benchmarks_need_api_key"] is False


def test_openapi_schema_is_valid_and_lists_every_endpoint(client: httpx.Client) -> None:
    schema = client.get("/openapi.json").json()
    validate(schema)
    for name in ("TextSearchResponse", "ImageSearchResponse"):  # the new fields are documented
        fields = schema["components"]["schemas"][name]["properties"]
        for field in ("calibration", "expected_precision", "expected_relevant"):
            assert fields[field].get("description"), (name, field)
    quality = schema["components"]["schemas"]["Quality"]["properties"]
    assert all(quality[f].get("description") for f in ("kind", "kind_p_at_10", "warnings"))
    paths = set(schema["paths"])
    assert {
        "/healthz",
        "/readyz",
        "/v1/info",
        "/v1/search/text",
        "/v1/search/image",
        "/v1/search/similar",
        "/v1/search/vector",
        "/v1/images/{image_id}",
        "/v1/images/{image_id}/metadata",
        "/v1/benchmarks",
        "/v1/benchmarks/{job_id}",
        "/metrics",
    } <= paths
    assert client.get("/docs").status_code == 200


def test_the_schema_states_this_servers_bounds_and_error_body(client: httpx.Client) -> None:
    schema = client.get("/openapi.json").json()
    info = client.get("/v1/info").json()["limits"]
    components = schema["components"]["schemas"]
    for name in ("TextSearchRequest", "Body_search_image_v1_search_image_post"):
        props = components[name]["properties"]
        assert (props["k"]["minimum"], props["k"]["maximum"]) == (1, info["max_k"]), name
        assert props["offset"]["maximum"] == info["search_depth"] - info["max_k"], name
    assert props["k"]["type"] == "integer"
    # the filter names exactly the served index's fields (this one has only the built-in flag)
    for name in ("TextSearchRequest", "SimilarSearchRequest", "VectorSearchRequest"):
        filter_schema = components[name]["properties"]["filter"]["anyOf"][0]
        assert filter_schema["properties"] == {"is_distractor": {"type": "boolean"}}, name
        assert filter_schema["additionalProperties"] is False, name
        props = components[name]["properties"]
        assert (props["k"]["minimum"], props["k"]["maximum"]) == (1, info["max_k"]), name
    # searches without text have no calibrated relevance to threshold; the index sets ids and dim
    index = client.get("/v1/info").json()["index"]
    for name in ("SimilarSearchRequest", "VectorSearchRequest"):
        assert "min_relevance" not in components[name]["properties"], name
    # labels name a built image; a similar search may name one added since (ids from ntotal up)
    assert components["FeedbackRequest"]["properties"]["image_id"]["maximum"] == index["ntotal"] - 1
    assert "maximum" not in components["SimilarSearchRequest"]["properties"]["image_id"]
    for name in ("VectorSearchRequest", "ImageToAdd"):
        vector = components[name]["properties"]["vector"]
        assert vector["minItems"] == vector["maxItems"] == index["dim"] == 32, name
    text = json.dumps(schema)
    assert "HTTPValidationError" not in text  # FastAPI's default 422 body is not what the server sends
    documented = {
        ("/v1/search/text", "post"): {413, 422, 503},
        ("/v1/search/image", "post"): {409, 413, 415, 422, 503},
        ("/v1/benchmarks", "post"): {401, 403, 404, 409, 413, 422, 429},
        ("/v1/benchmarks/{job_id}", "delete"): {401, 403, 404, 409},
        ("/v1/images/{image_id}", "get"): {404, 422, 503},
        ("/v1/images/{image_id}/metadata", "get"): {404, 422, 503},
        ("/v1/search/similar", "post"): {404, 409, 413, 422, 503},
        ("/v1/search/vector", "post"): {413, 422, 503},
        ("/readyz", "get"): {503},
    }
    for (path, method), codes in documented.items():
        responses = schema["paths"][path][method]["responses"]
        assert codes <= {int(c) for c in responses}, (path, method, sorted(responses))
        for code, response in responses.items():
            if code[0] in "45":
                assert response["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorBody"
                }, (path, method, code)


def test_text_search_response(client: httpx.Client) -> None:
    body = client.post("/v1/search/text", json={"text": "a red circle", "k": 5}).json()
    assert PAGE_KEYS | ASSESSMENT_KEYS | {"query", "hits", "timings"} == set(body)
    assert body["calibration"] == "per_query"
    assert set(body["quality"]) == {"kind", "kind_p_at_10", "warnings", "evidence"}
    assert body["quality"]["evidence"]["inside"] is True  # the calibration has seen queries like it
    assert body["quality"]["kind"] == "one_object" and isinstance(body["quality"]["warnings"], list)
    assert 0.0 <= body["expected_precision"] <= 1.0 and 0.0 <= body["expected_relevant"] <= 440
    assert body["query"] == "a red circle" and body["threshold"] == {
        "kind": "none",
        "value": None,
        "score": None,
    }
    assert body["searched"] == 440 and body["passed"] == 440 and body["passed_is_exact"] is True
    hits = body["hits"]
    assert [h["rank"] for h in hits] == [1, 2, 3, 4, 5]
    assert all(set(h) == IMAGE_HIT_KEYS for h in hits)
    scores = [h["score"] for h in hits]
    assert scores == sorted(scores, reverse=True) and all(-1.0001 <= s <= 1.0001 for s in scores)
    assert all(0.0 <= h["relevance"] <= 1.0 for h in hits)
    relevances = [h["relevance"] for h in hits]
    assert relevances == sorted(relevances, reverse=True)  # calibration is monotone in the score
    for h in hits:
        assert h["image_url"] == f"/v1/images/{h['id']}"
        assert h["is_distractor"] == (h["id"] >= 40)
        assert (h["metadata"]["image_id"] is None) == h["is_distractor"]
        assert h["metadata"]["scene"]["objects"]
    timings = body["timings"]
    assert set(timings) == {"encode_ms", "search_ms", "select_ms", "filter_ms", "metadata_ms", "total_ms"}
    assert timings["total_ms"] >= timings["encode_ms"] + timings["search_ms"] > 0


def test_images_endpoint_serves_gallery_and_distractor_pixels(client: httpx.Client) -> None:
    for image_id in (0, 39, 40, 40 + N_DISTRACTORS - 1):
        r = client.get(f"/v1/images/{image_id}")
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        assert Image.open(io.BytesIO(r.content)).size == (32, 32)
    # same bytes twice: distractors are re-rendered deterministically
    assert client.get("/v1/images/41").content == client.get("/v1/images/41").content
    thumb = Image.open(io.BytesIO(client.get("/v1/images/0", params={"size": "thumb"}).content))
    assert max(thumb.size) <= 160
    missing = client.get(f"/v1/images/{40 + N_DISTRACTORS}")
    assert missing.status_code == 404 and "ids run from 0 to" in missing.json()["message"]
    assert client.get("/v1/images/0", params={"size": "huge"}).status_code == 422


def test_image_search_returns_captions_and_similar_images(client: httpx.Client) -> None:
    gallery_png = client.get("/v1/images/3").content
    r = client.post(
        "/v1/search/image",
        files={"file": ("g.png", gallery_png, "image/png")},
        data={"k": "5", "include_images": "true"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert PAGE_KEYS | ASSESSMENT_KEYS | {"hits", "similar_images", "timings"} == set(body)
    assert body["calibration"] == "global" and body["quality"]["kind"] is None
    assert body["searched"] == 200 and len(body["hits"]) == 5
    for hit in body["hits"]:
        assert set(hit) == {"id", "rank", "score", "relevance", "caption", "image_id", "source"}
        assert hit["caption"] and 0 <= hit["image_id"] < 40
    similar = body["similar_images"]
    assert PAGE_KEYS | {"hits"} == set(similar)  # image-image: no relevance, so no assessment
    assert similar["hits"][0]["id"] == 3  # the gallery image itself is its own nearest neighbour
    assert similar["hits"][0]["score"] > 0.999
    plain = client.post("/v1/search/image", files={"file": ("x.png", _png(), "image/png")}).json()
    assert plain["similar_images"] is None and len(plain["hits"]) == 10


def test_metrics_count_requests_per_route_and_time_search_stages(client: httpx.Client) -> None:
    client.post("/v1/search/text", json={"text": "a blue square"})
    client.get("/v1/images/999999")
    text = client.get("/metrics").text
    assert 'icr_http_requests_total{method="POST",route="/v1/search/text",status="200"}' in text
    assert 'icr_http_requests_total{method="GET",route="/v1/images/{image_id}",status="404"}' in text
    assert (
        'icr_http_request_duration_seconds_bucket{le="0.005",method="POST",route="/v1/search/text"}' in text
    )
    for stage in ("encode", "search", "filter", "metadata"):
        assert f'icr_search_stage_duration_seconds_count{{endpoint="text",stage="{stage}"}}' in text


def test_search_page_and_unknown_routes(client: httpx.Client) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<html" in page.text.lower()
    unknown = client.get("/v1/nothing")
    assert unknown.status_code == 404 and unknown.json()["error"] == "not_found"
    wrong_method = client.get("/v1/search/text")
    assert wrong_method.status_code == 405 and wrong_method.json()["message"]


def test_no_response_spells_out_a_server_path(client: httpx.Client, artifacts) -> None:
    """Clients see folder names and dataset-relative sources, never where the server keeps files."""
    png = io.BytesIO()
    Image.new("RGB", (40, 40), (200, 30, 30)).save(png, format="PNG")
    responses = [
        client.get("/v1/info"),
        client.post("/v1/search/text", json={"text": "a red circle", "k": 20}),
        client.post(
            "/v1/search/image",
            files={"file": ("q.png", png.getvalue(), "image/png")},
            data={"k": "20", "include_images": "true"},
        ),
        client.post("/v1/benchmarks", json={"dataset": "synthetic", "split": "nope"}),
    ]
    for r in responses:
        assert r.status_code in (200, 422), r.text
        for root in (str(artifacts.root), str(artifacts.root.resolve())):
            at = r.text.find(root)
            assert at < 0, (r.request.url, r.text[max(0, at - 200) : at + 200])
    info = responses[0].json()
    assert info["index"]["name"] == artifacts.images.name
    assert info["checkpoint"]["name"] == artifacts.checkpoint.name
    gallery = [h for h in responses[1].json()["hits"] if not h["is_distractor"]]
    assert gallery and all(h["metadata"]["source"].startswith("images/") for h in gallery), gallery[:2]
    assert all(h["source"].startswith("images/") for h in responses[2].json()["hits"])


def test_a_gallery_file_gone_or_damaged_since_the_build_is_a_404_without_its_path(
    artifacts, make_server, tmp_path
) -> None:
    """GET /v1/images/{id} for a gallery file moved away or overwritten after the build: 404 naming
    the file as hits do (relative to the dataset), never the server's path (the OS's and PIL's own
    messages spell it out)."""
    import shutil

    from icr.index.build import build_image_index

    data = tmp_path / "data"  # a copy: the session's dataset stays whole for the other tests
    shutil.copytree(artifacts.data, data)
    index = tmp_path / "images"
    build_image_index(artifacts.checkpoint, data, distractors=0, out=index, progress=False, gpu="off")
    server = make_server(index=index).start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        hits = c.post("/v1/search/text", json={"text": "a red circle", "k": 2}).json()["hits"]
        (gone, gone_source), (damaged, damaged_source) = [(h["id"], h["metadata"]["source"]) for h in hits]
        assert c.get(f"/v1/images/{gone}").status_code == 200
        (data / gone_source).rename(tmp_path / "moved.png")
        (data / damaged_source).write_bytes(b"not a png any more")
        for image_id, source, says in (
            (gone, gone_source, "No such file or directory"),
            (damaged, damaged_source, "not an image in an accepted format (JPEG, PNG"),
        ):
            for size in ("full", "thumb"):
                r = c.get(f"/v1/images/{image_id}", params={"size": size})
                assert r.status_code == 404 and r.json()["error"] == "no_pixels", r.text
                assert f"{source}: {says}" in r.json()["message"], r.text
                assert str(tmp_path) not in r.text and str(tmp_path.resolve()) not in r.text, r.text
    server.stop()


def test_security_headers_and_cors(client: httpx.Client, make_server) -> None:
    page = client.get("/")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"
    api = client.get("/v1/info")
    assert api.headers["x-content-type-options"] == "nosniff" and "content-security-policy" not in api.headers
    assert "content-security-policy" not in client.get("/docs").headers  # Swagger UI loads from a CDN
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,x-api-key",
    }
    assert "access-control-allow-origin" not in client.options("/v1/search/text", headers=preflight).headers
    server = make_server(ICR_CORS_ORIGINS='["https://app.example"]', ICR_API_KEY="k").start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.options("/v1/search/text", headers=preflight)  # a preflight carries no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-api-key" in r.headers["access-control-allow-headers"].lower()
        other = c.options("/v1/search/text", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        headers = {"Origin": "https://app.example", "X-API-Key": "k"}
        r = c.post("/v1/search/text", json={"text": "a star"}, headers=headers)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    server.stop()


def test_probes_can_need_the_api_key(make_server) -> None:
    """ICR_HEALTH_NEED_KEY: /healthz and /readyz become read routes (the schema says so), for a
    server whose /readyz reasons should not be public; /metrics keeps its own setting."""
    server = make_server(ICR_API_KEY="reader", ICR_HEALTH_NEED_KEY="true").start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        schema = c.get("/openapi.json").json()
        for path in ("/healthz", "/readyz"):
            r = c.get(path)
            assert r.status_code == 401 and "ICR_API_KEY" in r.json()["message"], r.text
            assert c.get(path, headers={"X-API-Key": "nope"}).status_code == 403
            assert c.get(path, headers={"X-API-Key": "reader"}).status_code == 200
            operation = schema["paths"][path]["get"]
            assert operation["security"] == [{"ApiKey": []}] and {"401", "403"} <= set(operation["responses"])
        assert c.get("/metrics").status_code == 200
    server.stop()


def test_metrics_can_need_the_api_key(make_server) -> None:
    """ICR_METRICS_NEED_KEY: /metrics becomes a read route (the schema says so); probes stay open."""
    server = make_server(ICR_API_KEY="reader", ICR_METRICS_NEED_KEY="true").start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.get("/metrics")
        assert r.status_code == 401 and "ICR_API_KEY" in r.json()["message"], r.text
        assert c.get("/metrics", headers={"X-API-Key": "nope"}).status_code == 403
        r = c.get("/metrics", headers={"X-API-Key": "reader"})
        assert r.status_code == 200 and "icr_http_requests_total" in r.text
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200
        operation = c.get("/openapi.json").json()["paths"]["/metrics"]["get"]
        assert operation["security"] == [{"ApiKey": []}] and {"401", "403"} <= set(operation["responses"])
    server.stop()
