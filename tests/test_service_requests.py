"""Strict request parsing, the text check, client addresses, path scrubbing, the refusal penalty and
query vectors (normalised, and read back from each kind of index), each against a naive
implementation written here."""

from __future__ import annotations

import json
import re
import socket
import sqlite3
import time
import unicodedata
from decimal import Decimal, localcontext
from pathlib import Path

import faiss
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from icr.client import Client
from icr.index.metadata import MetadataStore, MetadataUnreadable
from icr.index.vector_index import build_index, stored_vectors
from icr.service.access import ADMIN_KEY_IDENTITY, access_of, admin_identity
from icr.service.client_address import client_of, trusted_networks
from icr.service.config import Settings
from icr.service.errors import validation_message, without_absolute_paths
from icr.service.refusal_penalty import RefusalPenaltyMiddleware
from icr.service.retriever import unit_query
from icr.service.schemas import BLANK, FeedbackRequest, check_text
from icr.service.strict_json import MAX_INTEGER_DIGITS, parse_strict

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(JSON_VALUES)
def test_strict_parsing_reads_valid_json_as_json_loads_does(value) -> None:
    body = json.dumps(value).encode()
    assert parse_strict(body) == json.loads(body)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('{"k": 5, "k": 50}', "k: given twice"),
        ('{"filter": {"year": 1, "year": 2}}', "year: given twice"),
        ('{"k": ' + "9" * 5000 + "}", "k: a number of 5000 digits"),
        ('{"k": -' + "9" * (MAX_INTEGER_DIGITS + 1) + "}", f"k: a number of {MAX_INTEGER_DIGITS + 1} digits"),
        ('{"filter": {"year": {"in": [1, ' + "9" * 40 + "]}}}", "in: a number of 40 digits"),
        ('{"min_score": NaN}', "min_score: NaN is not a JSON number"),
        ('{"min_score": -Infinity}', "min_score: -Infinity is not a JSON number"),
        ("9" * 5000, "a number of 5000 digits"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_strict_parsing_refuses_what_json_loads_reads_otherwise(body: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_strict(body.encode())


def test_the_longest_integer_taken_is_read_exactly() -> None:
    longest = "9" * MAX_INTEGER_DIGITS
    assert parse_strict(f'{{"k": {longest}, "o": -{longest}}}'.encode()) == {
        "k": int(longest),
        "o": -int(longest),
    }


def _naive_check(value: str) -> str | None:
    """The first refused character's message, by a loop over every character."""
    for i, ch in enumerate(value):
        if 0xD800 <= ord(ch) <= 0xDFFF:
            return f"character {i} is a lone surrogate (U+{ord(ch):04X})"
        if unicodedata.category(ch) == "Cc" and ch not in "\t\n\r":
            return f"character {i} is the control character U+{ord(ch):04X}"
    return None


@given(st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0xE000), max_size=30))
def test_the_text_check_refuses_what_a_loop_over_characters_refuses(value: str) -> None:
    expected = _naive_check(value)
    if expected is None:
        assert check_text(value) == value
    else:
        with pytest.raises(ValueError, match=re.escape(expected)):
            check_text(value)


def test_blank_is_pythons_whitespace_and_the_byte_order_mark() -> None:
    every = {chr(c) for c in range(0x110000) if chr(c).isspace()} | {"\ufeff"}
    assert set(BLANK) == every


def _scope(peer: str | None, forwarded: list[str] = ()) -> dict:
    return {
        "client": (peer, 50000) if peer else None,
        "headers": [(b"x-forwarded-for", value.encode()) for value in forwarded],
    }


@pytest.mark.parametrize(
    ("peer", "forwarded", "proxies", "address", "local"),
    [
        ("127.0.0.1", ["8.8.8.8"], (), "127.0.0.1", True),  # not a trusted proxy: the header is ignored
        ("::ffff:127.0.0.1", [], (), "127.0.0.1", True),
        ("10.0.0.9", ["127.0.0.1"], (), "10.0.0.9", False),  # a remote client cannot claim to be local
        ("127.0.0.1", ["8.8.8.8"], ("127.0.0.1",), "8.8.8.8", False),
        ("127.0.0.1", ["6.6.6.6, 8.8.8.8"], ("127.0.0.1",), "8.8.8.8", False),  # right-most untrusted
        ("10.0.0.2", ["8.8.8.8, 10.0.0.3"], ("10.0.0.0/8",), "8.8.8.8", False),  # a chain of proxies
        ("127.0.0.1", ["1.1.1.1", "8.8.8.8"], ("127.0.0.1",), "8.8.8.8", False),  # two header lines
        ("127.0.0.1", [], ("127.0.0.1",), None, False),  # the proxy forwarded nothing: unknown
        ("127.0.0.1", ["::1"], ("127.0.0.1",), "::1", True),
        ("192.168.1.1", ["8.8.8.8"], ("127.0.0.1",), "192.168.1.1", False),
        (None, [], (), None, False),
    ],
)
def test_the_client_is_the_peer_or_what_a_trusted_proxy_forwarded(
    peer, forwarded, proxies, address, local
) -> None:
    client = client_of(_scope(peer, forwarded), proxies)
    assert (client.address, client.is_local) == (address, local)


