"""``icr embed``: a gallery's embeddings written as clip-retrieval shards, resumable.

See :mod:`index.embeddings_layout` for the folder. A run first writes the manifest (checkpoint
sha256, source, shard size, count) and records each shard after its files are in place; run again
with the same arguments and it continues after the last recorded shard. Arguments that differ from
the manifest's (another checkpoint, source or shard size) are refused rather than mixed in.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from icr.index.embeddings_layout import (
    DEFAULT_SHARD_SIZE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    RESERVED_COLUMNS,
    read_manifest,
    shard_paths,
    write_manifest,
    write_shard,
)
from icr.index.galleries import Gallery, PhotoGallery, SplitGallery
from icr.training.devices import resolve_device

# What must match for a run to continue an existing folder.
_IDENTITY = ("checkpoint_sha256", "source", "shard_size", "count", "dim", "text")


def embed_to_folder(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    images: str | os.PathLike[str] | None = None,
    metadata: str | os.PathLike[str] | None = None,
    data: str | os.PathLike[str] | None = None,
    split: str = "test",
    shard_size: int = DEFAULT_SHARD_SIZE,
    batch_size: int = 256,
    device: str = "auto",
    skip_bad: bool = False,
    workers: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Embed ``images`` (a folder, with an optional metadata file) or ``data``'s ``split``; returns
    the finished manifest. ``shard_size``: images per shard file."""
    from tqdm import tqdm

    from icr.training.checkpoint import load_checkpoint, trained_captions_per_image

    if (images is None) == (data is None):
        raise ValueError("give one source: --images DIR (your photos) or --data D (a dataset split)")
    if metadata is not None and images is None:
        raise ValueError("--metadata describes the files of --images DIR; it does not apply to --data")
    if shard_size < 1 or batch_size < 1:
        raise ValueError(f"--shard-size and --batch-size must be >= 1, got {shard_size} and {batch_size}")
    root = Path(out)
    if root.exists() and any(root.iterdir()) and read_manifest(root) is None:
        raise ValueError(f"{root}: exists, is not empty and holds no {MANIFEST}; choose a new --out")
    started = time.perf_counter()
    device = resolve_device(device)
    model, config = load_checkpoint(checkpoint, device)
    gallery: Gallery
    if images is not None:
        gallery = PhotoGallery(images, metadata, skip_bad=skip_bad, workers=workers)
    else:
        assert data is not None
        gallery = SplitGallery(data, split, trained_captions_per_image(config), progress)
    clash = sorted(set(gallery.field_names()) & set(RESERVED_COLUMNS))
    if clash:
        raise ValueError(f"{metadata}: column(s) {clash} are reserved in the embeddings layout; rename them")
    text = gallery.captions_complete()
    manifest = _start(root, checkpoint, config, gallery, shard_size, text)
    done = {int(s["index"]) for s in manifest["shards"]}
    num_shards = manifest["num_shards"]
    with tqdm(total=gallery.count, desc="embedding", unit="img", disable=not progress) as bar:
        bar.update(sum(int(s["planned"]) for s in manifest["shards"]))
        for i in range(num_shards):
            if i in done and all(p.is_file() for p in _written(root, i, text)):
                continue
            lo, hi = i * shard_size, min((i + 1) * shard_size, gallery.count)
            vectors, rows, failed = [], [], []
            for batch in gallery.batches(model, lo, hi, batch_size, device):
                vectors.append(batch.vectors)
                rows += batch.rows
                failed += batch.failed
                bar.update(len(batch.rows) + len(batch.failed))
            image_emb = np.concatenate(vectors) if vectors else np.zeros((0, model.embed_dim), np.float32)
            text_emb = _first_captions(model, rows, device) if text else None
            write_shard(root, i, image_emb, text_emb, [_parquet_row(r) for r in rows])
            manifest["shards"] = [s for s in manifest["shards"] if int(s["index"]) != i]
            manifest["shards"].append({"index": i, "rows": len(rows), "planned": hi - lo})
            manifest["shards"].sort(key=lambda s: s["index"])
            manifest["skipped"] = [
                *manifest.get("skipped", []),
                *({"file": f, "error": e} for f, e in failed),
            ]
            write_manifest(root, manifest)
    manifest["complete"] = True
    manifest["rows"] = sum(int(s["rows"]) for s in manifest["shards"])
    manifest["seconds"] = round(time.perf_counter() - started, 3)
    manifest["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    write_manifest(root, manifest)
    return manifest


def _start(
    root: Path,
    checkpoint: str | os.PathLike[str],
    config: dict[str, Any],
    gallery: Gallery,
    shard_size: int,
    text: bool,
) -> dict[str, Any]:
    """The manifest to continue (same identity) or a new one; ValueError on a mismatch."""
    fresh = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "checkpoint_sha256": str(config["weights_sha256"]),
        "checkpoint_path": str(checkpoint),
        "dim": int(config["embed_dim"]),
        "source": gallery.description,
        "fields": gallery.field_names(),
        "text": text,
        "shard_size": shard_size,
        "count": gallery.count,
        "num_shards": max(1, -(-gallery.count // shard_size)),
        "shards": [],
        "skipped": [],
        "complete": False,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    old = read_manifest(root) if root.is_dir() else None
    if old is None:
        root.mkdir(parents=True, exist_ok=True)
        write_manifest(root, fresh)
        return fresh
    differ = [k for k in _IDENTITY if old.get(k) != fresh[k]]
    if differ:
        raise ValueError(
            f"{root}: holds embeddings written with other {', '.join(differ)} "
            f"(e.g. {differ[0]}: {str(old.get(differ[0]))[:80]}); choose a new --out, or remove the "
            "folder to start over"
        )
    return old


def _written(root: Path, i: int, text: bool) -> list[Path]:
    img, txt, meta = shard_paths(root, i)
    return [img, meta, *([txt] if text else [])]


def _first_captions(model: Any, rows: list[dict[str, Any]], device: str) -> np.ndarray:
    """(r, D) embeddings of each row's first caption (clip-retrieval has one caption per sample)."""
    from icr.training.embedding import embed_captions

    return embed_captions(model, [r["captions"][0] for r in rows], device=device)


def _parquet_row(row: dict[str, Any]) -> dict[str, Any]:
    captions = row["captions"]
    return {
        "image_path": row["image_path"],
        "caption": captions[0] if captions else None,
        "captions": captions,
        **row["fields"],
    }
