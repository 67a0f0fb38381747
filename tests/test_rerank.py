"""index/rerank.py: fast-scan codes re-ranked exactly from the raw vectors, against naive loops; the
folder it is built into, compacted and cut into shards."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from icr.index.rerank import RAW_FILE, Rerank, RerankedIndex, best_first
from icr.index.vector_index import build_index, search, set_nprobe

pytestmark = pytest.mark.usefixtures("faiss_one_thread")
N, DIM = 1500, 32


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)  # (n, D)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    return _unit(np.random.default_rng(0), N)


@pytest.fixture(scope="module")
def codes(vectors: np.ndarray) -> faiss.Index:
    return build_index(vectors, DIM, "IVF8,PQ16x4fs,RFlat", gpu="off")


def _naive(query: np.ndarray, ids: np.ndarray, vectors: np.ndarray, k: int) -> list[tuple[float, int]]:
    """The best k of ``ids`` by exact score (float64), ties by id, -1 ids skipped."""
    scored = [
        (float(vectors[i].astype(np.float64) @ query.astype(np.float64)), int(i)) for i in ids if i >= 0
    ]
    scored.sort(key=lambda t: (-t[0], t[1]))
    return scored[:k]


def test_best_first_keeps_the_best_k_ties_by_id() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        n, k = int(rng.integers(0, 40)), int(rng.integers(1, 30))
        if rng.random() < 0.5:
            scores = rng.choice([-0.5, -0.0, 0.0, 0.2, 0.3], size=n).astype(np.float32)  # many ties
        else:
            scores = (2 * rng.random(n) - 1).astype(np.float32)  # none
        ids = rng.permutation(1000)[:n].astype(np.int64)
        padding = rng.random(n) < 0.2
        ids[padding], scores[padding] = -1, -np.inf  # FAISS's padding, scored as _scores does
        s, i = best_first(scores, ids, k)
        want = sorted(((float(a), int(b)) for a, b in zip(scores, ids, strict=True) if b >= 0),
                      key=lambda t: (-t[0], t[1]))[:k]  # fmt: skip
        assert list(zip(s.tolist(), i.tolist(), strict=True)) == want
    with pytest.raises(ValueError, match="2\\^32"):  # ids share 64-bit sort keys with the scores
        best_first(np.zeros(2, np.float32), np.array([1, 2**32]), 1)


@pytest.mark.parametrize("k", [1, 10, 60])
def test_search_is_the_exact_order_of_the_codes_candidates(codes, vectors, k) -> None:
    """A search re-ranks the codes' own best ``candidates(k)`` exactly (here 2k, at least 20), and a
    selector given in the parameters reaches the codes' search (only its ids come back)."""
    rerank = Rerank(k_factor=2, min_candidates=20)
    index = RerankedIndex(codes, vectors, 0, rerank)
    queries = _unit(np.random.default_rng(2), 12)
    params = faiss.SearchParametersIVF()
    params.nprobe = 3
    scores, ids = index.search(queries, k, params=params)  # (Q, k)
    _, candidates = codes.search(queries, rerank.candidates(k), params=params)
    for q in range(len(queries)):
        want = _naive(queries[q], candidates[q], vectors, k)
        assert ids[q].tolist() == [i for _, i in want]
        np.testing.assert_allclose(scores[q], [s for s, _ in want], atol=1e-6)

    inside = faiss.IDSelectorRange(200, 700)
    params.sel = inside
    _, ids = index.search(queries, k, params=params)
    _, candidates = codes.search(queries, rerank.candidates(k), params=params)
    for q in range(len(queries)):
        assert ((ids[q] >= 200) & (ids[q] < 700)).all()
        assert ids[q].tolist() == [i for _, i in _naive(queries[q], candidates[q], vectors, k)]


def test_probing_every_list_and_candidate_is_exact_search_and_batch_independent(codes, vectors) -> None:
    index = RerankedIndex(codes, vectors, 0, Rerank(k_factor=1, min_candidates=N))
    queries = _unit(np.random.default_rng(3), 9)
    scores, ids = search(index, queries, 25, nprobe=8)
    for q in range(len(queries)):
        want = _naive(queries[q], np.arange(N), vectors, 25)
        assert ids[q].tolist() == [i for _, i in want]
    for q in range(len(queries)):  # one query at a time: the same bits
        alone_s, alone_i = search(index, queries[q : q + 1], 25, nprobe=8)
        np.testing.assert_array_equal(alone_i[0], ids[q])
        np.testing.assert_array_equal(alone_s[0], scores[q])
        np.testing.assert_array_equal(index.rescore(queries[q], ids[q]), scores[q])