@pytest.mark.parametrize(
    ("method", "path", "need"),
    [
        ("POST", "/v1/feedback", "admin"),
        ("POST", "/v1/feedback/", "admin"),
        ("POST", "/v1/feedback/refit", "admin"),
        ("GET", "/v1/feedback", "read"),  # counts: anyone who may search
        ("GET", "/v1/feedback/labels", "read"),  # the labels of a query's hits: the same
        ("POST", "/v1/feedbackx", "read"),  # not the route: 404 for a reader, as any unknown path
    ],
)
def test_labelling_and_refitting_need_admin_rights(method: str, path: str, need: str) -> None:
    assert access_of(method, path, Settings(index=Path("index"))) == need


@pytest.mark.parametrize(
    ("admin_key", "peer", "sent", "who"),
    [
        (None, "127.0.0.1", None, "127.0.0.1"),  # no admin key: the local client, by its address
        (None, "::1", "anything", "::1"),
        (None, "10.0.0.9", None, None),  # remote, no admin key configured: no rights
        ("admin", "127.0.0.1", None, None),  # a key configured: only the key gives rights
        ("admin", "10.0.0.9", "admin", ADMIN_KEY_IDENTITY),  # never the key itself
        ("admin", "127.0.0.1", "wrong", None),
    ],
)
def test_who_labels_is_short_and_never_the_key(
    admin_key: str | None, peer: str, sent: str | None, who: str | None
) -> None:
    scope = _scope(peer)
    if sent is not None:
        scope["headers"].append((b"x-api-key", sent.encode()))
    settings = Settings(index=Path("index"), admin_key=admin_key)
    assert admin_identity(scope, settings) == who


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"query": "a cat", "image_id": "3", "relevant": True}, "not a string or boolean"),
        ({"query": "a cat", "image_id": True, "relevant": True}, "not a string or boolean"),
        ({"query": "a cat", "image_id": -1, "relevant": True}, "greater than or equal to 0"),
        ({"query": "a cat", "image_id": 3, "relevant": "true"}, "valid boolean"),
        ({"query": "a cat", "image_id": 3, "relevant": 1}, "valid boolean"),
        ({"query": "a\x07cat", "image_id": 3, "relevant": True}, "the control character U.0007; remove it"),
        ({"query": "a cat", "image_id": 3, "relevant": True, "who": "me"}, "Extra inputs"),
        ({"image_id": 3, "relevant": True}, "query"),
    ],
)
def test_a_bad_label_is_refused_naming_the_field(body: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        FeedbackRequest.model_validate(body)


@pytest.mark.parametrize(
    ("loc", "field"),
    [
        (("query", "query"), "query"),  # the query parameter named query (GET /v1/feedback/labels)
        (("body", "query"), "query"),  # the body's field named query (POST /v1/feedback)
        (("query", "image_id", 0), "image_id.0"),
        (("body", "filter", "year"), "filter.year"),
        (("body",), "body"),
    ],
)
def test_a_refusal_names_the_field_not_where_it_was_sent(loc: tuple, field: str) -> None:
    assert validation_message([{"loc": loc, "msg": "Field required"}]) == f"{field}: Field required"


def test_a_label_reads_an_integral_number_as_the_id() -> None:
    label = FeedbackRequest.model_validate({"query": "a cat", "image_id": 3.0, "relevant": False})
    assert (label.image_id, label.relevant) == (3, False)


def test_a_bad_trusted_proxy_is_named() -> None:
    with pytest.raises(ValueError, match="'10.0.0.300'"):
        trusted_networks(("127.0.0.1", "10.0.0.300"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/srv/icr/run/best/model.safetensors: bad header", "model.safetensors: bad header"),
        (
            "rebuild with `icr index build --checkpoint /home/u/run/best --out /srv/idx`",
            "rebuild with `icr index build --checkpoint best --out idx`",
        ),
        ("(file:///tmp/x/metadata.sqlite)", "(metadata.sqlite)"),
        ("POST /v1/admin/reload, then GET /readyz", "POST /v1/admin/reload, then GET /readyz"),
        ("images/metadata.sqlite changed", "images/metadata.sqlite changed"),
        ("see https://example.org/a/b", "see https://example.org/a/b"),
        ("the folder /data/coco/", "the folder (a folder)"),
    ],
)
def test_absolute_paths_become_their_last_component(text: str, expected: str) -> None:
    assert without_absolute_paths(text) == expected


def test_the_refusal_bucket_allows_the_burst_then_the_rate() -> None:
    penalty = RefusalPenaltyMiddleware(app=None, rate=2.0, burst=4.0)  # type: ignore[arg-type]
    assert [penalty._overdrawn("a") for _ in range(5)] == [False] * 4 + [True]
    assert penalty._overdrawn("b") is False  # per client
    time.sleep(0.6)  # 1.2 refills
    assert [penalty._overdrawn("a") for _ in range(2)] == [False, True]


def test_a_row_that_cannot_be_decoded_is_metadata_unreadable(tmp_path) -> None:
    path = tmp_path / "metadata.sqlite"
    with MetadataStore.create(path) as store:
        store.add(
            {
                "id": i,
                "source": f"{i}.png",
                "captions": ["a"],
                "is_distractor": False,
                "scene": None,
                "image_id": i,
            }
            for i in range(3)
        )
    with sqlite3.connect(path) as db:
        db.execute("UPDATE items SET captions = 'not json' WHERE id = 1")
    with MetadataStore.open(path) as store:
        assert store.get([0, 2])[1]["source"] == "2.png"
        with pytest.raises(MetadataUnreadable, match="row 1 cannot be decoded"):
            store.get([0, 1])
        with pytest.raises(MetadataUnreadable, match=r"no metadata for ids \[7\]"):
            store.get([7])


def _unit_by_decimals(values: list[float]) -> list[float]:
    """The oracle: a vector over its Euclidean norm, in 80-digit decimal arithmetic (no overflow or
    underflow at any float's magnitude)."""
    with localcontext() as ctx:
        ctx.prec = 80
        exact = [Decimal(v) for v in values]
        norm = sum(x * x for x in exact).sqrt()
        return [float(x / norm) for x in exact]


FINITE = st.floats(allow_nan=False, allow_infinity=False)


@given(st.lists(FINITE, min_size=1, max_size=12).filter(lambda v: any(x != 0 for x in v)))
def test_a_query_vector_is_normalised_as_exact_arithmetic_normalises_it(values: list[float]) -> None:
    got = unit_query(values, len(values))  # (1, D)
    assert got.shape == (1, len(values)) and got.dtype == np.float32
    np.testing.assert_allclose(got[0], np.float32(_unit_by_decimals(values)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("values", "dim", "says"),
    [
        (
            [1.0, 2.0],
            3,
            r"vector: 2 values; this index's vectors have 3 \(the served checkpoint's embed_dim\)",
        ),
        ([0.0, -0.0, 0.0], 3, r"vector: every value is 0 \(norm 0\), which has no direction"),
        ([1.0, float("inf"), 0.0], 3, r"vector\[1\]: not a finite number"),
        ([float("nan"), 1.0], 2, r"vector\[0\]: not a finite number"),
    ],
)
def test_a_bad_query_vector_is_named_with_the_fix(values: list[float], dim: int, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        unit_query(values, dim)


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat", "IVF4,PQ4", "HNSW8", "IVF4_HNSW8,Flat"])
def test_stored_vectors_are_what_was_added(factory: str) -> None:
    """Read back by id from every kind of index the builder makes; PQ codes only approximately."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((400, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = build_index(vectors, 16, factory, gpu="off")
    read = stored_vectors(index)
    assert read is not None
    ids = np.array([5, 0, 399, 5], np.int64)
    tolerance = 0.5 if "PQ" in factory else 1e-6  # PQ4 on 16 dims: a coarse code
    np.testing.assert_allclose(read(ids), vectors[ids], atol=tolerance)
    if "PQ" in factory:
        assert np.abs(read(ids) - vectors[ids]).max() > 1e-6  # approximate: what `approximate` says


def test_an_index_that_cannot_give_vectors_back_has_no_reader() -> None:
    ids_only = faiss.IndexIDMap(faiss.IndexFlatIP(4))  # stores vectors under ids it cannot invert
    ids_only.add_with_ids(np.eye(4, dtype=np.float32), np.array([10, 11, 12, 13], np.int64))
    assert stored_vectors(ids_only) is None
    assert stored_vectors(faiss.IndexFlatIP(4)) is None  # empty


def test_wait_ready_gives_up_saying_what_it_last_heard() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}", backoff=0.05) as client:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"not ready after 0.5 s; it last said: no answer from"):
            client.wait_ready(timeout=0.5)
        assert 0.5 <= time.monotonic() - t0 < 3.0
