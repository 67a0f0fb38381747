"""A graph engine: an HNSW graph (hnswlib's) with its memory laid out in cluster order (issue 43).

Factory ``Graph<M>`` (e.g. ``Graph16``): hnswlib's HNSW graph of ``M`` links per node (``2M`` on the
bottom layer), built with efConstruction :data:`EF_CONSTRUCTION`. At k = 10 a graph walk beats
every inverted file: on 1M demo-model embeddings hnswlib searched in 0.28 ms where the best inverted
file took 0.61 (docs/results/2026-11-27-rerank-served-1m.md).

What this adds to hnswlib is the layout. hnswlib stores each node (links, vector, label) in one
block at its insertion rank, so a walk between neighbours jumps across the whole array. After the
build, :func:`reorder_file` renumbers the nodes so that each k-means cell's nodes sit next to each
other (:func:`cell_order`): the same graph, the same results, fewer cache and TLB misses per hop.
The nodes are inserted in a random order first: inserting them cluster by cluster made a worse
graph (recall@10 0.982 instead of 0.989 at ef 128 on the 1M embeddings).

Searches go through hnswlib (one thread per call, ``ef`` = max(the tuned ef, k)); a FAISS id
selector becomes hnswlib's filter. Scores are hnswlib's inner products (it returns 1 - ip per pair,
the same bits for a pair in any batch), ordered best first with ties by lower id like every index
here. The graph is searched, never changed: a live index writes beside it
(:mod:`index.live_index`), and compaction builds it again.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

GRAPH_FILE = "index.hnsw"
# Twice hnswlib's default (the peers' 200 in bench/ann_peers.py): a better graph that reaches recall@10
# 0.98 at ef 96 where 200 needs 112-128, searching in 0.94x the time, for twice the build time (674
# against 341 s on 1M x 128, 2 cores; docs/results/2026-11-27-graph-engine-1m.md)
EF_CONSTRUCTION = 400
# k-means cells of the layout: 4,096 at 1M, fewer for small graphs (50 training points each)
ORDER_CELLS = 4096
ORDER_POINTS_PER_CELL = 50
_FACTORY = re.compile(r"^Graph(?P<m>\d+)$")
# hnswlib's saved header (hnswalg.h, saveIndex): offsetLevel0, max_elements, cur_element_count,
# size_data_per_element, label_offset, offsetData (size_t); maxlevel (int); enterpoint_node
# (uint32); maxM, maxM0, M (size_t); mult (double); ef_construction (size_t)
_HEADER = struct.Struct("<6QiI3QdQ")
_FIELDS = (
    "offset_level0",
    "max_elements",
    "count",
    "size_data",
    "label_offset",
    "data_offset",
    "max_level",
    "entry",
    "max_m",
    "max_m0",
    "m",
    "mult",
    "ef_construction",
)


def is_graph(factory: str) -> bool:
    """Whether ``factory`` names this engine (``Graph<M>``)."""
    return _FACTORY.match(factory) is not None


def graph_links(factory: str) -> int:
    """M of ``Graph<M>``; ValueError for another factory or an M hnswlib cannot take."""
    match = _FACTORY.match(factory)
    if match is None:
        raise ValueError(f"{factory!r} is not a graph factory (Graph<M>, e.g. Graph16)")
    m = int(match["m"])
    if not 2 <= m <= 256:
        raise ValueError(f"{factory}: M must be 2..256 links per node (16 or 32 are usual)")
    return m


@dataclass(frozen=True)
class GraphParams:
    """Per-call search parameters: a FAISS id selector (``is_member(id)``), or None for all ids."""

    sel: Any = None


class GraphIndex:
    """An hnswlib graph under global ids, searched like a FAISS index: ``search(x, k, params)`` gives
    (Q, k) scores and ids best first (ties by id), padded with id -1 where fewer are found."""

    def __init__(self, graph: Any, ef: int = 10):
        self.graph = graph
        self.graph.set_num_threads(1)  # one search, one thread: the service runs calls side by side
        self.ef = ef
        self._count = int(graph.element_count)  # never changes: writes go beside the graph

    @classmethod
    def load(cls, path: str | os.PathLike[str], dim: int, ef: int = 10) -> GraphIndex:
        """The graph saved at ``path`` (vectors of ``dim`` floats). FileNotFoundError or ValueError
        naming the file when it is missing, cut short, or not hnswlib's."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: graph file not found")
        with open(path, "rb") as f:
            header = _header(f.read(_HEADER.size), path)
        data_bytes = header["label_offset"] - header["data_offset"]
        if data_bytes != 4 * dim:
            raise ValueError(f"{path}: vectors of {data_bytes // 4} floats, {dim} expected (another model?)")
        graph = _hnswlib().Index(space="ip", dim=dim)
        try:
            graph.load_index(str(path))
        except RuntimeError as err:  # hnswlib checks that the sizes add up to the file's
            raise ValueError(f"{path}: not a readable hnswlib graph, cut short or corrupt ({err})") from None
        return cls(graph, ef)

    @property
    def d(self) -> int:
        return int(self.graph.dim)

    @property
    def ntotal(self) -> int:
        return self._count

    @property
    def ef(self) -> int:
        return int(self.graph.ef)

    @ef.setter
    def ef(self, value: int) -> None:
        self.graph.set_ef(max(1, int(value)))

    def search(self, x: np.ndarray, k: int, *, params: Any = None) -> tuple[np.ndarray, np.ndarray]:
        # lean on purpose: at k = 10 a whole search takes ~0.25 ms, and each numpy call here ~1 us
        x = np.ascontiguousarray(x, dtype=np.float32)  # (Q, D)
        k = max(1, min(int(k), self._count))
        selector = getattr(params, "sel", None)
        keep = None if selector is None else (lambda label: bool(selector.is_member(label)))
        try:
            labels, dist = self.graph.knn_query(x, k=k, num_threads=1, filter=keep)  # (Q, k) each
        except RuntimeError:  # fewer than k reachable (a narrow filter): query by query
            return self._search_short(x, k, keep)
        return _best_first(1.0 - dist, labels.view(np.int64))  # labels: uint64 ids below 2^63

    def _search_short(self, x: np.ndarray, k: int, keep: Any) -> tuple[np.ndarray, np.ndarray]:
        """Each query of ``x`` with the longest list (up to ``k``) its filter lets hnswlib fill,
        found by bisection, padded to ``k`` with -inf / -1."""
        out_s = np.full((len(x), k), -np.inf, np.float32)
        out_i = np.full((len(x), k), -1, np.int64)
        for q in range(len(x)):
            lo, hi, found = 0, k + 1, None  # lo: a length known to fill (found's), hi: one known not to
            while hi - lo > 1:
                mid = (lo + hi) // 2
                try:
                    found = self.graph.knn_query(x[q : q + 1], k=mid, num_threads=1, filter=keep)
                    lo = mid
                except RuntimeError:
                    hi = mid
            if found is not None:
                s, i = _best_first(1.0 - found[1], found[0].astype(np.int64))
                out_s[q, :lo], out_i[q, :lo] = s[0], i[0]
        return out_s, out_i

    def read(self, ids: np.ndarray) -> np.ndarray:
        """(n, D) the vectors of ``ids`` (exactly what was added)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) == 0:
            return np.zeros((0, self.d), np.float32)
        return np.asarray(self.graph.get_items(ids, return_type="numpy"), dtype=np.float32)


def _best_first(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Q, k) ``scores`` (float32) and ``ids`` in hnswlib's order (best first, ties in any order)
    put in this project's order: best first, ties by lower id. Rows with no tie are left as they
    are (the common case: only a lexsort of the rows with one)."""
    tied = (scores[:, 1:] == scores[:, :-1]).any(axis=1)  # (Q,)
    for q in np.flatnonzero(tied):
        order = np.lexsort((ids[q], -scores[q]))
        scores[q], ids[q] = scores[q][order], ids[q][order]
    return scores, ids