def test_ids_are_offset_by_the_first_row_and_raw_rows_are_read_back(codes, vectors) -> None:
    """A shard's raw vectors start at its first id: the row of id i is i - first."""
    lo = 400
    shard = faiss.clone_index(codes)
    shard.remove_ids(faiss.IDSelectorNot(faiss.IDSelectorRange(lo, N)))
    index = RerankedIndex(shard, np.ascontiguousarray(vectors[lo:]), lo, Rerank(1, N))
    query = _unit(np.random.default_rng(4), 1)
    _, ids = search(index, query, 10, nprobe=8)
    assert ids[0].tolist() == [i for _, i in _naive(query[0], np.arange(lo, N), vectors, 10)]
    np.testing.assert_array_equal(index.read(np.array([lo, N - 1])), vectors[[lo, N - 1]])
    with pytest.raises(KeyError, match="no raw vector"):
        index.read(np.array([lo - 1]))


@pytest.mark.parametrize("factory", ["IVF4,PQ4x4fs,RFlat", "IVF4,SQ8,RFlat", "IVF4,Flat"])
def test_a_stream_in_order_trains_on_all_of_it(tmp_path: Path, factory: str) -> None:
    """A collection that streams one corner first (a photo folder in path order): the build's
    inverted files train on a random sample of everything streamed, so a part that comes after the
    training size (10,000 vectors for PQ, 200 here for IVF4,Flat) still gets lists of its own. The
    spilled stream is the re-ranked index's raw file, and is deleted for any other."""
    from icr.index.build import _trained_on_all

    rng = np.random.default_rng(1)
    dim = 8
    corners = np.eye(dim, dtype=np.float32)[:2]  # (2, D) the two parts' centres
    parts = []
    for centre, n in zip(corners, (14_000, 6_000), strict=True):
        part = centre + 0.1 * rng.standard_normal((n, dim)).astype(np.float32)  # (n, D)
        parts.append(part / np.linalg.norm(part, axis=1, keepdims=True))
    stream = np.concatenate(parts)  # (20000, D) the first part first
    report: dict[str, str] = {}
    spill = tmp_path / "spilled.f32"
    index = _trained_on_all(iter(np.array_split(stream, 40)), dim, factory, spill, "off", report)
    codes = index.codes if isinstance(index, RerankedIndex) else index
    centroids = faiss.extract_index_ivf(codes).quantizer.reconstruct_n(0, 4)  # (4, D)
    nearest_part = np.argmax(centroids @ corners.T, axis=1)  # (4,)
    assert set(nearest_part.tolist()) == {0, 1}  # trained on the first vectors alone: all near part 0
    assert index.ntotal == len(stream) and report["built_on"] == "cpu"
    if isinstance(index, RerankedIndex):
        np.testing.assert_array_equal(np.fromfile(spill, np.float32).reshape(-1, dim), stream)
    else:
        assert not spill.exists()
    set_nprobe(index, 4)  # every list
    _, found = index.search(stream[-5:], 1)  # (5, 1) the last vectors find themselves
    np.testing.assert_array_equal(found[:, 0], np.arange(len(stream) - 5, len(stream)))


@pytest.mark.parametrize(
    "factory, rerank", [("IVF2,PQ16x4fs,RFlat", (4, 1280)), ("IVF2,SQ8,RFlat", (1, 128))]
)
def test_a_built_folder_keeps_the_raw_vectors_and_is_served_exactly(
    tiny_benchmark: Path, tiny_checkpoint: Path, tmp_path: Path, factory: str, rerank: tuple[int, int]
) -> None:
    """``icr index build --factory IVF2,PQ16x4fs,RFlat`` (or ``IVF2,SQ8,RFlat``, scanned by the
    compiled kernel): the raw vectors are the exact index's vectors, recorded with their hash;
    loaded, the folder searches as the exact one (2 lists, all probed, every vector a candidate); a
    changed raw file is refused by name."""
    from icr.index.build import build_image_index
    from icr.index.index_folder import load_index_dir

    kw = {"distractors": 50, "progress": False, "gpu": "off", "batch_size": 16}
    build_image_index(tiny_checkpoint, tiny_benchmark, out=tmp_path / "exact", factory="Flat", **kw)
    manifest = build_image_index(tiny_checkpoint, tiny_benchmark, out=tmp_path / "rr", factory=factory, **kw)
    assert manifest.rerank == {"file": RAW_FILE, "k_factor": rerank[0], "min_candidates": rerank[1]}
    assert RAW_FILE in manifest.files and manifest.recall_check["nprobe"] >= 1
    exact, _, store = load_index_dir(tmp_path / "exact")
    store.close()
    index, loaded, store = load_index_dir(tmp_path / "rr")
    store.close()
    assert isinstance(index, RerankedIndex) and loaded.rerank == manifest.rerank
    everything = exact.reconstruct_n(0, exact.ntotal)  # (62, D)
    np.testing.assert_array_equal(index.raw, everything)
    queries = everything[:10] + 0.05
    _, want = search(exact, queries, 20)
    _, got = search(index, queries, 20, nprobe=2)
    for w, g in zip(want, got, strict=True):
        assert g.tolist() == w.tolist()

    raw = tmp_path / "rr" / RAW_FILE
    raw.write_bytes(raw.read_bytes()[:-4])
    with pytest.raises(ValueError, match=f"{RAW_FILE}: its content changed since the build"):
        load_index_dir(tmp_path / "rr")


