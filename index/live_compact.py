"""Compaction of a living index: a fresh index folder holding the live images as of one write, the
deleted vectors gone and the added ones in, which the server then serves in place of the old one.

Ids never change: a client's ids, labels and the write log's rows stay valid. The new folder keeps
the build's id space (``ntotal``: every id ever given is below it) and says which ids have no vector
(``holes``, deleted before compaction, listed in ``holes.npy``), which write it includes
(``base_seq``: a server applies only the log's later writes over it) and how many images it holds
that were added online (``added_count``). Its ``created`` stamp is the build's, so it is the same
index for the write log and the labels (:func:`index.feedback_labels.index_key`).

The FAISS index:

* an inverted file is copied with its codes, the deleted ids removed and the added vectors encoded
  into it with their ids (no re-encoding of what was there); when the added vectors crowd a few
  lists, measured as FAISS's list imbalance factor (1.0 = even) grown past
  :data:`RETRAIN_IMBALANCE` times the old index's, it is trained again on the live vectors and
  refilled (decoded vectors for PQ / SQ codes: their approximation, encoded again);
* any other index (exact, HNSW) is built again from its stored vectors under an id map.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from icr.core.atomic import fsync_file, sha256_file, staged_dir
from icr.index.graph import GRAPH_FILE, GraphIndex, build_graph, graph_links
from icr.index.index_folder import HOLES_FILE, INDEX_FILE
from icr.index.live_index import LiveIndex
from icr.index.live_snapshot import SNAPSHOT_FILE, link_folder
from icr.index.live_writes import UPLOADS_FOLDER, WRITES_FILE
from icr.index.manifest import MANIFEST_FILE, Manifest
from icr.index.metadata import METADATA_FILE, MetadataStore
from icr.index.rerank import RAW_FILE, RerankedIndex, save_raw
from icr.index.vector_index import (
    VectorReader,
    empty_index,
    nlist_of,
    random_training_sample,
    save_index,
    stored_vectors,
)

RETRAIN_IMBALANCE = 1.5  # list imbalance grown by this factor over the old index's: train again
CHUNK = 50_000  # vectors / metadata rows per step
_REWRITTEN = (
    INDEX_FILE,
    GRAPH_FILE,
    METADATA_FILE,
    MANIFEST_FILE,
    HOLES_FILE,
    RAW_FILE,
    WRITES_FILE,
    SNAPSHOT_FILE,
    UPLOADS_FOLDER,
)


def imbalance(index: faiss.Index | GraphIndex) -> float | None:
    """FAISS's imbalance factor of an inverted file's list sizes (1.0: even), None for others."""
    if isinstance(index, GraphIndex):
        return None
    try:
        ivf = faiss.extract_index_ivf(index)
    except RuntimeError:
        return None
    lists = ivf.invlists
    return float(lists.imbalance_factor()) if lists is not None and ivf.ntotal else None


def compact(
    live: LiveIndex,
    directory: Path,
    out: Path,
    say: Callable[[str], None] = lambda _m: None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the compaction of ``live`` (served from the index folder ``directory``) to ``out``
    (replaced whole when the folder is complete: ``out`` may be ``directory`` itself). Returns what
    it did: the write it includes, vectors kept, removed and added, the list imbalance before and
    after, whether the inverted file was trained again, and the seconds taken. ``extra``: entries for
    the new manifest's ``extra`` (a shard's: index/shard.py)."""
    t0 = time.perf_counter()
    manifest = Manifest.read(directory / MANIFEST_FILE)
    state = live.refresh()
    lo, hi = state.own
    alive = np.zeros(state.base_ntotal, bool)  # (N,) over the base's id space
    alive[lo:hi] = True
    alive[state.base_dead] = False
    base_live = np.flatnonzero(alive).astype(np.int64)  # (b,)
    added_ids = state.ids[state.alive]  # (a,) ascending, all >= base_ntotal
    added_vectors = state.vectors[state.alive]  # (a, D)
    ids_end = state.ids_end
    kept = np.concatenate([base_live, added_ids])  # (b + a,) ascending
    # a shard's range [lo, hi) (a shard compacted, or one being cut: index/shard.py); the last one's
    # is open-ended, so it takes the adds
    shard = manifest.id_range is not None or "shard" in (extra or {})
    own = [lo, ids_end if hi == state.base_ntotal else hi] if shard else None
    start, end = own or (0, ids_end)
    holes = np.setdiff1d(np.arange(start, end, dtype=np.int64), kept, assume_unique=True)
    source = live.index
    if hasattr(faiss, "GpuIndex") and isinstance(source, faiss.GpuIndex):
        source = faiss.index_gpu_to_cpu(source)
    read = stored_vectors(source)  # a re-ranked index's raw vectors: rewritten for the kept ids
    reranked = isinstance(source, RerankedIndex)
    if reranked:
        source = source.codes
    say(f"compaction: {len(kept):,} live images at write {state.seq}, {len(holes):,} ids with no vector")
    before = imbalance(source)
    graph = isinstance(source, GraphIndex)  # never changed: built again from the live vectors
    if graph:
        index, drifted, retrained = None, None, False
    else:
        index, drifted, retrained = _faiss_index(
            source,
            before,
            manifest.factory,
            _removed(state.base_dead, lo, hi),
            base_live,
            added_ids,
            added_vectors,
            read,
        )
    report: dict[str, Any] = {
        "seq": state.seq,
        "vectors": len(kept),
        "removed": int(source.ntotal) - len(base_live),
        "added": len(added_ids),
        "holes": len(holes),
        "imbalance_before": before,
        "imbalance_with_writes": drifted,  # the old lists with the writes applied
        "imbalance_after": None if index is None else imbalance(index),
        "retrained": retrained,
    }
    with staged_dir(out) as tmp:
        if index is not None:
            save_index(index, tmp / INDEX_FILE)
        else:
            vectors = np.concatenate([*_vectors(read, base_live), added_vectors])  # (b + a, D)
            threads = len(os.sched_getaffinity(0))
            build_graph(vectors, kept, graph_links(manifest.factory), tmp / GRAPH_FILE, threads=threads)
        with MetadataStore.create(tmp / METADATA_FILE) as metadata:
            metadata.add(_rows(live, kept, state))
        if len(holes):
            np.save(tmp / HOLES_FILE, holes, allow_pickle=False)
        if reranked:
            assert read is not None  # a re-ranked index always reads its raw vectors
            save_raw(tmp / RAW_FILE, _raw_rows(start, end, base_live, read, added_ids, added_vectors))
        for name in (INDEX_FILE, GRAPH_FILE, METADATA_FILE, HOLES_FILE, RAW_FILE):
            if (tmp / name).is_file():
                fsync_file(tmp / name)
        link_folder(directory, tmp, _REWRITTEN)  # calibration, plots: never rewritten in place
        report["seconds"] = round(time.perf_counter() - t0, 3)
        fields = manifest.to_dict()
        fields.update(
            ntotal=ids_end,
            added_count=manifest.added_count + (ids_end - manifest.ntotal),
            holes=len(holes),
            id_range=own,
            base_seq=state.seq,
            files={
                n: sha256_file(tmp / n)
                for n in (INDEX_FILE, GRAPH_FILE, METADATA_FILE, HOLES_FILE, RAW_FILE)
                if (tmp / n).is_file()
            },
            extra={
                **manifest.extra,
                "compaction": {**report, "from_ntotal": manifest.ntotal},
                **(extra or {}),
            },
        )
        written = Manifest.from_dict(fields)  # validated before it is written
        (tmp / MANIFEST_FILE).write_text(written.to_json())
        fsync_file(tmp / MANIFEST_FILE)
    say(f"compaction: done in {report['seconds']:.1f} s")
    return report


