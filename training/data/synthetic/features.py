"""``icr data features``: the embedded benchmark as frozen "pretrained backbone" region features.

The papers train retrieval on frozen features of a backbone pretrained on another task, stored as
a precomp folder (``{split}_ims.npy`` (N, R, D) + ``{split}_caps.txt``, 5 lines per row). This
builds that regime from a synthetic dataset: a small CNN (:mod:`backbone`) learns per-cell object
attributes on the *train* split (no captions), is frozen, and its ``grid x grid`` map cells become
the regions of every image of train, val (written as ``dev``, the papers' name) and test.

``features.json`` beside the arrays names the source dataset and its fingerprint, so the
generator's ground truth stays available (:func:`split_source`); ``backbone.safetensors`` keeps the
frozen network, so generated distractor images can be featurised the same way (:func:`load_featurizer`).

The folder is written to a hidden sibling and renamed into place when complete, and is reused when
asked again with the same settings on the same source.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from icr.core.atomic import sha256_file, staged_dir
from icr.training.data.errors import DatasetError, parse_json, read_text
from icr.training.data.karpathy import load_image, load_karpathy
from icr.training.data.synthetic.backbone import (
    CELL_LABELS,
    COUNTS,
    BackboneConfig,
    featurise,
    forward_batches,
    held_out_metrics,
    load_backbone,
    pretrain,
    regions,
    save_backbone,
)
from icr.training.data.synthetic.generate import JSON_NAME, SCENES_NAME, load_scenes
from icr.training.data.synthetic.world import BACKGROUND_TONES

FEATURES_FORMAT = "icr-synthetic-features"
FEATURES_VERSION = 1
MANIFEST_NAME = "features.json"
BACKBONE_NAME = "backbone.safetensors"
# precomp split -> split of the synthetic dataset (the papers' configs validate on "dev")
SPLIT_MAP: dict[str, str] = {"train": "train", "dev": "val", "test": "test"}
CAPTIONS_PER_IMAGE = 5
DEFAULT_GRID = 4
DEFAULT_DIM = 256
# Measured on the 10,000 demo training images (2 cores shared with another busy process, 1 thread):
# ~15 s an epoch; 8 epochs pretrain in 121 s, the whole command takes 2 min 15 s. Colour, size,
# count and tone are learned by epoch 4 (held-out accuracy >= 0.99); shape keeps improving.
DEFAULT_EPOCHS = 8
BATCH_SIZE = 64
LR = 1e-3
EXTRACT_BATCH = 256
_REBUILD = "Rebuild the features: icr data features --data DATASET --out {out} --force."


def source_fingerprint(directory: Path) -> str:
    """sha256 over the dataset JSON and the scene file: the captions, image order and scenes that
    the feature rows and any ground truth derived from them depend on."""
    digest = hashlib.sha256()
    for name in (JSON_NAME, SCENES_NAME):
        digest.update(name.encode() + b"\0" + _file_sha256(directory / name).encode() + b"\0")
    return digest.hexdigest()


_FILE_HASHES: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path) -> str:
    # Evaluation asks for the source several times (ground truth of two splits, distractors):
    # hash each file once per (path, size, mtime) rather than re-reading ~17 MB every time.
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_HASHES:
        _FILE_HASHES[key] = sha256_file(path)
    return _FILE_HASHES[key]


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``features.json`` of ``folder``; None when there is none (an ordinary precomp folder)."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    hint = _REBUILD.format(out=Path(folder))
    manifest = parse_json(read_text(path, "features manifest", hint), path, "features manifest", hint)
    if not isinstance(manifest, dict) or manifest.get("format") != FEATURES_FORMAT:
        raise DatasetError(f"is not a {FEATURES_FORMAT} manifest.", path=path, hint=hint)
    if manifest.get("format_version") != FEATURES_VERSION:
        raise DatasetError(
            f"features format version {manifest.get('format_version')!r}, "
            f"this code reads {FEATURES_VERSION}.",
            path=path,
            hint=hint,
        )
    return manifest


def locate_source(folder: str | os.PathLike[str], manifest: dict[str, Any]) -> Path:
    """The synthetic dataset ``folder``'s features were extracted from, checked against its fingerprint.

    Looked for at its path relative to the features folder (both moved together), then where it
    was when the features were built. DatasetError when it is gone or has changed: ground truth
    from other scenes would be silently wrong.
    """
    folder = Path(folder)
    source = manifest["source"]
    candidates: list[Path] = [folder / source["relative"], Path(source["resolved"]), Path(source["path"])]
    existing = [c for c in candidates if (c / SCENES_NAME).is_file() and (c / JSON_NAME).is_file()]
    for candidate in existing:
        if source_fingerprint(candidate) == source["fingerprint"]:
            return candidate.resolve()
    where = ", ".join(dict.fromkeys(str(c) for c in candidates))
    if existing:
        raise DatasetError(
            f"the synthetic dataset these features were extracted from has changed ({existing[0]} no "
            "longer matches the fingerprint in the manifest): its scenes would give wrong ground truth.",
            path=folder / MANIFEST_NAME,
            hint=f"Rebuild the features: icr data features --data {existing[0]} --out {folder} --force.",
        )
    raise DatasetError(
        f"the synthetic dataset these features were extracted from is not found (looked in {where}); "
        "its scene structures give the ground truth.",
        path=folder / MANIFEST_NAME,
        hint="Put it back, or rebuild from where it is now: "
        f"icr data features --data DIR --out {folder} --force.",
    )


def split_source(folder: str | os.PathLike[str], split: str) -> tuple[Path, str] | None:
    """(synthetic dataset folder, its split name) behind precomp ``split`` of ``folder``; None when
    ``folder`` has no features manifest or the manifest does not map ``split``."""
    manifest = read_manifest(folder)
    if manifest is None or split not in manifest["splits"]:
        return None
    rows = np.load(Path(folder) / f"{split}_ims.npy", mmap_mode="r").shape[0]  # header only
    if rows != manifest["counts"][split]:
        raise DatasetError(
            f"{split}_ims.npy has {rows} rows, the manifest {manifest['counts'][split]}: the files were "
            "replaced after extraction.",
            path=Path(folder) / MANIFEST_NAME,
            hint=_REBUILD.format(out=folder),
        )
    return locate_source(folder, manifest), str(manifest["splits"][split])


def load_featurizer(
    folder: str | os.PathLike[str], batch_size: int = 256
) -> Callable[[np.ndarray], np.ndarray]:
    """The frozen backbone of a features folder: (N, H, W, 3) uint8 -> (N, R, D) float32 rows, as
    the folder's rows were extracted (for generated distractors)."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise DatasetError(
            "no features manifest: only folders written by `icr data features` keep their backbone.",
            path=Path(folder) / MANIFEST_NAME,
        )
    cfg = BackboneConfig.from_dict(manifest["backbone"]["config"])
    model = load_backbone(str(Path(folder) / manifest["backbone"]["file"]), cfg)
    return lambda images: featurise(model, images, batch_size)