def build_graph(
    vectors: np.ndarray, ids: np.ndarray, m: int, path: Path, *, threads: int, seed: int = 0
) -> GraphIndex:
    """The graph of ``vectors`` (N, D) float32 under ``ids`` (N,), saved at ``path`` in cluster
    order (module docstring); nodes inserted in a random order (``seed``) on ``threads`` threads."""
    n, dim = vectors.shape
    graph = _hnswlib().Index(space="ip", dim=dim)
    graph.init_index(max_elements=max(n, 1), ef_construction=EF_CONSTRUCTION, M=m, random_seed=seed)
    shuffled = np.random.default_rng(seed).permutation(n)
    # (N,) a node's rank -> its row; chunks of random rows, each read in row order (a memory map)
    inserted = np.concatenate([np.sort(shuffled[s : s + 65_536]) for s in range(0, n, 65_536)] or [shuffled])
    for start in range(0, n, 65_536):
        rows = inserted[start : start + 65_536]
        graph.add_items(np.ascontiguousarray(vectors[rows]), ids[rows], num_threads=threads)
    unordered = path.with_name(path.name + ".unordered")
    graph.save_index(str(unordered))
    del graph
    # threads race for node numbers, so each node's row is found by its label
    labels = node_labels(unordered)  # (N,) node -> label
    by_label = np.argsort(labels)
    node_of_row = by_label[np.searchsorted(labels, ids, sorter=by_label)]  # (N,)
    reorder_file(unordered, path, node_of_row[cell_order(vectors, seed=seed)])
    unordered.unlink()
    return GraphIndex.load(path, dim)


