"""A minimal index folder for tests of what reads one (compaction, shards): ``index.faiss`` and a
valid ``manifest.json`` of an image index (and a re-ranked index's raw vectors); the caller puts
``metadata.sqlite`` beside them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import faiss

from icr.index.manifest import Manifest
from icr.index.rerank import RAW_FILE, RerankedIndex


def write_index_folder(folder: Path, index: Any, factory: str) -> Path:
    """``folder`` (created) holding ``index`` (ids 0..ntotal-1) and its manifest; returns it."""
    folder.mkdir()
    rerank = None
    if isinstance(index, RerankedIndex):
        index.raw.tofile(folder / RAW_FILE)
        index, rerank = index.codes, index.rerank.to_dict()
    faiss.write_index(index, str(folder / "index.faiss"))
    manifest = Manifest(
        modality="image", checkpoint_sha256="c" * 64, checkpoint_path="ckpt", dim=index.d, factory=factory,
        factory_reason="test", ntotal=index.ntotal, gallery_count=index.ntotal, distractor_count=0,
        recall_check={"k": 10, "recall": 1.0, "queries": 0}, build_seconds=0.0, peak_rss_mb=0.0,
        created="2026-11-27T00:00:00+00:00", data={"path": "data", "split": "test"}, rerank=rerank,
    )  # fmt: skip
    (folder / "manifest.json").write_text(manifest.to_json())
    return folder