# --- building -----------------------------------------------------------------------------------


def _settings(grid: int, dim: int, epochs: int, seed: int, fingerprint: str) -> dict[str, Any]:
    """What makes two builds the same (compared against a cached manifest)."""
    return {
        "format_version": FEATURES_VERSION,
        "grid": grid,
        "dim": dim,
        "epochs": epochs,
        "seed": seed,
        "source_fingerprint": fingerprint,
    }


def _stored_settings(manifest: dict[str, Any]) -> dict[str, Any]:
    return {
        **{k: manifest.get(k) for k in ("format_version", "grid", "dim", "epochs", "seed")},
        "source_fingerprint": manifest.get("source", {}).get("fingerprint"),
    }


def _cached(out: Path, wanted: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest at ``out`` if it was built with ``wanted``; FileExistsError (naming --force)
    when ``out`` holds anything else."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    try:
        manifest = read_manifest(out) if out.is_dir() else None
    except DatasetError:
        manifest = None
    if manifest is None:
        raise FileExistsError(
            f"{out} already exists and is not a features folder written by `icr data features`; "
            "pass --force to replace it"
        )
    stored = _stored_settings(manifest)
    if stored != wanted:
        changes = [
            "the source dataset changed" if k == "source_fingerprint" else f"{k} {stored[k]} (asked {v})"
            for k, v in wanted.items()
            if stored[k] != v
        ]
        raise FileExistsError(
            f"{out} holds features built with other settings: {', '.join(changes)}; pass --force to rebuild"
        )
    missing = [n for n in _expected_files(manifest) if not (out / n).is_file()]
    if missing:
        raise FileExistsError(f"{out} is incomplete (missing {', '.join(missing)}); pass --force to rebuild")
    return manifest


def _expected_files(manifest: dict[str, Any]) -> list[str]:
    names = [f"{s}_{kind}" for s in manifest["splits"] for kind in ("ims.npy", "caps.txt")]
    return [*names, manifest["backbone"]["file"]]


def _dataset_dir(data: Path) -> Path:
    directory = data.parent if data.is_file() else data
    for name in (JSON_NAME, SCENES_NAME):
        if not (directory / name).is_file():
            raise DatasetError(
                f"no {name}: not a synthetic dataset.",
                path=directory,
                hint="Pass a folder written by `icr data synth` (e.g. icr-demo/data).",
            )
    return directory


def build_features(
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    grid: int = DEFAULT_GRID,
    dim: int = DEFAULT_DIM,
    epochs: int = DEFAULT_EPOCHS,
    seed: int = 0,
    threads: int = 0,
    force: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Pretrain, freeze and extract (see the module docstring); returns ``{"cached": bool,
    "manifest": ...}``. Raises FileExistsError when ``out`` holds anything but the same build,
    unless ``force``. ``threads``: torch threads (0: every core this process may use); not a
    setting of the build (same seed, other thread count: the same features up to float rounding)."""
    data, out = Path(data).expanduser(), Path(out).expanduser()
    directory = _dataset_dir(data)
    wanted = _settings(grid, dim, epochs, seed, source_fingerprint(directory))
    if not force:
        manifest = _cached(out, wanted)
        if manifest is not None:
            return {"cached": True, "manifest": manifest}
    if epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {epochs}")
    if threads < 0:
        raise ValueError(f"--threads must be >= 0, got {threads}")
    with staged_dir(out) as tmp:
        manifest = _build(directory, data, out, tmp, grid, dim, epochs, seed, wanted, threads, progress)
    return {"cached": False, "manifest": manifest}


def _build(
    directory: Path,
    data: Path,
    out: Path,
    tmp: Path,
    grid: int,
    dim: int,
    epochs: int,
    seed: int,
    wanted: dict[str, Any],
    threads: int,
    progress: bool,
) -> dict[str, Any]:
    started = time.perf_counter()
    scenes = load_scenes(directory)
    dataset = load_karpathy(directory / JSON_NAME, captions_per_image=CAPTIONS_PER_IMAGE)
    for name in SPLIT_MAP.values():
        if name not in dataset.splits or not dataset.split(name).images:
            raise DatasetError(
                f"split {name!r} is missing or empty.", path=directory / JSON_NAME, hint="Regenerate it."
            )
    cfg = BackboneConfig(image_size=scenes.image_size, grid=grid, dim=dim)  # checks grid vs image size
    previous = torch.get_num_threads()
    # Default: all the cores this process may use (torch's default counts physical cores, possibly
    # fewer). On a machine shared with another busy process, fewer threads than cores is much faster
    # (measured on 2 cores beside one busy process: 16 ms an image with 2 threads, 1.8 ms with 1).
    # Restored after, so a caller in the same process (tests, icr demo) keeps its setting.
    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    try:
        # fork_rng: the seed below must not move the caller's global torch RNG.
        with torch.random.fork_rng(devices=[]):
            train_images, train_scenes = _split_images(dataset, scenes, "train", progress)
            t0 = time.perf_counter()
            model = pretrain(
                train_images,
                train_scenes,
                cfg,
                epochs=epochs,
                seed=seed,
                batch_size=BATCH_SIZE,
                lr=LR,
                progress=progress,
            )
            pretrain_s = time.perf_counter() - t0
            save_backbone(model, str(tmp / BACKBONE_NAME))
            t0 = time.perf_counter()
            held_out: dict[str, Any] = {}
            counts = {}
            for name, split in SPLIT_MAP.items():
                images, split_scenes = (
                    (train_images, train_scenes)
                    if split == "train"
                    else _split_images(dataset, scenes, split, progress)
                )
                cell, glob = _write_split(tmp, name, model, images, dataset.split(split).captions, progress)
                counts[name] = len(images)
                if split == "val":
                    held_out = {"split": "val", **held_out_metrics(cell, glob, split_scenes, grid)}
            extract_s = time.perf_counter() - t0
    finally:
        torch.set_num_threads(previous)
    resolved = directory.resolve()
    manifest = {
        "format": FEATURES_FORMAT,
        "format_version": FEATURES_VERSION,
        "source": {
            "path": str(data),
            "resolved": str(resolved),
            "relative": os.path.relpath(resolved, out.resolve()),
            "fingerprint": wanted["source_fingerprint"],
            "generator": scenes.generator,
        },
        "generator_version": scenes.version,
        "splits": dict(SPLIT_MAP),
        "counts": counts,
        "captions_per_image": CAPTIONS_PER_IMAGE,
        "grid": grid,
        "dim": dim,
        "regions": grid * grid,
        "seed": seed,
        "epochs": epochs,
        "backbone": {
            "file": BACKBONE_NAME,
            "config": cfg.to_dict(),
            "architecture": "4 x (conv3x3 + BatchNorm + ReLU; strides 2, 2, 1, 2) -> adaptive avg pool "
            "to grid x grid -> conv1x1 + ReLU = region features (post-ReLU, rows row-major)",
            "cell_labels": list(CELL_LABELS),
            "global_labels": {"tone": list(BACKGROUND_TONES), "count": list(COUNTS)},
        },
        "pretraining": {
            "task": "per-cell multi-label attributes (shape, colour, size of the objects whose centre "
            "lies in the cell, or empty) + background tone and object count from the pooled map; no captions",
            "split": "train",
            "images": counts["train"],
            "epochs": epochs,
            "batch_size": BATCH_SIZE,
            "lr": LR,
            "threads": threads,
            "seconds": round(pretrain_s, 1),
            "held_out": held_out,
        },
        "extraction_seconds": round(extract_s, 1),
        "seconds": round(time.perf_counter() - started, 1),
    }
    (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def _split_images(dataset: Any, scenes: Any, split: str, progress: bool) -> tuple[np.ndarray, list[Any]]:
    """(N, H, W, 3) uint8 images of ``split`` in the dataset's image order, and their scenes."""
    records = dataset.split(split).images
    bar = tqdm(records, desc=f"decoding {split}", unit="img", leave=False, disable=not progress)
    # the decoder open_split uses, so the rows are of exactly the images the loaders would show
    images = np.stack([np.asarray(load_image(r.path)) for r in bar])  # (N, H, W, 3)
    return images, scenes.for_imgids([r.imgid for r in records])


def _write_split(
    tmp: Path, name: str, model: Any, images: np.ndarray, captions: list[str], progress: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Write ``{name}_ims.npy`` (N, R, D) float32 and ``{name}_caps.txt``; returns the heads'
    cell logits (N, L, g, g) and global logits (N, T + C) (the held-out metrics of ``dev``)."""
    for number, caption in enumerate(captions, start=1):
        # the caption file is split on newlines and stripped: anything else would not read back
        if not caption or caption != caption.strip() or "\n" in caption or "\r" in caption:
            raise DatasetError(
                f"caption {number} of split {name!r} ({caption!r}) cannot be one line of a caption file.",
                hint="Regenerate the dataset with `icr data synth --force`.",
            )
    cfg = model.cfg
    # written row block by row block: train is ~160 MB at the defaults, never held twice in memory
    rows = np.lib.format.open_memmap(
        tmp / f"{name}_ims.npy", mode="w+", dtype=np.float32, shape=(len(images), cfg.grid**2, cfg.dim)
    )
    cells, globs = [], []
    start = 0
    batches = forward_batches(model, images, EXTRACT_BATCH)
    total = -(-len(images) // EXTRACT_BATCH)
    bar = tqdm(
        batches, total=total, desc=f"extracting {name}", unit="batch", leave=False, disable=not progress
    )
    for fmap, cell_logits, global_logits in bar:
        rows[start : start + len(fmap)] = regions(fmap)  # (b, g*g, dim)
        start += len(fmap)
        cells.append(cell_logits)
        globs.append(global_logits)
    rows.flush()
    del rows
    (tmp / f"{name}_caps.txt").write_text("\n".join(captions) + "\n", encoding="utf-8")
    return torch.cat(cells).numpy(), torch.cat(globs).numpy()