def _removed(dead: np.ndarray, lo: int, hi: int) -> Any:
    """A FAISS selector of the base ids a compaction removes: the deleted ones (``dead``, ascending)
    and, for a shard being cut, every id outside its range [lo, hi)."""
    dead = np.ascontiguousarray(dead, np.int64)
    outside = faiss.IDSelectorNot(faiss.IDSelectorRange(lo, hi))
    if not len(dead):
        return outside
    batch = faiss.IDSelectorBatch(len(dead), faiss.swig_ptr(dead))
    either = faiss.IDSelectorOr(batch, outside)
    either.referenced_objects = [batch, outside, dead]  # type: ignore[attr-defined]  # (C++ pointers)
    return either


def _faiss_index(
    source: faiss.Index,
    before: float | None,
    factory: str,
    removed: Any,
    base_live: np.ndarray,
    added_ids: np.ndarray,
    added_vectors: np.ndarray,
    read: VectorReader | None,
) -> tuple[faiss.Index, float | None, bool]:
    """(the new FAISS index of the live vectors under their ids, the imbalance of the old lists with
    the writes applied (None: an index with no lists), whether it was trained anew). ``before``: the
    old lists' imbalance; ``removed``: a selector of the base ids to drop (:func:`_removed`);
    ``read``: the source's stored vectors by id."""
    if nlist_of(source) is not None:
        index = faiss.clone_index(source)
        faiss.extract_index_ivf(index).set_direct_map_type(faiss.DirectMap.NoMap)  # type: ignore[attr-defined]
        index.remove_ids(removed)
        if len(added_ids):
            index.add_with_ids(added_vectors, added_ids)
        after = imbalance(index)
        if before is None or after is None or after <= RETRAIN_IMBALANCE * before:
            return index, after, False
        fresh = empty_index(source.d, factory)
        vectors = np.concatenate([*_vectors(read, base_live), added_vectors])  # (n, D)
        fresh.train(random_training_sample(vectors, factory))
        fresh.add_with_ids(vectors, np.concatenate([base_live, added_ids]))
        return fresh, after, True
    index = faiss.IndexIDMap2(empty_index(source.d, factory))
    for ids, vectors in zip(_id_chunks(base_live), _vectors(read, base_live), strict=True):
        index.add_with_ids(vectors, ids)
    if len(added_ids):
        index.add_with_ids(added_vectors, added_ids)
    return index, None, False