def node_labels(path: Path) -> np.ndarray:
    """(N,) int64: the label of each node of the graph saved at ``path``, in node order."""
    with open(path, "rb") as f:
        header = _header(f.read(_HEADER.size), path)
    n, size = int(header["count"]), int(header["size_data"])
    level0 = (
        np.memmap(path, np.uint8, mode="r", offset=_HEADER.size, shape=(n, size))
        if n
        else np.zeros((0, size), np.uint8)
    )
    return np.ascontiguousarray(level0[:, size - 8 :]).view(np.int64)[:, 0].copy()


def cell_order(vectors: np.ndarray, *, cells: int = ORDER_CELLS, seed: int = 0) -> np.ndarray:
    """(N,) the rows of ``vectors`` (N, D) grouped by nearest k-means centroid (spherical k-means
    on a random sample), stable within a cell."""
    n, dim = vectors.shape
    cells = max(1, min(cells, n // ORDER_POINTS_PER_CELL))
    if cells == 1:
        return np.arange(n)
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(n, cells * ORDER_POINTS_PER_CELL, replace=False))
    sample = np.ascontiguousarray(vectors[rows], dtype=np.float32)
    kmeans = faiss.Kmeans(dim, cells, niter=10, seed=seed, spherical=True)
    kmeans.train(sample)
    cell = np.empty(n, np.int64)
    for start in range(0, n, 65_536):
        block = np.ascontiguousarray(vectors[start : start + 65_536], dtype=np.float32)
        cell[start : start + len(block)] = kmeans.index.search(block, 1)[1][:, 0]
    return np.argsort(cell, kind="stable")


def _hnswlib() -> Any:
    """The hnswlib module; ImportError saying how to install it."""
    try:
        import hnswlib  # noqa: PLC0415 (hnswlib: the optional [graph] extra, only graph indices need it)
    except ImportError as err:
        raise ImportError(f"Graph<M> indices need hnswlib: pip install 'icr[graph]' ({err})") from None
    return hnswlib


@dataclass(frozen=True)
class _Layout:
    header: dict[str, Any]
    level0: np.ndarray  # (N, size_data) uint8: each node's bottom links, vector and label
    upper: list[np.ndarray]  # per node, its upper layers' links (uint8), empty for most nodes


def _header(head: bytes, path: Path) -> dict[str, Any]:
    """The fields of a saved graph's header ``head``; ValueError naming ``path`` when they are not
    hnswlib's layout (each node: a count and 2M links, the vector, an 8-byte label)."""
    bad = f"{path}: not an hnswlib graph of the known format (cut short, or written by another version)"
    if len(head) < _HEADER.size:
        raise ValueError(bad)
    header = dict(zip(_FIELDS, _HEADER.unpack(head), strict=True))
    links0 = 4 * (int(header["max_m0"]) + 1)
    size, data = int(header["size_data"]), int(header["data_offset"])
    if header["offset_level0"] != 0 or data != links0 or header["label_offset"] != size - 8 or size <= data:
        raise ValueError(bad)
    return header


def _read_layout(path: Path) -> _Layout:
    """The saved graph at ``path``, split into its parts; ValueError naming the file when its
    sizes do not add up (cut short, or a format this code does not know)."""
    buf = np.fromfile(path, np.uint8)
    bad = f"{path}: not an hnswlib graph of the known format (cut short, or written by another version)"
    header = _header(buf[: _HEADER.size].tobytes(), path)
    n, size = int(header["count"]), int(header["size_data"])
    at = _HEADER.size + n * size
    if at > len(buf):
        raise ValueError(bad)
    level0 = buf[_HEADER.size : at].reshape(n, size)
    sizes = np.zeros(n, np.int64)
    upper = []
    for i in range(n):  # a u32 size, then the node's upper-layer links
        if at + 4 > len(buf):
            raise ValueError(bad)
        sizes[i] = int(buf[at : at + 4].view(np.uint32)[0])
        upper.append(buf[at + 4 : at + 4 + sizes[i]])
        at += 4 + int(sizes[i])
    if at != len(buf):
        raise ValueError(bad)
    return _Layout(header, level0, upper)


def reorder_file(src: Path, dst: Path, order: np.ndarray) -> None:
    """Write the graph saved at ``src`` to ``dst`` with its nodes renumbered: node ``order[j]``
    becomes node ``j`` (``order``: a permutation of the node numbers). Every link is renumbered, so
    the graph, its labels and its searches are unchanged; only where each node lies in memory."""
    layout = _read_layout(src)
    header = dict(layout.header)
    n, m0, m = int(header["count"]), int(header["max_m0"]), int(header["max_m"])
    order = np.asarray(order, dtype=np.int64)
    if order.shape != (n,) or not np.array_equal(np.sort(order), np.arange(n)):
        raise ValueError(f"order must be a permutation of the graph's {n} nodes")
    new_number = np.empty(n, np.uint32)
    new_number[order] = np.arange(n, dtype=np.uint32)
    level0 = layout.level0[order]  # (N, size_data), a copy
    _renumber(level0[:, : 4 * (m0 + 1)].view(np.uint32), new_number)  # writes through the view
    header["entry"] = int(new_number[header["entry"]]) if n else header["entry"]
    tmp = dst.with_name(dst.name + ".tmp")
    with open(tmp, "wb") as out:
        out.write(_HEADER.pack(*header.values()))
        out.write(level0.tobytes())
        for old in order:
            block = layout.upper[old].copy()
            out.write(struct.pack("<I", len(block)))
            if len(block):
                _renumber(block.view(np.uint32).reshape(-1, m + 1), new_number)
                out.write(block.tobytes())
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, dst)


def _renumber(lists: np.ndarray, new_number: np.ndarray) -> None:
    """In place: each row of ``lists`` (uint32: a count in the low 16 bits of the first word, then
    the links) gets its first ``count`` links renumbered by ``new_number``."""
    count = (lists[:, 0] & 0xFFFF).astype(np.int64)  # the word's third byte is the deleted mark
    links = lists[:, 1:]
    valid = np.arange(links.shape[1])[None, :] < count[:, None]
    links[valid] = new_number[links[valid]]
