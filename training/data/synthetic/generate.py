"""Writes the embedded benchmark (Karpathy JSON + PNG folder + scene structures) and streams
distractor images lazily.

Every image is a pure function of (seed, stream, index): image i of a split is the same whatever
the split sizes, and distractor k can be drawn without drawing the k - 1 before it. Images are
rendered a batch at a time (:func:`render.render_batch`), and a batch holds the same bytes as the
images drawn one by one.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tqdm import tqdm

from icr.core.atomic import staged_dir
from icr.training.data.errors import DatasetError, parse_json, read_text
from icr.training.data.karpathy import load_karpathy
from icr.training.data.synthetic.captions import write_captions
from icr.training.data.synthetic.render import noise_words, render_batch, words_to_bits
from icr.training.data.synthetic.render_v1 import render_v1
from icr.training.data.synthetic.scene import Scene, SceneTable, sample_scene
from icr.training.data.vocab import tokenize

GENERATOR_NAME = "icr-synthetic-scenes"
# Bump when a change alters what a seed produces, so stored datasets are known to be stale.
# 2: the vectorised renderer (render.py; same scenes and captions, other pixels, about 6x less CPU).
GENERATOR_VERSION = 2
# Versions whose images this code still draws: a dataset written by version 1 keeps rendering its
# distractors with the version-1 renderer, byte for byte (an index stores distractor ids only).
RENDERED_VERSIONS = (1, 2)
SCENES_FORMAT_VERSION = 1
JSON_NAME = "dataset_synthetic.json"
SCENES_NAME = "scenes.json"
IMAGE_DIR = "images"
SPLITS = ("train", "val", "test")
# Independent random streams per split; distractors and generated queries have their own.
STREAMS = {"train": 1, "val": 2, "test": 3, "distractor": 4, "query": 5}


def _child_rng(seed: int, stream: str, index: int, child: int) -> np.random.Generator:
    """Child ``child`` of the image's seed sequence: 0 scene (and, since version 2, pixel noise),
    1 pixel noise of version 1, 2 captions. The same generator as ``SeedSequence(...).spawn(3)[child]``
    without spawning (and paying for) the others."""
    return np.random.default_rng(np.random.SeedSequence([seed, STREAMS[stream], index], spawn_key=(child,)))


def make_scene(seed: int, stream: str, index: int) -> Scene:
    return sample_scene(_child_rng(seed, stream, index, 0))


def make_images(
    seed: int, stream: str, indices: Sequence[int], image_size: int, *, version: int = GENERATOR_VERSION
) -> tuple[list[Scene], np.ndarray]:
    """Scenes and (B, H, W, 3) uint8 images of ``indices``; image k depends on (seed, stream, k) only.

    Version 2 draws the scene and then the noise bits from one generator (child 0) and renders the
    batch at once; version 1 (:mod:`render_v1`) draws the noise from child 1, one image at a time.
    """
    _check_version(version)
    scenes = []
    if version == 1:
        images = []
        for k in indices:
            scene = sample_scene(_child_rng(seed, stream, k, 0))
            scenes.append(scene)
            images.append(render_v1(scene, image_size, _child_rng(seed, stream, k, 1)))
        return scenes, np.stack(images) if images else np.empty((0, image_size, image_size, 3), np.uint8)
    words = np.empty((len(indices), noise_words(image_size)), np.uint64)
    for j, k in enumerate(indices):
        rng = _child_rng(seed, stream, k, 0)
        scenes.append(sample_scene(rng))  # a fixed number of draws, then the noise bits
        words[j] = rng.bit_generator.random_raw(words.shape[1])
    return scenes, render_batch(scenes, image_size, words_to_bits(words, image_size))


def make_image(
    seed: int, stream: str, index: int, image_size: int, *, version: int = GENERATOR_VERSION
) -> tuple[Scene, np.ndarray]:
    scenes, images = make_images(seed, stream, [index], image_size, version=version)
    return scenes[0], images[0]


def _check_version(version: int) -> None:
    if version not in RENDERED_VERSIONS:
        raise ValueError(f"generator version {version!r}: this code renders versions {RENDERED_VERSIONS}")


def _png_bytes(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def _progress(total: int, enabled: bool, desc: str) -> tqdm:
    return tqdm(total=total, disable=not enabled, desc=desc, unit="img")


def write_dataset(
    out: str | os.PathLike[str],
    *,
    train: int = 2000,
    val: int = 200,
    test: int = 200,
    image_size: int = 64,
    seed: int = 0,
    force: bool = False,
    progress: bool = False,
    tone_captions: float = 0.0,
    count_captions: float = 0.0,
) -> dict[str, Any]:
    """Generate the benchmark into `out` and return its summary.

    ``tone_captions`` > 0 or ``count_captions`` > 0 write training data rather than the benchmark:
    that share of the train split's one-object captions also name the background tone, or are
    replaced by the scene's bare count (:func:`write_captions`).

    The dataset is written to a hidden sibling folder and renamed into place when complete, so an
    interrupted run never leaves a half dataset at `out` (nor destroys the one already there).
    """
    out = Path(out)
    counts = {"train": train, "val": val, "test": test}
    for split, n in counts.items():
        if n < 0:
            raise ValueError(f"--{split} must be >= 0, got {n}")
    if image_size < 16:
        raise ValueError(f"--image-size must be at least 16 pixels, got {image_size}")
    for name, p in (("tone", tone_captions), ("count", count_captions)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"--{name}-captions is a probability in [0, 1], got {p}")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not force:
        raise FileExistsError(f"{out} already exists and is not empty; pass --force to replace it")
    start = time.perf_counter()
    with staged_dir(out) as tmp:
        (tmp / IMAGE_DIR).mkdir()
        images, scenes = [], []
        imgid = 0
        chunks = [
            (seed, split, lo, min(lo + SYNTH_CHUNK, counts[split]), image_size, tone_captions, count_captions)
            for split in SPLITS
            for lo in range(0, counts[split], SYNTH_CHUNK)
        ]
        workers = render_workers() if sum(counts.values()) >= 4 * SYNTH_CHUNK else 1
        with _progress(sum(counts.values()), progress, "synthesising") as bar:
            rendered = _ordered_map(_synth_items, chunks, workers)
            for (_, split, lo, *_), items in zip(chunks, rendered, strict=True):
                for i, (png, captions, scene) in enumerate(items, start=lo):
                    filename = f"synth_{split}_{i:06d}.png"
                    (tmp / IMAGE_DIR / filename).write_bytes(png)
                    sentids = list(range(5 * imgid, 5 * imgid + len(captions)))
                    images.append(
                        {
                            "filepath": IMAGE_DIR,
                            "filename": filename,
                            "imgid": imgid,
                            "split": split,
                            "sentids": sentids,
                            "sentences": [
                                {"raw": text, "tokens": tokenize(text), "imgid": imgid, "sentid": sid}
                                for text, sid in zip(captions, sentids, strict=True)
                            ],
                        }
                    )
                    scenes.append({"imgid": imgid, "filename": filename, "split": split, **scene.to_dict()})
                    imgid += 1
                    bar.update(1)
        generator = {
            "name": GENERATOR_NAME,
            "version": GENERATOR_VERSION,
            "seed": seed,
            "image_size": image_size,
            "counts": counts,
            # recorded only when set, so the benchmark's scenes.json keeps its bytes
            **({"tone_captions": tone_captions} if tone_captions else {}),
            **({"count_captions": count_captions} if count_captions else {}),
        }
        _write_json(tmp / JSON_NAME, {"dataset": "synthetic", "images": images})
        _write_json(
            tmp / SCENES_NAME,
            {"format_version": SCENES_FORMAT_VERSION, "generator": generator, "scenes": scenes},
        )
    return {
        "out": str(out),
        "images": sum(counts.values()),
        "seconds": time.perf_counter() - start,
        **generator,
    }


SYNTH_CHUNK = 500  # images per task when the benchmark is rendered in several processes


def _synth_items(
    seed: int, split: str, lo: int, hi: int, image_size: int, tone_captions: float, count_captions: float
) -> list[tuple[bytes, list[str], Scene]]:
    """(PNG bytes, captions, scene) of images [lo, hi) of ``split``: a function of the arguments alone."""
    scenes, images = make_images(seed, split, range(lo, hi), image_size)
    tone, count = (tone_captions, count_captions) if split == "train" else (0.0, 0.0)
    out = []
    for i, scene, image in zip(range(lo, hi), scenes, images, strict=True):
        rng = _child_rng(seed, split, i, 2)
        captions = write_captions(scene, rng, tone_captions=tone, count_captions=count)
        out.append((_png_bytes(image), [text for text, _ in captions], scene))
    return out


def _ordered_map(fn: Callable[..., Any], args: Sequence[tuple[Any, ...]], workers: int) -> Iterator[Any]:
    """``fn(*a)`` for each ``a`` of ``args``, in order; ``workers`` > 1 runs them in that many
    processes, at most ``2 * workers`` ahead of the consumer."""
    if workers <= 1 or len(args) < 2:
        for a in args:
            yield fn(*a)
        return

    # spawn, not fork: the parent may hold OpenMP/torch threads that a forked child would inherit
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pending: deque[AsyncResult[Any]] = deque()
        for a in args:
            pending.append(pool.apply_async(fn, a))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    # Compact but stable: sorted keys are not used so the Karpathy field order stays familiar.
    path.write_text(json.dumps(payload, separators=(",", ":")), encoding="utf-8")


@dataclass(frozen=True)
class SyntheticScenes:
    """The scene structures stored beside a synthetic dataset."""

    generator: dict[str, Any]  # scenes.json's "generator" record (see write_dataset)
    by_imgid: dict[int, Scene]

    @property
    def seed(self) -> int:
        return int(self.generator["seed"])

    @property
    def image_size(self) -> int:
        return int(self.generator["image_size"])

    @property
    def version(self) -> int:
        """The generator version that wrote the dataset (the renderer its distractors must use)."""
        return int(self.generator.get("version", 1))

    def for_imgids(self, imgids: list[int]) -> list[Scene]:
        return [self.by_imgid[i] for i in imgids]


_REGENERATE = "Regenerate the dataset with `icr data synth --out DIR --force`."


def load_scenes(directory: str | os.PathLike[str]) -> SyntheticScenes:
    """Read `scenes.json` of a dataset written by :func:`write_dataset`."""
    path = Path(directory) / SCENES_NAME
    if not path.is_file():
        raise DatasetError(
            "no scene file.", path=path, hint="Only datasets made by `icr data synth` have one."
        )
    data = parse_json(read_text(path, "scene file", _REGENERATE), path, "scene file", _REGENERATE)
    version = data.get("format_version") if isinstance(data, dict) else None
    if version != SCENES_FORMAT_VERSION:
        raise DatasetError(
            f"scene format version {version!r}, this code reads {SCENES_FORMAT_VERSION}.",
            path=path,
            hint=_REGENERATE,
        )
    try:
        by_imgid = {int(s["imgid"]): Scene.from_dict(s) for s in data["scenes"]}
    except (KeyError, TypeError, ValueError) as e:
        raise DatasetError(f"malformed scene entry ({e!r}).", path=path, hint=_REGENERATE) from e
    return SyntheticScenes(data["generator"], by_imgid)


def render_workers() -> int:
    """Processes that render generated distractors while the caller embeds them: one per core (at
    most 4), so rendering stays off the embedding's critical path. At 64 px a process renders about
    6,000 images/s with version 2 (about 1,000 with version 1)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def _render_batch(
    seed: int, image_size: int, lo: int, hi: int, version: int = GENERATOR_VERSION
) -> tuple[np.ndarray, np.ndarray, list[Scene]]:
    ids = np.arange(lo, hi, dtype=np.int64)
    scenes, images = make_images(seed, "distractor", range(lo, hi), image_size, version=version)
    return ids, images, scenes


