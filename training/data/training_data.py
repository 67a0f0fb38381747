"""One dataset split as the trainer and evaluators see it: captions, their images, and batches.

Hides whether images come from files (Karpathy JSON) or from precomputed features, and plans the
batches of an epoch from ``(seed, epoch)`` alone, so a resumed run replays exactly the same
batches and augmentations as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tqdm import tqdm

from icr.training.data.karpathy import load_image, load_karpathy
from icr.training.data.precomp import is_precomp, load_precomp
from icr.training.data.synthetic.features import split_source
from icr.training.data.synthetic.generate import SCENES_NAME
from icr.training.data.vocab import tokenize

# Preloading decodes every image once; above this many bytes the images are read per batch instead.
PRELOAD_LIMIT_BYTES = 2 << 30


@dataclass
class SplitData:
    """Captions ``captions[c]`` describe image ``img_of_cap[c]`` (an index in ``[0, num_images)``)."""

    name: str
    captions: list[str]
    img_of_cap: np.ndarray  # (N_cap,) int64
    num_images: int
    # PIL image or (H, W, 3) uint8 array (Karpathy, preloaded) or float array (R, F) / (F,) (precomp)
    get_image: Callable[[int], Any]
    fingerprint: str  # sha256 over the split's captions and image names: ties checkpoints to data
    kind: str  # "karpathy" | "precomp"
    source: Path

    @property
    def caption_tokens(self) -> list[list[str]]:
        """Captions tokenized as the GRU text tower reads them (for the vocabulary)."""
        return [tokenize(caption) for caption in self.captions]

    def captions_of_images(self) -> list[np.ndarray]:
        """For every image, the indices of its captions (in caption order)."""
        order = np.argsort(self.img_of_cap, kind="stable")
        bounds = np.searchsorted(self.img_of_cap[order], np.arange(self.num_images + 1))
        return [order[bounds[i] : bounds[i + 1]] for i in range(self.num_images)]

    def head(self, num_images: int) -> SplitData:
        """The first ``num_images`` images and their captions (0 = all): quick validation subsets."""
        if num_images <= 0 or num_images >= self.num_images:
            return self
        keep = self.img_of_cap < num_images
        return SplitData(
            self.name,
            [c for c, k in zip(self.captions, keep, strict=True) if k],
            self.img_of_cap[keep],
            num_images,
            self.get_image,
            _fingerprint(self.fingerprint, str(num_images)),
            self.kind,
            self.source,
        )


def open_split(
    path: str | os.PathLike[str],
    split: str,
    *,
    captions_per_image: int = 5,
    preload: str | bool = "auto",
    progress: bool = False,
) -> SplitData:
    """Load ``split`` of the dataset at ``path`` (Karpathy JSON or folder, or a precomp folder)."""
    path = Path(path).expanduser()
    if is_precomp(path):
        p = load_precomp(path, split)
        img_of_cap = np.arange(len(p.captions), dtype=np.int64) // p.im_div
        features = p.images
        if _want_preload(preload, features.nbytes):
            features = np.ascontiguousarray(features)
        return SplitData(
            split,
            list(p.captions),
            img_of_cap,
            p.num_images,
            lambda i: np.array(features[i], dtype=np.float32),  # a copy: mmap rows are read-only
            _fingerprint("precomp", split, *p.captions, str(p.images.shape)),
            "precomp",
            path,
        )

    dataset = load_karpathy(path, captions_per_image=captions_per_image)
    s = dataset.split(split)
    paths = [r.path for r in s.images]
    get_image: Callable[[int], Any] = lambda i: load_image(paths[i])  # noqa: E731
    if paths and _want_preload(preload, _estimated_bytes(paths[0], len(paths))):
        get_image = _preloaded(paths, progress)
    return SplitData(
        split,
        s.captions,
        np.arange(s.num_captions, dtype=np.int64) // s.captions_per_image,
        len(s),
        get_image,
        _fingerprint(dataset.name, split, *s.captions, *(r.filename for r in s.images)),
        "karpathy",
        dataset.json_path,
    )


def _want_preload(preload: str | bool, nbytes: int) -> bool:
    if preload == "auto":
        return nbytes <= PRELOAD_LIMIT_BYTES
    if isinstance(preload, bool):
        return preload
    raise ValueError(f"data.preload must be auto, true or false, got {preload!r}")


def _estimated_bytes(first: Path, count: int) -> int:
    with Image.open(first) as im:
        return im.width * im.height * 3 * count


def _preloaded(paths: list[Path], progress: bool) -> Callable[[int], Any]:
    """Decode every image once into (H, W, 3) uint8 arrays (small images, e.g. the embedded
    benchmark), handed out as they are: the image transforms batch same-size arrays without a
    PIL round trip (10 % of a demo training epoch when they were wrapped back into PIL images)."""
    arrays: list[np.ndarray] = []
    for p in tqdm(paths, desc="decoding images", unit="img", leave=False, disable=not progress):
        arrays.append(np.asarray(load_image(p)))
    return lambda i: arrays[i]


def _fingerprint(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


# --- batch planning ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedBatch:
    """Indices of one batch: ``cap_idx`` captions; ``img_idx`` the image rows (see ``sampling``)."""

    img_idx: np.ndarray  # (Ni,) image indices of the image rows
    cap_idx: np.ndarray  # (Nc,) caption indices


def plan_epoch(data: SplitData, sampling: str, batch_size: int, seed: int, epoch: int) -> list[PlannedBatch]:
    """The batches of one epoch, a pure function of ``(seed, epoch)``; the last partial batch is dropped.

    ``caption`` sampling: a permutation of all captions, image row ``i`` = the image of caption ``i``
    (the seeds' layout). ``image`` sampling (SmoothAP): a permutation of the images, each with all
    its captions, ``batch_size`` images per batch.
    """
    rng = np.random.default_rng([seed, epoch, 0x1C5])
    if sampling == "caption":
        order = rng.permutation(len(data.captions))
        n = len(order) // batch_size
        return [
            PlannedBatch(data.img_of_cap[chunk], chunk)
            for chunk in (order[k * batch_size : (k + 1) * batch_size] for k in range(n))
        ]
    if sampling == "image":
        caps = data.captions_of_images()
        order = rng.permutation(data.num_images)
        n = len(order) // batch_size
        batches = []
        for k in range(n):
            imgs = order[k * batch_size : (k + 1) * batch_size]
            batches.append(PlannedBatch(imgs, np.concatenate([caps[i] for i in imgs])))
        return batches
    raise ValueError(f"unknown sampling {sampling!r}; expected 'caption' or 'image'")


def synthetic_dir(data: SplitData) -> Path | None:
    """The dataset folder when ``data`` is the embedded benchmark (it stores scene structures).

    None for precomp splits, even those extracted from the benchmark by ``icr data features``:
    callers of this function read or render the split's images. Ground truth for those splits:
    :func:`synthetic_source`.
    """
    if data.kind != "karpathy":
        return None
    directory = Path(data.source).parent
    return directory if (directory / SCENES_NAME).is_file() else None


def synthetic_source(data: SplitData) -> tuple[Path, str] | None:
    """Where the generator's scenes of ``data``'s images are: (synthetic dataset folder, split name in it).

    The embedded benchmark itself, or a precomp folder written by ``icr data features`` (its
    ``features.json`` names the source dataset and maps ``dev`` to ``val``); None for any other
    dataset. Raises DatasetError when a features folder's source has moved or changed, rather than
    judging relevance with other scenes. Unlike :func:`synthetic_dir`, the folder may not hold
    ``data``'s images (a precomp split has feature rows): use it for scenes and ground truth only.
    """
    if data.kind == "karpathy":
        directory = synthetic_dir(data)
        return None if directory is None else (directory, data.name)
    if data.kind != "precomp":
        return None

    return split_source(Path(data.source), data.name)
