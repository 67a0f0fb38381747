"""`icr index add` / `icr index remove`: bulk writes to a served index's write log, from the command
line, through the same log a server applies (:mod:`index.live_writes`): a server on that state
directory searches them within its ICR_WRITES_POLL_SECONDS, and one started later replays them.

Added images come from an ``icr embed`` folder written by the index's checkpoint (embed a photo
folder first: ``icr embed --images DIR --metadata FILE``). Each image's external id is its path as
the embeddings folder names it, so adding the same folder again replaces those images instead of
adding them twice.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from icr.index.embeddings_layout import open_embeddings_folder, row_parts
from icr.index.feedback_labels import index_key
from icr.index.filters import FilterCache, parse_filter
from icr.index.index_folder import load_index_dir
from icr.index.live_compact import compact
from icr.index.live_index import LiveIndex, base_ids
from icr.index.live_writes import WRITES_FILE, NewImage, check_fields
from icr.index.manifest import Manifest

BATCH = 1000  # images per transaction


def _open(index_dir: Path, state_dir: Path) -> tuple[LiveIndex, Manifest]:
    index, manifest, metadata = load_index_dir(index_dir)
    if manifest.modality != "image":
        raise ValueError(f"{index_dir} holds {manifest.modality} vectors; images are added to an image index")
    key = index_key(manifest.checkpoint_sha256, manifest.created)
    live = LiveIndex(index, metadata, state_dir / WRITES_FILE, key, base=base_ids(index_dir, manifest))
    return live, manifest


def add_embeddings(
    index_dir: str | os.PathLike[str],
    embeddings: str | os.PathLike[str],
    state_dir: str | os.PathLike[str],
    who: str = "icr index add",
    progress: bool = True,
) -> dict[str, Any]:
    """Add every image of an ``icr embed`` folder; returns counts and the log's position after."""
    live, manifest = _open(Path(index_dir), Path(state_dir))
    folder = open_embeddings_folder(embeddings, manifest.dim)
    folder.check_checkpoint(manifest.checkpoint_sha256, manifest.checkpoint_path)
    assert folder.manifest is not None  # check_checkpoint refuses a folder without one
    kinds = manifest.metadata_field_types or {}
    added = replaced = 0
    with tqdm(total=folder.count, desc="adding images", unit="img", disable=not progress) as bar:
        for vectors, meta in folder.chunks():
            images = []
            for k, (vector, m) in enumerate(zip(vectors, meta, strict=True)):
                path, captions, fields = row_parts(m)
                row = {
                    "source": path,
                    "captions": captions,
                    "fields": check_fields(fields, manifest.metadata_fields, kinds, f"{path} (row {k})"),
                }
                images.append(NewImage(vector, row, external_id=path))
            for start in range(0, len(images), BATCH):
                acks = live.add(images[start : start + BATCH], who)
                added += len(acks)
                replaced += sum(a.replaced is not None for a in acks)
                bar.update(len(acks))
    live.close()
    state = live.state
    return {"added": added, "replaced": replaced, "seq": state.seq, "images": state.size}


def remove_images(
    index_dir: str | os.PathLike[str],
    state_dir: str | os.PathLike[str],
    ids: Sequence[int] = (),
    external_ids: Sequence[str] = (),
    filter_spec: dict[str, Any] | None = None,
    who: str = "icr index remove",
) -> dict[str, Any]:
    """Delete the live images among ``ids``, named by ``external_ids`` and selected by ``filter_spec``
    (one transaction); returns the ids deleted and the log's position after."""
    live, manifest = _open(Path(index_dir), Path(state_dir))
    wanted = [int(i) for i in ids]
    for name in external_ids:
        wanted.append(live.resolve_external(name))  # UnknownImage names one that is not live
    if filter_spec is not None:
        types = manifest.metadata_field_types
        filter_ = parse_filter(filter_spec, manifest.metadata_fields, types)
        if filter_ is None:
            raise ValueError("--filter: empty; name at least one field")
        selection, _ = FilterCache(live.metadata, manifest.ntotal, live=live).select(filter_, live.state)
        wanted += [int(i) for i in selection.ids]
    acks = live.delete(wanted, who) if wanted else []
    live.close()
    state = live.state
    return {"deleted": [a.id for a in acks], "seq": state.seq, "images": state.size}


def compact_folder(
    index_dir: str | os.PathLike[str], state_dir: str | os.PathLike[str], progress: bool = True
) -> dict[str, Any]:
    """Compact the index folder in place with the write log of ``state_dir``
    (:mod:`index.live_compact`); a server serving it switches when it sees the folder change."""
    live, _ = _open(Path(index_dir), Path(state_dir))
    try:
        return compact(
            live, Path(index_dir), Path(index_dir), say=tqdm.write if progress else lambda _m: None
        )
    finally:
        live.close()
        live.metadata.close()