def split_scene_table(directory: str | os.PathLike[str], split: str) -> SceneTable:
    """The scenes of a split's images, in the split's image order, as a SceneTable."""
    records = load_karpathy(Path(directory) / JSON_NAME).split(split).images
    return SceneTable.from_scenes(load_scenes(directory).for_imgids([r.imgid for r in records]))


class DistractorStream:
    """`n` further images drawn lazily from `seed`; never more than one batch in memory.

    Distractor k is the same image whatever `n` is and whichever order it is asked for in, so an
    index can store only k and re-derive the image and its scene (for relevance) on demand.
    """

    def __init__(self, n: int, *, seed: int = 0, image_size: int = 64, version: int = GENERATOR_VERSION):
        if n < 0:
            raise ValueError(f"number of distractors must be >= 0, got {n}")
        _check_version(version)
        self.n, self.seed, self.image_size, self.version = n, seed, image_size, version

    @classmethod
    def for_dataset(cls, directory: str | os.PathLike[str], n: int) -> DistractorStream:
        """Distractors matching a stored synthetic dataset's seed, image size and generator version:
        a dataset written by version 1 gets version-1 distractors (slower, but the same bytes as
        when its index was built); regenerate it to get the fast renderer."""
        scenes = load_scenes(directory)
        if scenes.version not in RENDERED_VERSIONS:
            raise DatasetError(
                f"written by generator version {scenes.version}, this code renders versions "
                f"{', '.join(map(str, RENDERED_VERSIONS))}.",
                path=Path(directory) / SCENES_NAME,
                hint=_REGENERATE,
            )
        return cls(n, seed=scenes.seed, image_size=scenes.image_size, version=scenes.version)

    def __len__(self) -> int:
        return self.n

    def _check(self, k: int) -> None:
        if not 0 <= k < self.n:
            raise IndexError(f"distractor {k} out of range [0, {self.n})")

    def scene(self, k: int) -> Scene:
        self._check(k)
        return make_scene(self.seed, "distractor", k)

    def image(self, k: int) -> np.ndarray:
        """(H, W, 3) uint8."""
        self._check(k)
        return make_image(self.seed, "distractor", k, self.image_size, version=self.version)[1]

    def __iter__(self) -> Iterator[tuple[int, Scene, np.ndarray]]:
        for k in range(self.n):
            scene, image = make_image(self.seed, "distractor", k, self.image_size, version=self.version)
            yield k, scene, image

    def batches(
        self, batch_size: int, start: int = 0, *, workers: int = 1
    ) -> Iterator[tuple[np.ndarray, np.ndarray, list[Scene]]]:
        """Yields (ids (B,) int64, images (B, H, W, 3) uint8, scenes) from distractor `start` on.

        ``workers`` > 1 renders batches in that many processes, at most ``2 * workers`` batches ahead
        of the consumer; every image is a function of (seed, index) alone, so the output is the same.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        args = [
            (self.seed, self.image_size, lo, min(lo + batch_size, self.n), self.version)
            for lo in range(start, self.n, batch_size)
        ]
        yield from _ordered_map(_render_batch, args, workers)

    def scene_table(self, start: int = 0, stop: int | None = None, chunk: int = 100_000) -> SceneTable:
        """Scene structures of distractors [start, stop) in column form (no rendering)."""
        stop = self.n if stop is None else min(stop, self.n)
        tables = [
            SceneTable.from_scenes(
                [make_scene(self.seed, "distractor", k) for k in range(lo, min(lo + chunk, stop))]
            )
            for lo in range(start, stop, chunk)
        ]
        return SceneTable.concat(tables) if tables else SceneTable.from_scenes([])