def _id_chunks(ids: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, len(ids), CHUNK):
        yield ids[start : start + CHUNK]


def _vectors(read: VectorReader | None, ids: np.ndarray) -> Iterator[np.ndarray]:
    """The stored vectors of ``ids``, chunk by chunk ((c, D) each)."""
    if read is None:
        raise ValueError("this index cannot give its vectors back (a GPU inverted file); compact on the CPU")
    for chunk in _id_chunks(ids):
        yield read(chunk)


def _raw_rows(
    start: int,
    end: int,
    base_live: np.ndarray,
    read: VectorReader,
    added_ids: np.ndarray,
    added_vectors: np.ndarray,
) -> Iterator[np.ndarray]:
    """A re-ranked folder's raw vectors: the rows of ids ``start .. end - 1`` in order, chunk by chunk,
    zeros for the ids with no vector (never read: its codes do not hold them)."""
    for lo in range(start, end, CHUNK):
        hi = min(lo + CHUNK, end)
        block = np.zeros((hi - lo, added_vectors.shape[1]), np.float32)  # (c, D)
        base = base_live[(base_live >= lo) & (base_live < hi)]
        if len(base):
            block[base - lo] = read(base)
        added = (added_ids >= lo) & (added_ids < hi)
        block[added_ids[added] - lo] = added_vectors[added]
        yield block


def _rows(live: LiveIndex, ids: np.ndarray, state: Any) -> Iterator[dict[str, Any]]:
    for chunk in _id_chunks(ids):
        for image_id, row in zip(chunk, live.rows([int(i) for i in chunk], state), strict=True):
            yield {**row, "id": int(image_id)}
