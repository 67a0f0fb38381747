"""Reading an index folder back: ``index.faiss``, ``manifest.json`` and ``metadata.sqlite``, checked
against each other and against the sha256 sums the manifest records (``index.build`` writes them).

A module of its own so that a reader (the server, calibration, the bench) imports no builder.
"""

from __future__ import annotations

import os
from pathlib import Path

import faiss
import numpy as np

from icr.core.atomic import sha256_file
from icr.index.graph import GRAPH_FILE, GraphIndex, is_graph
from icr.index.manifest import MANIFEST_FILE, Manifest
from icr.index.metadata import METADATA_FILE, MetadataStore
from icr.index.on_disk import ONDISK_DATA, load_on_disk
from icr.index.rerank import RAW_FILE, Rerank, RerankedIndex, is_reranked, load_raw
from icr.index.vector_index import Searchable, load_index

INDEX_FILE = "index.faiss"
HOLES_FILE = "holes.npy"  # a compacted folder's ids with no vector


def load_index_dir(
    directory: str | os.PathLike[str], *, mmap: bool = False
) -> tuple[Searchable, Manifest, MetadataStore]:
    """(index, manifest, read-only metadata) of an index directory, checked against each other. A
    re-ranked index comes with its raw vectors (``mmap``: mapped, like the index); a graph
    (``index.hnsw``) is read whole, searched at the ef its build tuned.

    Errors name the missing or corrupt file and the command that rebuilds the index.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{directory}: index directory not found; build one with "
            "`icr index build --checkpoint C --data D --out DIR`"
        )
    manifest = Manifest.read(directory / MANIFEST_FILE)
    rebuild = f"rebuild it with `{manifest.rebuild_command(directory, manifest.checkpoint_path)}`"
    for name, recorded in manifest.files.items():  # manifests before files were recorded: none
        file = directory / name
        if file.is_file() and sha256_file(file) != recorded:
            raise ValueError(
                f"{file}: its content changed since the build ({MANIFEST_FILE} records sha256 "
                f"{recorded[:12]}...): replace the whole index folder, never a file inside it, or {rebuild}"
            )
    path = directory / (GRAPH_FILE if is_graph(manifest.factory) else INDEX_FILE)
    on_disk = (directory / ONDISK_DATA).is_file()
    index: Searchable
    try:
        if is_graph(manifest.factory):
            index = GraphIndex.load(path, manifest.dim, int(manifest.recall_check.get("ef_search") or 10))
        elif on_disk:
            index = load_on_disk(path)
        else:
            index = load_index(path, mmap=mmap)
    except (FileNotFoundError, ValueError) as err:
        raise type(err)(f"{err}; {rebuild}") from None
    if index.d != manifest.dim or index.ntotal != manifest.vectors:
        raise ValueError(
            f"{path}: holds {index.ntotal} vectors of dim {index.d}, {MANIFEST_FILE} says "
            f"{manifest.vectors} of dim {manifest.dim}; the folder mixes files of two builds, {rebuild}"
        )
    if is_reranked(manifest.factory) and isinstance(index, faiss.Index):  # the codes
        lo, hi = manifest.own_ids  # one row per id of the range, holes included
        try:
            # an on-disk index's raw vectors are mapped whatever ``mmap`` says: they exceed the budget
            raw = load_raw(directory / RAW_FILE, hi - lo, manifest.dim, mmap=mmap or on_disk)
        except (FileNotFoundError, ValueError) as err:
            raise type(err)(f"{err}; {rebuild}") from None
        index = RerankedIndex(index, raw, lo, Rerank.from_dict(manifest.rerank))
    try:
        metadata = MetadataStore.open(directory / METADATA_FILE)
    except (FileNotFoundError, ValueError) as err:
        raise type(err)(f"{str(err).split('; rebuild')[0]}; {rebuild}") from None
    if metadata.count() != manifest.vectors:
        count = metadata.count()
        metadata.close()
        raise ValueError(
            f"{directory / METADATA_FILE}: {count} rows for {manifest.vectors} vectors; {rebuild}"
        )
    return index, manifest, metadata


def read_holes(directory: str | os.PathLike[str], manifest: Manifest) -> np.ndarray | None:
    """The ids of a compacted folder with no vector (ascending), None for a build's folder."""
    if not manifest.holes:
        return None
    path = Path(directory) / HOLES_FILE
    try:
        holes = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable ({err}); compact the index again") from None
    lo, hi = manifest.own_ids
    ok = holes.dtype == np.int64 and holes.shape == (manifest.holes,)
    if not ok or (len(holes) and (holes[0] < lo or holes[-1] >= hi or (np.diff(holes) <= 0).any())):
        raise ValueError(f"{path}: not {manifest.holes} ascending ids in [{lo}, {hi}); compact again")
    return np.asarray(holes)
