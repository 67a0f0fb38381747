"""The artifacts the benchmarks search: embedded-default data and model, and image indices holding
the test images plus generated distractors, all cached in the work folder.

The largest gallery is built by ``icr index build`` in a child process (its wall time and peak
memory are the index-build figures); smaller galleries and the exact (Flat) twins reuse its
distractor embeddings (``--distractor-embeddings``), so every size holds the same vectors.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from icr.index.manifest import MANIFEST_FILE, Manifest

QUICK_COUNTS = {"train": 400, "val": 100, "test": 200}


@dataclass
class Model:
    data: Path
    checkpoint: Path


def prepare_model(workdir: Path, quick: bool, checkpoint: Path | None, data: Path | None, log) -> Model:
    """The embedded benchmark and a model: unless given, the demo's benchmark (cached) and the demo
    model shipped with icr, as ``icr demo`` takes them; for ``quick`` a tiny set and one short
    epoch (figures of an untrained model are still real)."""
    if checkpoint is not None:
        if data is None:
            raise ValueError("--checkpoint needs --data (the synthetic benchmark folder it was trained on)")
        return Model(data, checkpoint)
    if not quick:
        from icr.demo import demo_data_and_model

        return Model(*demo_data_and_model(workdir, seed=0, force=False, train=False))
    from icr.training.config import load_config
    from icr.training.data.synthetic.generate import write_dataset
    from icr.training.train import train

    data, run = workdir / "quick-data", workdir / "quick-model"
    if not (data / "scenes.json").is_file():
        log(f"quick: writing a {sum(QUICK_COUNTS.values())}-image synthetic benchmark")
        write_dataset(data, **QUICK_COUNTS, image_size=64, seed=0, force=True, progress=False)
    if not (run / "best" / "config.json").is_file():
        log("quick: training one short epoch")
        config = load_config(
            "synthetic-demo",
            [f'data.path="{data}"', f'train.out="{run}"', "train.epochs=1", "train.batch_size=64"],
        )
        train(config, progress=False)
    return Model(data, run / "best")


def _cached(model: Model, out: Path, distractors: int) -> Manifest | None:
    """The image index at ``out`` if built from this checkpoint, data and distractor count."""
    from icr.demo import _cached_manifest

    return _cached_manifest(out, model.checkpoint, model.data, "image", distractors)


def build_largest(model: Model, distractors: int, out: Path, log, quiet: bool = False) -> dict[str, Any]:
    """``icr index build`` with ``distractors`` generated images (cached by checkpoint, data and count);
    returns its figures: wall time, peak RSS of the process, embedding throughput, factory."""
    manifest = _cached(model, out, distractors)
    fresh = manifest is None
    wall = None
    if fresh:
        log(f"index build: {distractors:,} generated distractors -> {out} (icr index build, child process)")
        command = [
            sys.executable,
            "-m",
            "icr.cli",
            "index",
            "build",
            "--checkpoint",
            str(model.checkpoint),
            "--data",
            str(model.data),
            "--distractors",
            str(distractors),
            "--out",
            str(out),
        ] + (["--quiet"] if quiet else [])
        t0 = time.perf_counter()
        subprocess.run(command, check=True)
        wall = time.perf_counter() - t0
        manifest = Manifest.read(out / MANIFEST_FILE)
    else:
        log(f"index build: cached in {out} (figures from its manifest)")
    extra = manifest.extra
    return {
        "vectors": manifest.ntotal,
        "distractors": manifest.distractor_count,
        "factory": manifest.factory,
        "factory_reason": manifest.factory_reason,
        "build_seconds": manifest.build_seconds,
        "wall_seconds_this_run": wall,
        "peak_rss_mb": manifest.peak_rss_mb,
        "recall_check": manifest.recall_check,
        "throughput": {k: v for k, v in extra.items() if k.endswith("_per_s")},
        "timings": {k: v for k, v in extra.items() if k.endswith("_seconds")},
        "cached": not fresh,
    }


def distractor_embeddings(index_dir: Path, out: Path) -> Path:
    """The distractor vectors of a built index (ids after the gallery), as an (N, D) float32 .npy."""
    from icr.index.index_folder import load_index_dir
    from icr.index.vector_index import stored_vectors

    manifest = Manifest.read(index_dir / MANIFEST_FILE)
    if out.is_file() and np.load(out, mmap_mode="r").shape[0] == manifest.distractor_count:
        return out
    index, manifest, metadata = load_index_dir(index_dir)
    metadata.close()
    read = stored_vectors(index)  # an inverted file's direct map; a re-ranked index's raw vectors
    if read is None:
        raise ValueError(f"{index_dir}: its index cannot give its vectors back")
    first = manifest.gallery_count
    vectors = read(np.arange(first, first + manifest.distractor_count))  # (N, D) the distractors
    tmp = out.with_suffix(".tmp.npy")
    np.save(tmp, vectors.astype(np.float32, copy=False))
    tmp.replace(out)
    return out


def gallery_index(model: Model, embeddings: Path, count: int, factory: str, out: Path, log) -> Path:
    """An image index of the test images plus the first ``count`` distractors of ``embeddings``
    (cached by checkpoint, data, count and factory)."""
    from icr.index.build import build_image_index

    manifest = _cached(model, out, count)
    if manifest is not None and factory in ("auto", manifest.factory):
        return out
    subset = out.parent / f"distractors-{count}.npy"
    if not subset.is_file():
        np.save(subset, np.load(embeddings, mmap_mode="r")[:count])
    log(f"index: {count:,} distractors, factory {factory} -> {out}")
    build_image_index(
        model.checkpoint,
        model.data,
        distractor_embeddings=subset,
        factory=factory,
        gpu="off",
        out=out,
        progress=False,
    )
    return out