@pytest.mark.parametrize("shards", [2, 3])
def test_shards_of_a_reranked_folder_merge_to_the_single_index(
    tmp_path: Path, codes, vectors, shards
) -> None:
    """Cut by compaction: each shard's raw file holds its own range's rows, and the shards' merged
    top-k is the single index's (every list probed, every vector a candidate)."""
    from icr.index.index_folder import load_index_dir
    from icr.index.metadata import MetadataStore
    from icr.index.shard import shard_index, shard_ranges
    from tests.index_folders import write_index_folder

    folder = write_index_folder(
        tmp_path / "rr", RerankedIndex(codes, vectors, 0, Rerank(1, N)), "IVF8,PQ16x4fs,RFlat"
    )
    with MetadataStore.create(folder / "metadata.sqlite") as store:
        store.add({"id": i, "source": f"{i}.jpg"} for i in range(N))
    queries = _unit(np.random.default_rng(5), 8)
    single, _, store = load_index_dir(folder)
    store.close()
    want_s, want_i = search(single, queries, 30, nprobe=8)
    lists = []
    for w, (lo, hi) in zip(
        shard_index(folder, tmp_path / "shards", shards), shard_ranges(N, shards), strict=True
    ):
        index, manifest, store = load_index_dir(w["folder"])
        store.close()
        assert isinstance(index, RerankedIndex) and index.first == lo and len(index.raw) == hi - lo
        assert (tmp_path / "shards" / Path(w["folder"]).name / RAW_FILE).stat().st_size == (hi - lo) * DIM * 4
        np.testing.assert_array_equal(index.raw, vectors[lo:hi])
        lists.append(search(index, queries, 30, nprobe=8))
    for q in range(len(queries)):
        s = np.concatenate([found[0][q] for found in lists])
        i = np.concatenate([found[1][q] for found in lists])
        merged_s, merged_i = best_first(s, i, 30)
        assert merged_i.tolist() == want_i[q].tolist()
        np.testing.assert_array_equal(merged_s, want_s[q])


@pytest.mark.parametrize("factory", ["IVF2,PQ16x4fs,RFlat", "IVF2,SQ8,RFlat"])
def test_served_folder_reads_raw_vectors_and_searches_through_the_batcher(
    tiny_benchmark: Path,
    tiny_checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    factory: str,
) -> None:
    """The server's load of a re-ranked folder: its stored vectors are the raw ones (not approximate),
    and the micro-batched search and, after deletions, the selector search give the exact order. The
    8-bit codes' list scan is made at load, not by the first user's search."""
    from icr.index import live_index
    from icr.index.build import build_image_index
    from icr.service.loaded_index import load_index_folder

    kw = {"distractors": 50, "progress": False, "gpu": "off", "batch_size": 16}
    build_image_index(tiny_checkpoint, tiny_benchmark, out=tmp_path / "rr", factory=factory, **kw)
    loaded = load_index_folder(
        tmp_path / "rr", "off", max_batch=8, faiss_threads=1, writes=tmp_path / "state"
    )
    try:
        assert not loaded.approximate_vectors and loaded.rescore is None and loaded.vectors is not None
        assert isinstance(loaded.index, RerankedIndex)
        assert (loaded.index.list_scan._scan is not None) == ("SQ8" in factory)
        everything = loaded.index.raw  # (62, D)
        np.testing.assert_array_equal(loaded.vectors(np.arange(62)), everything)
        queries = everything[:5] + 0.05
        for q in queries:
            _, ids = loaded.live.search(q[None], 20, loaded.live.refresh())
            assert ids.tolist() == [i for _, i in _naive(q, np.arange(62), everything, 20)]
        monkeypatch.setattr(live_index, "OVERFETCH_LIMIT", 0)  # deleted ids: a selector of the live ones
        loaded.live.delete(list(range(0, 62, 2)), "t")
        for q in queries:
            _, ids = loaded.live.search(q[None], 20, loaded.live.refresh())
            assert ids.tolist() == [i for _, i in _naive(q, np.arange(1, 62, 2), everything, 20)]
    finally:
        loaded.live.close()
        assert loaded.metadata is not None
        loaded.metadata.close()


def test_raw_blocks_read_back_what_save_raw_wrote(tmp_path: Path) -> None:
    from icr.index.rerank import raw_blocks, save_raw

    rows = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    save_raw(tmp_path / RAW_FILE, iter([rows[:2], rows[2:]]))
    blocks = list(raw_blocks(tmp_path / RAW_FILE, 3, chunk=3))
    assert [len(b) for b in blocks] == [3, 3, 1]
    np.testing.assert_array_equal(np.concatenate(blocks), rows)
