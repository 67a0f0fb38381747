"""``icr embed``: a gallery's embeddings written as clip-retrieval shards, resumable.

See :mod:`index.embeddings_layout` for the folder. A run first writes the manifest (checkpoint
sha256, source, shard size, count) and records each shard after its files are in place; run again
with the same arguments and it continues after the last recorded shard. Arguments that differ from
the manifest's (another checkpoint, source or shard size) are refused rather than mixed in.

Two engines fill the same shards through :class:`index.embed_shards.ShardRun`: ``local`` (this
process, shard after shard) and ``ray`` (:mod:`index.embed_ray`, Ray Data workers). The manifest
records the engine of the latest run and of each shard; a run started with one engine can be
finished by the other.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from icr.core.devices import resolve_device
from icr.index.embed_ray import embed_shards_ray
from icr.index.embed_shards import ShardRun
from icr.index.embeddings_layout import (
    DEFAULT_SHARD_SIZE,
    MANIFEST,
    RESERVED_COLUMNS,
    read_manifest,
)
from icr.index.galleries import (
    FileGallery,
    Gallery,
    ImageListGallery,
    PhotoGallery,
    SplitGallery,
    WebDatasetGallery,
)
from icr.training.checkpoint import load_checkpoint
from icr.training.embedding import embed_captions

ENGINES = ("local", "ray")


def embed_to_folder(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    images: str | os.PathLike[str] | None = None,
    metadata: str | os.PathLike[str] | None = None,
    data: str | os.PathLike[str] | None = None,
    split: str = "test",
    webdataset: str | os.PathLike[str] | None = None,
    image_list: str | os.PathLike[str] | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    batch_size: int = 256,
    device: str = "auto",
    skip_bad: bool = False,
    workers: int | None = None,
    progress: bool = True,
    engine: str = "local",
    address: str | None = None,
    actors: int | None = None,
    on_shard: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Embed one source: ``images`` (a folder, with an optional metadata file), ``webdataset`` (tar
    shards), ``image_list`` (a parquet of image paths) or ``data``'s ``split``; returns the finished
    manifest. ``shard_size``: images per shard file.

    ``engine="ray"`` runs the same shards on Ray Data (:mod:`index.embed_ray`; file sources only):
    ``address`` None starts a local Ray instance (an already connected driver is reused), ``auto`` or
    ``ray://host:port`` joins a cluster; ``actors`` embedding actors (default: one per GPU, else half
    the CPUs). Both engines write the same folder and either one continues the other's run.
    ``on_shard(i)`` is called after shard ``i`` is recorded."""
    _check_arguments(
        [images, data, webdataset, image_list],
        metadata,
        data,
        shard_size,
        batch_size,
        engine,
        address,
        actors,
    )
    root = Path(out)
    if root.exists() and any(root.iterdir()) and read_manifest(root) is None:
        raise ValueError(f"{root}: exists, is not empty and holds no {MANIFEST}; choose a new --out")
    started = time.perf_counter()
    # the Ray driver needs the model only for its config and eval transform: actors embed
    device = resolve_device(device) if engine == "local" else device
    model, config = load_checkpoint(checkpoint, device if engine == "local" else "cpu")
    gallery: Gallery
    if images is not None:
        gallery = PhotoGallery(images, metadata, skip_bad=skip_bad, workers=workers)
    elif webdataset is not None:
        gallery = WebDatasetGallery(webdataset, skip_bad=skip_bad, workers=workers)
    elif image_list is not None:
        gallery = ImageListGallery(image_list, skip_bad=skip_bad, workers=workers)
    else:
        assert data is not None
        gallery = SplitGallery(data, split, config.captions_per_image, progress)
    clash = sorted(set(gallery.field_names()) & set(RESERVED_COLUMNS))
    if clash:
        raise ValueError(
            f"{metadata or image_list or webdataset}: column(s) {clash} are reserved in the embeddings "
            "layout; rename them"
        )
    run = ShardRun.start(root, checkpoint, config, gallery, shard_size, gallery.captions_complete(), engine)
    todo = run.pending()
    with tqdm(total=gallery.count, desc="embedding", unit="img", disable=not progress) as bar:
        bar.update(gallery.count - sum(run.bounds(i)[1] - run.bounds(i)[0] for i in todo))
        if engine == "ray":
            assert isinstance(gallery, FileGallery)
            transform = model.image_transform(train=False)
            del model
            embed_shards_ray(
                run,
                todo,
                gallery=gallery,
                checkpoint=checkpoint,
                transform=transform,
                batch_size=batch_size,
                device=device,
                address=address,
                actors=actors,
                skip_bad=skip_bad,
                progress=progress,
                bar=bar,
                on_shard=on_shard,
            )
        else:
            _embed_shards_local(run, todo, gallery, model, batch_size, device, bar, on_shard)
    return run.finish(started)


def _check_arguments(
    sources: list[str | os.PathLike[str] | None],
    metadata: str | os.PathLike[str] | None,
    data: str | os.PathLike[str] | None,
    shard_size: int,
    batch_size: int,
    engine: str,
    address: str | None,
    actors: int | None,
) -> None:
    if sum(s is not None for s in sources) != 1:
        raise ValueError(
            "give one source: --images DIR (your photos), --webdataset TARS, --image-list FILE.parquet "
            "or --data D (a dataset split)"
        )
    if metadata is not None and sources[0] is None:
        raise ValueError("--metadata describes the files of --images DIR; it applies to no other source")
    if shard_size < 1 or batch_size < 1:
        raise ValueError(f"--shard-size and --batch-size must be >= 1, got {shard_size} and {batch_size}")
    if engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "ray" and data is not None:
        raise ValueError(
            "--engine ray reads image files (--images, --webdataset, --image-list); embed --data with "
            "--engine local"
        )
    if engine != "ray" and (address is not None or actors is not None):
        raise ValueError("--address and --actors apply to --engine ray")
    if actors is not None and actors < 1:
        raise ValueError(f"--actors must be >= 1, got {actors}")


def _embed_shards_local(
    run: ShardRun,
    todo: list[int],
    gallery: Gallery,
    model: Any,
    batch_size: int,
    device: str,
    bar: Any,
    on_shard: Callable[[int], None] | None,
) -> None:
    """The local engine: shard after shard in this process."""
    for i in todo:
        lo, hi = run.bounds(i)
        vectors, rows, failed = [], [], []
        for batch in gallery.batches(model, lo, hi, batch_size, device):
            vectors.append(batch.vectors)
            rows += batch.rows
            failed += batch.failed
            bar.update(len(batch.rows) + len(batch.failed))
        dim = model.embed_dim
        image_emb = np.concatenate(vectors) if vectors else np.zeros((0, dim), np.float32)  # (r, D)
        text_emb = _first_captions(model, rows, device) if run.text else None  # (r, D)
        run.record(i, image_emb, text_emb, rows, failed)
        if on_shard is not None:
            on_shard(i)


def _first_captions(model: Any, rows: list[dict[str, Any]], device: str) -> np.ndarray:
    """(r, D) embeddings of each row's first caption (clip-retrieval has one caption per sample)."""
    return embed_captions(model, [r["captions"][0] for r in rows], device=device)
