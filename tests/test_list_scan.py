"""index/list_scan.py: the compiled scan of 8-bit codes in inverted lists, against a naive decode of
every code written here; where it applies; re-ranked searches through it."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
from faiss.contrib.inspect_tools import get_invlist

from icr.index.list_scan import LazyListScan, ListScan
from icr.index.rerank import Rerank, RerankedIndex
from icr.index.vector_index import build_index, search

pytestmark = pytest.mark.usefixtures("faiss_one_thread")
N, DIM, NLIST = 3000, 24, 12


def _unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)  # (n, D)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    return _unit(np.random.default_rng(0), N)


def _sq8(vectors: np.ndarray, by_residual: bool) -> faiss.Index:
    quantizer = faiss.IndexFlatIP(DIM)
    index = faiss.IndexIVFScalarQuantizer(
        quantizer, DIM, NLIST, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT
    )
    index.by_residual = by_residual
    index.train(vectors)
    index.add_with_ids(vectors, np.arange(N, dtype=np.int64) * 7 + 3)  # ids are not positions
    return index


def _naive_scores(index: faiss.Index, query: np.ndarray) -> tuple[list[int], dict[int, tuple[int, float]]]:
    """(the lists by centroid score, best first; each id's list and score in float64): every code
    decoded by the formula, vmin + (code + 0.5) / 255 * vdiff (+ its centroid), one at a time."""
    ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist).astype(np.float64)
    near = [float(centroids[i] @ query.astype(np.float64)) for i in range(ivf.nlist)]
    trained = faiss.vector_to_array(ivf.sq.trained).astype(np.float64)
    vmin, vdiff = trained[:DIM], trained[DIM:]
    scores = {}
    for li in range(ivf.nlist):
        ids, codes = get_invlist(lists, li)
        for row, code in zip(ids, codes.reshape(-1, DIM), strict=True):
            decoded = [vmin[d] + (code[d] + 0.5) / 255 * vdiff[d] for d in range(DIM)]
            if ivf.by_residual:
                decoded = [decoded[d] + centroids[li, d] for d in range(DIM)]
            scores[int(row)] = (li, sum(decoded[d] * float(query[d]) for d in range(DIM)))
    return sorted(range(ivf.nlist), key=lambda i: -near[i]), scores


def _naive_best(index: faiss.Index, query: np.ndarray, nprobe: int) -> dict[int, float]:
    """Each id's score in the ``nprobe`` lists of highest centroid score (:func:`_naive_scores`)."""
    order, scores = _naive_scores(index, query)
    probed = set(order[:nprobe])
    return {i: s for i, (li, s) in scores.items() if li in probed}


@pytest.mark.parametrize("by_residual", [True, False])
def test_candidates_are_the_best_codes_by_a_naive_decode(vectors, by_residual) -> None:
    index = _sq8(vectors, by_residual)
    scan = ListScan.of(index)
    assert scan is not None
    queries = _unit(np.random.default_rng(1), 4)
    naive = [_naive_scores(index, query) for query in queries]
    for nprobe, c in ((1, 5), (3, 40), (5, 200), (NLIST, 1)):
        got = scan.candidates(queries, c, nprobe)  # (Q, c)
        assert got.shape == (len(queries), c)
        for q, query in enumerate(queries):
            order, every = naive[q]
            scores = {i: s for i, (li, s) in every.items() if li in order[:nprobe]}
            ranked = sorted(scores.values(), reverse=True)
            cut = ranked[c - 1]
            # those clearly above the c-th best are in, those clearly below are not (float32 sums
            # may order near-equal codes either way)
            assert {i for i, s in scores.items() if s > cut + 1e-5} <= set(got[q].tolist())
            assert not {i for i, s in scores.items() if s < cut - 1e-5} & set(got[q].tolist())
            assert len(set(got[q].tolist())) == c
            # FAISS's own scan of the same lists finds the same, but for codes tied with the cut
            params = faiss.SearchParametersIVF()
            params.nprobe = nprobe
            _, by_faiss = index.search(query[None], c, params=params)  # (1, c)
            differ = set(got[q].tolist()) ^ set(by_faiss[0].tolist())
            assert all(abs(scores[i] - cut) <= 1e-5 for i in differ)


def test_the_formula_is_faiss_decode(vectors) -> None:
    """The naive decode above is FAISS's own reconstruction of the codes (so the oracle is right)."""
    index = _sq8(vectors, True)
    faiss.extract_index_ivf(index).set_direct_map_type(faiss.DirectMap.Hashtable)  # ids are not positions
    query = _unit(np.random.default_rng(2), 1)[0]
    scores = _naive_best(index, query, NLIST)
    ids = np.array(sorted(scores), np.int64)
    faiss_scores = index.reconstruct_batch(ids).astype(np.float64) @ query.astype(np.float64)
    np.testing.assert_allclose([scores[i] for i in ids], faiss_scores, atol=1e-5)


def test_lists_with_fewer_codes_than_asked_give_them_all_then_minus_one(vectors) -> None:
    index = _sq8(vectors, True)
    scan = ListScan.of(index)
    query = _unit(np.random.default_rng(3), 1)
    scores = _naive_best(index, query[0], 1)
    got = scan.candidates(query, len(scores) + 7, 1)[0]
    assert set(got[: len(scores)].tolist()) == set(scores)
    assert (got[len(scores) :] == -1).all()


def test_a_nan_query_is_answered_without_reading_outside_the_lists(vectors) -> None:
    scan = ListScan.of(_sq8(vectors, True))
    got = scan.candidates(np.full((1, DIM), np.nan, np.float32), 30, 4)
    assert got.shape == (1, 30) and set(got[0].tolist()) <= set((np.arange(N) * 7 + 3).tolist()) | {-1}


@pytest.mark.parametrize(
    "factory, metric",
    [
        ("IVF8,Flat", faiss.METRIC_INNER_PRODUCT),
        ("IVF8,PQ8np", faiss.METRIC_INNER_PRODUCT),  # np: no polysemous training (slow)
        ("IVF8,SQ4", faiss.METRIC_INNER_PRODUCT),
        ("IVF8,SQ8", faiss.METRIC_L2),
        ("Flat", faiss.METRIC_INNER_PRODUCT),
    ],
)
def test_it_applies_to_8_bit_codes_under_the_inner_product_only(vectors, factory, metric) -> None:
    index = faiss.index_factory(DIM, factory, metric)
    index.train(vectors)
    index.add(vectors)
    assert ListScan.of(index) is None
    assert ListScan.of(faiss.index_factory(DIM, "IVF8,SQ8", faiss.METRIC_INNER_PRODUCT)) is None  # untrained
    assert ListScan.of(_sq8(vectors, True)) is not None


def test_a_reranked_search_through_the_scan_is_exact_when_every_list_is_probed(vectors) -> None:
    """All lists, every code a candidate: exact search, and the same as FAISS's scan (a selector of
    every id sends the search there)."""
    codes = build_index(vectors, DIM, f"IVF{NLIST},SQ8,RFlat", gpu="off")
    index = RerankedIndex(codes, vectors, 0, Rerank(k_factor=N, min_candidates=N))
    queries = _unit(np.random.default_rng(4), 5)
    scores, ids = search(index, queries, 20, nprobe=NLIST)
    exact = vectors.astype(np.float64) @ queries.astype(np.float64).T  # (N, Q)
    for q in range(len(queries)):
        assert ids[q].tolist() == np.argsort(-exact[:, q], kind="stable")[:20].tolist()
    _, by_faiss = search(index, queries, 20, nprobe=NLIST, selector=faiss.IDSelectorRange(0, N))
    assert [i.tolist() for i in by_faiss] == [i.tolist() for i in ids]


def test_the_scan_sees_codes_added_after_it_was_made(vectors) -> None:
    codes = build_index(vectors[:2000], DIM, f"IVF{NLIST},SQ8,RFlat", gpu="off")
    index = RerankedIndex(codes, vectors, 0, Rerank.for_factory("IVF12,SQ8,RFlat"))
    assert index.rerank == Rerank(1, 128)
    search(index, vectors[:1], 5, nprobe=NLIST)  # the scan made
    codes.add_with_ids(vectors[2000:], np.arange(2000, N, dtype=np.int64))
    _, ids = search(index, vectors[2500:2501], 1, nprobe=NLIST)
    assert ids[0].tolist() == [2500]


def test_the_lazy_scan_is_made_once_and_none_where_it_does_not_apply(vectors) -> None:
    lazy = LazyListScan(_sq8(vectors, True))
    first = lazy.get()
    assert first is not None and lazy.get() is first
    assert LazyListScan(faiss.IndexFlatIP(DIM)).get() is None
