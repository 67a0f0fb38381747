"""index/graph.py: hnswlib's graph renumbered into cluster order searches exactly as before; the graph
engine against naive loops (scores, ties, filters); its folder built, served, written to and
compacted."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

hnswlib = pytest.importorskip("hnswlib")  # the [graph] extra (also in [dev])

from icr.index.graph import (  # noqa: E402 (after the skip: the module needs hnswlib to run)
    EF_CONSTRUCTION,
    GRAPH_FILE,
    GraphIndex,
    GraphParams,
    build_graph,
    cell_order,
    node_labels,
    reorder_file,
)
from icr.index.vector_index import has_gpu_form, parse_factory, search, tune_ef  # noqa: E402

pytestmark = pytest.mark.usefixtures("faiss_one_thread")
N, DIM = 1500, 16


def _unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)  # (n, D)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    rng = np.random.default_rng(0)
    centres = _unit(rng, 20)
    v = centres[rng.integers(0, 20, N)] + 0.4 * rng.standard_normal((N, DIM)).astype(np.float32)
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def _plain(vectors: np.ndarray, ids: np.ndarray, m: int = 8) -> object:
    """hnswlib as its README builds it: one thread, so the graph is the same every time."""
    graph = hnswlib.Index(space="ip", dim=vectors.shape[1])
    graph.init_index(max_elements=len(vectors), ef_construction=100, M=m, random_seed=7)
    graph.add_items(vectors, ids, num_threads=1)
    return graph


def _naive(query: np.ndarray, vectors: np.ndarray, ids: np.ndarray, k: int) -> list[tuple[float, int]]:
    """The best k of (vectors, ids) by exact score (float64), ties by lower id."""
    q = query.astype(np.float64)
    scored = [(float(v.astype(np.float64) @ q), int(i)) for v, i in zip(vectors, ids, strict=True)]
    scored.sort(key=lambda t: (-t[0], t[1]))
    return scored[:k]


def test_renumbered_graph_searches_exactly_as_the_original(tmp_path: Path, vectors: np.ndarray) -> None:
    """Any permutation of the nodes: the same labels and distances at every ef, deleted marks kept;
    the identity writes the same bytes back."""
    ids = np.arange(N, dtype=np.int64) * 3 + 11
    graph = _plain(vectors, ids)
    graph.mark_deleted(int(ids[17]))
    graph.save_index(str(tmp_path / "src.hnsw"))
    queries = _unit(np.random.default_rng(1), 40)
    for seed in range(3):
        order = np.random.default_rng(seed).permutation(N)
        reorder_file(tmp_path / "src.hnsw", tmp_path / "dst.hnsw", order)
        moved = hnswlib.Index(space="ip", dim=DIM)
        moved.load_index(str(tmp_path / "dst.hnsw"))
        for ef in (10, 40, 300):
            graph.set_ef(ef)
            moved.set_ef(ef)
            want, want_d = graph.knn_query(queries, k=10)
            got, got_d = moved.knn_query(queries, k=10)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got_d, want_d)
        assert int(ids[17]) not in set(got.ravel().tolist())  # still deleted
    reorder_file(tmp_path / "src.hnsw", tmp_path / "same.hnsw", np.arange(N))
    assert (tmp_path / "same.hnsw").read_bytes() == (tmp_path / "src.hnsw").read_bytes()


def test_renumbering_refuses_what_it_cannot_read(tmp_path: Path, vectors: np.ndarray) -> None:
    graph = _plain(vectors[:100], np.arange(100))
    graph.save_index(str(tmp_path / "g.hnsw"))
    with pytest.raises(ValueError, match="permutation of the graph's 100 nodes"):
        reorder_file(tmp_path / "g.hnsw", tmp_path / "x.hnsw", np.zeros(100, np.int64))
    cut = tmp_path / "cut.hnsw"
    cut.write_bytes((tmp_path / "g.hnsw").read_bytes()[:-3])
    with pytest.raises(ValueError, match="cut.hnsw: not an hnswlib graph"):
        reorder_file(cut, tmp_path / "x.hnsw", np.arange(100))
    with pytest.raises(ValueError, match="cut.hnsw: not a readable hnswlib graph"):
        GraphIndex.load(cut, DIM)
    with pytest.raises(ValueError, match="vectors of 16 floats, 32 expected"):
        GraphIndex.load(tmp_path / "g.hnsw", 32)
    (tmp_path / "junk.hnsw").write_bytes(b"\x01" * 200)
    with pytest.raises(ValueError, match="junk.hnsw: not an hnswlib graph"):
        GraphIndex.load(tmp_path / "junk.hnsw", DIM)
    assert not (tmp_path / "x.hnsw").exists()


def test_build_graph_is_hnswlibs_graph_in_cell_order(tmp_path: Path, vectors: np.ndarray) -> None:
    """One thread: the graph hnswlib builds from the same random insertion order, node for node,
    laid out cell by cell (each k-means cell's nodes contiguous)."""
    ids = np.arange(N, dtype=np.int64) + 1000
    built = build_graph(vectors, ids, 8, tmp_path / GRAPH_FILE, threads=1, seed=4)
    inserted = np.random.default_rng(4).permutation(N)
    inserted = np.sort(inserted)  # one chunk of rows, read in row order
    plain = hnswlib.Index(space="ip", dim=DIM)
    plain.init_index(max_elements=N, ef_construction=EF_CONSTRUCTION, M=8, random_seed=4)
    plain.add_items(vectors[inserted], ids[inserted], num_threads=1)
    queries = _unit(np.random.default_rng(2), 50)
    for ef in (10, 64):
        built.ef, _ = ef, plain.set_ef(ef)
        _, got = built.search(queries, 10)
        want, _ = plain.knn_query(queries, k=10)
        np.testing.assert_array_equal(got, want)
    assert not list(tmp_path.glob("*.unordered")) and not list(tmp_path.glob("*.tmp"))
    # the layout: node j holds the j-th row of the cell order, read from the file's bytes
    raw = np.fromfile(tmp_path / GRAPH_FILE, np.uint8)
    size = 4 * (2 * 8 + 1) + 4 * DIM + 8
    level0 = raw[96 : 96 + N * size].reshape(N, size)
    labels = np.ascontiguousarray(level0[:, -8:]).view(np.int64)[:, 0]
    np.testing.assert_array_equal(labels, ids[cell_order(vectors, seed=4)])
    np.testing.assert_array_equal(node_labels(tmp_path / GRAPH_FILE), labels)
    # two threads race for node numbers: the layout still follows the cells (found by label)
    (tmp_path / "two").mkdir()
    build_graph(vectors, ids, 8, tmp_path / "two" / GRAPH_FILE, threads=2, seed=4)
    np.testing.assert_array_equal(node_labels(tmp_path / "two" / GRAPH_FILE), labels)


def test_search_is_the_naive_best_first_with_ties_by_id(tmp_path: Path, vectors: np.ndarray) -> None:
    """At an ef covering the graph: the exact top k, best first, equal scores by lower id
    (duplicated vectors), scores within float32 rounding of the exact inner products."""
    dup = np.concatenate([vectors, vectors[:50]])  # ids N.. repeat the first 50 vectors: ties
    ids = np.arange(len(dup), dtype=np.int64)[::-1].copy()  # a tie's lower id is the later row
    graph = build_graph(dup, ids, 8, tmp_path / GRAPH_FILE, threads=1)
    graph.ef = len(dup)
    queries = np.concatenate([_unit(np.random.default_rng(3), 20), vectors[:5]])
    scores, found = graph.search(queries, 25)
    for q, s, i in zip(queries, scores, found, strict=True):
        want = _naive(q, dup, ids, 25)
        assert i.tolist() == [w[1] for w in want]
        np.testing.assert_allclose(s, [w[0] for w in want], atol=2e-7)


def test_a_selector_filters_and_a_narrow_one_pads(tmp_path: Path, vectors: np.ndarray) -> None:
    """FAISS id selectors as hnswlib filters: only selected ids, the naive top k among them; fewer
    selected than k: all of them, padded with -1 (searched through vector_index.search: dropped)."""
    ids = np.arange(N, dtype=np.int64)
    graph = build_graph(vectors, ids, 8, tmp_path / GRAPH_FILE, threads=1)
    graph.ef = 200
    queries = _unit(np.random.default_rng(4), 10)
    chosen = np.sort(np.random.default_rng(5).choice(N, 300, replace=False)).astype(np.int64)
    selector = faiss.IDSelectorBatch(len(chosen), faiss.swig_ptr(chosen))
    _, found = graph.search(queries, 10, params=GraphParams(selector))
    for q, i in zip(queries, found, strict=True):
        assert i.tolist() == [w[1] for w in _naive(q, vectors[chosen], chosen, 10)]
    few = chosen[:7]
    narrow = faiss.IDSelectorBatch(len(few), faiss.swig_ptr(few))
    scores, found = graph.search(queries[:3], 10, params=GraphParams(narrow))
    assert (found[:, 7:] == -1).all() and np.isneginf(scores[:, 7:]).all()
    for q, i in zip(queries[:3], found, strict=True):
        assert i[:7].tolist() == [w[1] for w in _naive(q, vectors[few], few, 7)]
    _, lists = search(graph, queries[:3], 10, selector=narrow)
    assert [len(x) for x in lists] == [7, 7, 7]


def test_tune_ef_takes_the_smallest_grid_step_reaching_the_targets(tmp_path: Path, vectors) -> None:
    from icr.index.vector_index import ExactTopK, nprobe_grid, recall_lower_bound, recall_per_query

    graph = build_graph(vectors, np.arange(N, dtype=np.int64), 4, tmp_path / GRAPH_FILE, threads=1)
    queries = _unit(np.random.default_rng(6), 60)
    exact = ExactTopK(queries, 200)
    exact.add(vectors)
    ef, recall, deep = tune_ef(graph, exact, queries, 10, 0.97, depth=100, depth_target=0.9)
    assert graph.ef == ef and deep is not None
    reached = {}  # every step of the grid, measured by a plain loop
    for e in [e for e in nprobe_grid(4096) if e >= 10]:
        graph.ef = e
        at_k = recall_lower_bound(recall_per_query(graph, exact, queries, 10))
        at_depth = recall_lower_bound(recall_per_query(graph, exact, queries, 100))
        reached[e] = at_k >= 0.97 and at_depth >= 0.9
    assert ef == min(e for e, ok in reached.items() if ok)
    assert recall >= 0.97 and deep >= 0.9


def test_factory_string(tmp_path: Path) -> None:
    assert parse_factory("Graph16") == {"kind": "Graph", "m": 16}
    assert not has_gpu_form("Graph16")
    with pytest.raises(ValueError, match="M must be 2..256"):
        parse_factory("Graph1")
    with pytest.raises(ValueError, match="Graph<M>"):
        parse_factory("Graph")


def test_a_built_graph_folder_loads_searches_and_refuses_a_changed_file(
    tiny_benchmark: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """``icr index build --factory Graph8``: index.hnsw recorded with its hash and the tuned ef;
    loaded, it searches as the exact folder does; cut into shards, each is a graph of its own id
    range; a changed graph file is refused by name."""
    from icr.index.build import build_image_index
    from icr.index.index_folder import load_index_dir

    kw = {"distractors": 50, "progress": False, "gpu": "off", "batch_size": 16}
    build_image_index(tiny_checkpoint, tiny_benchmark, out=tmp_path / "exact", factory="Flat", **kw)
    manifest = build_image_index(tiny_checkpoint, tiny_benchmark, out=tmp_path / "g", factory="Graph8", **kw)
    assert GRAPH_FILE in manifest.files and "index.faiss" not in manifest.files
    assert manifest.recall_check["ef_search"] >= 10 and manifest.built_on == "cpu"
    exact, _, store = load_index_dir(tmp_path / "exact")
    store.close()
    index, _, store = load_index_dir(tmp_path / "g")
    store.close()
    assert isinstance(index, GraphIndex) and index.ef == manifest.recall_check["ef_search"]
    everything = exact.reconstruct_n(0, exact.ntotal)  # (62, D)
    np.testing.assert_array_equal(index.read(np.arange(62)), everything)
    index.ef = 62  # every node: the exact lists
    queries = everything[:10] + 0.05
    _, want = search(exact, queries, 20)
    _, got = search(index, queries, 20)
    for w, g in zip(want, got, strict=True):
        assert g.tolist() == w.tolist()
    from icr.index.shard import shard_index

    for w in shard_index(tmp_path / "g", tmp_path / "shards", 2):  # each shard a graph of its range
        shard, _, store = load_index_dir(w["folder"])
        store.close()
        mine = np.arange(*w["ids"])
        assert isinstance(shard, GraphIndex) and shard.ntotal == len(mine) == 31
        shard.ef = 31
        for q in queries:
            _, got = search(shard, q[None], 5)
            assert got[0].tolist() == [i for _, i in _naive(q, everything[mine], mine, 5)]
    graph_file = tmp_path / "g" / GRAPH_FILE
    graph_file.write_bytes(graph_file.read_bytes()[:-4])
    with pytest.raises(ValueError, match=f"{GRAPH_FILE}: its content changed since the build"):
        load_index_dir(tmp_path / "g")


def test_served_graph_takes_writes_and_compacts_into_a_new_graph(
    tiny_benchmark: Path, tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's load of a graph folder: exact stored vectors, no float64 rescoring; deletions
    through the selector and adds beside the graph give the naive order; compaction builds the
    graph again from the live vectors, which searches the same."""
    from icr.index import live_index
    from icr.index.build import build_image_index
    from icr.index.index_folder import load_index_dir
    from icr.index.live_compact import compact
    from icr.service.loaded_index import load_index_folder

    kw = {"distractors": 50, "progress": False, "gpu": "off", "batch_size": 16}
    build_image_index(tiny_checkpoint, tiny_benchmark, out=tmp_path / "g", factory="Graph8", **kw)
    loaded = load_index_folder(tmp_path / "g", "off", max_batch=8, faiss_threads=1, writes=tmp_path / "state")
    try:
        assert loaded.rescore is None and not loaded.approximate_vectors and loaded.vectors is not None
        assert isinstance(loaded.index, GraphIndex)
        loaded.index.ef = 62
        everything = loaded.vectors(np.arange(62))  # (62, D)
        queries = everything[:5] + 0.05
        monkeypatch.setattr(live_index, "OVERFETCH_LIMIT", 0)  # deleted ids: a selector of the live ones
        loaded.live.delete(list(range(0, 62, 2)), "t")
        alive = np.arange(1, 62, 2)
        for q in queries:
            _, ids = loaded.live.search(q[None], 20, loaded.live.refresh())
            assert ids.tolist() == [i for _, i in _naive(q, everything[alive], alive, 20)]
        report = compact(loaded.live, tmp_path / "g", tmp_path / "compacted")
        assert report["vectors"] == 31 and report["removed"] == 31
    finally:
        loaded.live.close()
        assert loaded.metadata is not None
        loaded.metadata.close()
    index, manifest, store = load_index_dir(tmp_path / "compacted")
    store.close()
    assert isinstance(index, GraphIndex) and index.ntotal == 31 and GRAPH_FILE in manifest.files
    index.ef = 31
    for q in queries:
        _, ids = search(index, q[None], 20)
        assert ids[0].tolist() == [i for _, i in _naive(q, everything[alive], alive, 20)]
