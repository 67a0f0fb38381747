"""An ``icr embed`` folder's bookkeeping, shared by both engines (``index.embed`` runs the local one,
``index.embed_ray`` the Ray one): the manifest to continue or start, each shard written then recorded,
the folder marked complete."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from icr.index.embeddings_layout import (
    FORMAT,
    FORMAT_VERSION,
    read_manifest,
    shard_paths,
    write_manifest,
    write_shard,
)
from icr.index.galleries import Gallery

if TYPE_CHECKING:  # the annotation only: shards are listed and merged without torch
    from icr.training.checkpoint import CheckpointMeta

# What must match for a run to continue an existing folder (not the engine: both write the same shards).
_IDENTITY = ("checkpoint_sha256", "source", "shard_size", "count", "dim", "text")


@dataclass
class ShardRun:
    """One run over an embeddings folder: its manifest and the shard bookkeeping both engines share.
    Shard ``i`` holds images ``[i * shard_size, (i + 1) * shard_size)`` of the gallery's listing."""

    root: Path
    manifest: dict[str, Any]
    count: int
    shard_size: int
    text: bool
    engine: str

    @classmethod
    def start(
        cls,
        root: Path,
        checkpoint: str | os.PathLike[str],
        config: CheckpointMeta,
        gallery: Gallery,
        shard_size: int,
        text: bool,
        engine: str,
    ) -> ShardRun:
        """The manifest to continue (same identity, whichever engine wrote it) or a new one;
        ValueError on a mismatch."""
        manifest = _start(root, checkpoint, config, gallery, shard_size, text)
        manifest["engine"] = engine  # the engine of the latest run; each shard records its own
        return cls(root, manifest, gallery.count, shard_size, text, engine)

    @property
    def num_shards(self) -> int:
        return int(self.manifest["num_shards"])

    def bounds(self, i: int) -> tuple[int, int]:
        """[lo, hi) of shard ``i`` in the listing."""
        return i * self.shard_size, min((i + 1) * self.shard_size, self.count)

    def pending(self) -> list[int]:
        """Shards not yet recorded with their files in place, ascending."""
        done = {int(s["index"]) for s in self.manifest["shards"]}
        return [
            i
            for i in range(self.num_shards)
            if i not in done or not all(p.is_file() for p in _written(self.root, i, self.text))
        ]

    def record(
        self,
        i: int,
        image_emb: np.ndarray,
        text_emb: np.ndarray | None,
        rows: list[dict[str, Any]],
        failed: list[tuple[str, str]],
    ) -> None:
        """Write shard ``i`` (``rows`` in listing order, ``image_emb`` (r, D)), then record it."""
        lo, hi = self.bounds(i)
        if len(rows) + len(failed) != hi - lo or len(image_emb) != len(rows):
            raise RuntimeError(
                f"shard {i}: {len(rows)} rows + {len(failed)} left out for {hi - lo} images and "
                f"{len(image_emb)} embeddings; nothing written"
            )
        write_shard(self.root, i, image_emb, text_emb, [_parquet_row(r) for r in rows])
        manifest = self.manifest
        manifest["shards"] = [s for s in manifest["shards"] if int(s["index"]) != i]
        manifest["shards"].append({"index": i, "rows": len(rows), "planned": hi - lo, "engine": self.engine})
        manifest["shards"].sort(key=lambda s: s["index"])
        manifest["skipped"] = [*manifest.get("skipped", []), *({"file": f, "error": e} for f, e in failed)]
        write_manifest(self.root, manifest)

    def finish(self, started: float) -> dict[str, Any]:
        """Mark the folder complete (every shard recorded); returns the manifest."""
        missing = self.pending()
        if missing:
            raise RuntimeError(f"{self.root}: shards {missing[:8]} were not written; run again to finish")
        manifest = self.manifest
        manifest["complete"] = True
        manifest["rows"] = sum(int(s["rows"]) for s in manifest["shards"])
        manifest["seconds"] = round(time.perf_counter() - started, 3)
        manifest["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
        write_manifest(self.root, manifest)
        return manifest


def _start(
    root: Path,
    checkpoint: str | os.PathLike[str],
    config: CheckpointMeta,
    gallery: Gallery,
    shard_size: int,
    text: bool,
) -> dict[str, Any]:
    """The manifest to continue (same identity) or a new one; ValueError on a mismatch."""
    fresh = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "checkpoint_sha256": config.weights_sha256,
        "checkpoint_path": str(checkpoint),
        "dim": config.embed_dim,
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


def _parquet_row(row: dict[str, Any]) -> dict[str, Any]:
    captions = row["captions"]
    return {
        "image_path": row["image_path"],
        "caption": captions[0] if captions else None,
        "captions": captions,
        **row["fields"],
    }
