"""Index shards: one index folder cut into S folders that each hold a contiguous range of its ids,
under the same global ids, for serving on several processes or machines (issue 42, first slice).

A shard is written by the compaction of a living index (:mod:`index.live_compact`) in which every id
outside the shard's range counts as deleted: an inverted file keeps its trained centroids and its
codes (nothing is encoded again), an exact index keeps its vectors under an id map, the metadata
rows are the shard's own, and the manifest says which shard it is (``extra.shard``: index, count,
id range, the source folder). Every shard keeps the source's checkpoint hash and ``created`` stamp, so
all S are checked to come from one checkpoint and one build.

Merging the shards' top-k lists by score gives the top-k of the whole index: exactly so for exact
shards (up to tied scores), and never worse than the shards' own recall for inverted files.
A shard's manifest names its id range (``id_range``); only the holes within it are listed. A shard
takes writes into a write log of its own (``base_seq`` 0: a compacted source's log is folded in and
not carried on); images added online go to the last shard, whose range is open-ended
(:mod:`service.sharded_index`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from icr.index.index_folder import load_index_dir, read_holes
from icr.index.live_compact import compact
from icr.index.live_index import BaseIds, LiveIndex
from icr.index.manifest import Manifest


def shard_ranges(ntotal: int, shards: int) -> list[tuple[int, int]]:
    """[lo, hi) id ranges of ``shards`` contiguous, near-equal parts of 0..ntotal-1."""
    if not 1 <= shards <= max(ntotal, 1):
        raise ValueError(f"--shards must be between 1 and the index's {ntotal:,} ids, got {shards}")
    edges = np.linspace(0, ntotal, shards + 1).round().astype(int)
    return [(int(edges[s]), int(edges[s + 1])) for s in range(shards)]


def shard_index(
    index_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    shards: int,
    say: Callable[[str], None] = lambda _m: None,
) -> list[dict[str, Any]]:
    """Write ``out_dir/shard-<s>-of-<S>`` for each shard of the index folder ``index_dir``; returns
    each one's id range and what its compaction reports."""
    index_dir, out_dir = Path(index_dir), Path(out_dir)
    index, manifest, metadata = load_index_dir(index_dir)
    try:
        holes = read_holes(index_dir, manifest)
        out = []
        for s, (lo, hi) in enumerate(shard_ranges(manifest.ntotal, shards)):
            inside = None if holes is None else holes[(holes >= lo) & (holes < hi)]
            # seq 0: a shard's own log starts empty
            base = BaseIds(manifest.ntotal, 0, inside, lo, hi)
            live = LiveIndex(index, metadata, None, "shard", base=base)
            folder = out_dir / f"shard-{s}-of-{shards}"
            say(f"shard {s}: ids {lo:,} to {hi - 1:,} -> {folder}")
            info = {"index": s, "count": shards, "ids": [lo, hi], "from": index_dir.name}
            report = compact(live, index_dir, folder, extra={"shard": info})
            out.append({"shard": s, "ids": [lo, hi], "folder": str(folder), "vectors": report["vectors"]})
        return out
    finally:
        metadata.close()


def check_shards(manifests: list[Manifest]) -> None:
    """ValueError unless ``manifests`` are the S shards of one build: one checkpoint, one build stamp,
    every shard index 0..S-1 once."""
    if not manifests:
        raise ValueError("no shard folders given")
    first = manifests[0]
    for m in manifests:
        if (m.checkpoint_sha256, m.created) != (first.checkpoint_sha256, first.created):
            raise ValueError(
                "the shards come from different checkpoints or builds; shard one index folder again"
            )
    found = sorted((m.extra.get("shard") or {}).get("index", -1) for m in manifests)
    counts = {(m.extra.get("shard") or {}).get("count") for m in manifests}
    if counts != {len(manifests)} or found != list(range(len(manifests))):
        raise ValueError(
            f"expected shards 0..{len(manifests) - 1} of {len(manifests)}, found indices {found}"
        )
