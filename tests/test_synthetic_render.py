"""The batch renderer of generator version 2: a per-pixel oracle, version 1's geometry, purity in
(seed, index), and version-1 datasets still rendering byte for byte as before."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from icr.training.data.errors import DatasetError
from icr.training.data.synthetic import render, render_v1, world
from icr.training.data.synthetic.generate import (
    GENERATOR_VERSION,
    DistractorStream,
    load_scenes,
    make_image,
    make_images,
    make_scene,
    write_dataset,
)
from icr.training.data.synthetic.scene import Background, Scene, SceneObject

# --- the oracle: one image, one object at a time, over the whole frame, in float64 ----------------


def _convex_pieces(o: SceneObject, cx: float, cy: float, r: float) -> list[list[tuple[float, float]]]:
    """Version 1's polygon (rotated, in pixels) as convex pieces whose union it is."""
    pts = render_v1._polygon(o, cx, cy, r)
    if o.shape == "star":  # tip, inner, tip, ...: each tip with the whole inner pentagon is convex
        inner = pts[1::2]
        return [[*inner[:j], pts[2 * j], *inner[j:]] for j in range(5)]
    if o.shape == "cross":  # a vertical and a horizontal bar
        return [[pts[0], pts[1], pts[6], pts[7]], [pts[10], pts[3], pts[4], pts[9]]]
    return [pts]


def _piece_distance(piece: list[tuple[float, float]], px: np.ndarray, py: np.ndarray) -> np.ndarray:
    """Max over the edges of the signed distance to the edge's line (positive outside)."""
    mx = sum(x for x, _ in piece) / len(piece)
    my = sum(y for _, y in piece) / len(piece)
    d = np.full(px.shape, -np.inf)
    for (x0, y0), (x1, y1) in zip(piece, piece[1:] + piece[:1], strict=True):
        nx, ny = y1 - y0, x0 - x1
        norm = math.hypot(nx, ny)
        nx, ny = nx / norm, ny / norm
        if nx * (mx - x0) + ny * (my - y0) > 0:  # point the normal away from the inside
            nx, ny = -nx, -ny
        d = np.maximum(d, nx * (px - x0) + ny * (py - y0))
    return d


def _oracle(scene: Scene, size: int, bits: np.ndarray) -> np.ndarray:
    ys, xs = np.mgrid[0:size, 0:size] + 0.5  # pixel centres
    image = render_v1._background(scene.background, size).astype(np.float64)  # the v1 textures
    cell = size / world.GRID
    for o in scene.objects:
        cx, cy, r = o.x * size, o.y * size, world.SIZE_RADIUS[o.size] * cell
        if o.shape == "circle":
            d = np.hypot(xs - cx, ys - cy) - r
        else:
            d = np.min([_piece_distance(p, xs, ys) for p in _convex_pieces(o, cx, cy, r)], axis=0)
        alpha = np.clip(0.5 + render._GROW - d, 0, 1)[..., None]
        image += (np.asarray(o.rgb, np.float64) - image) * alpha
    normal = statistics.NormalDist()
    z = np.asarray([normal.inv_cdf((b + 0.5) / 65536) for b in bits.tolist()])
    image += z.reshape(3, size, size).transpose(1, 2, 0) * scene.background.noise  # channel-major bits
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def _edge_scenes() -> list[Scene]:
    """Large objects pushed into the corner and edge cells at full jitter and rotation: their windows
    are clipped at the image border."""
    bg = Background("light", "stripes", (200, 198, 190), (180, 178, 170), 0.1, 33.0, 4.0)
    out = []
    for i, shape in enumerate(world.SHAPES):
        objects = []
        for k, (row, col, jx, jy) in enumerate(
            [(0, 0, -0.08, -0.08), (2, 2, 0.08, 0.08), (0, 2, 0.08, -0.08)]
        ):
            colour = world.COLOUR_NAMES[(i + k) % len(world.COLOUR_NAMES)]
            objects.append(
                SceneObject(
                    shape=shape,
                    colour=colour,
                    size="large",
                    row=row,
                    col=col,
                    x=(col + 0.5 + jx) / world.GRID,
                    y=(row + 0.5 + jy) / world.GRID,
                    rotation=12.0 if k % 2 else -12.0,
                    rgb=world.COLOURS[colour],
                )
            )
        out.append(Scene(bg, tuple(objects)))
    return out


@pytest.mark.parametrize("size", [24, 64])
def test_batch_renderer_matches_the_per_pixel_oracle(size: int) -> None:
    scenes = [make_scene(11, "distractor", k) for k in range(40)] + _edge_scenes()
    bits = np.random.default_rng(size).integers(0, 65536, (len(scenes), size * size * 3)).astype(np.uint16)
    got = render.render_batch(scenes, size, bits)
    assert got.shape == (len(scenes), size, size, 3) and got.dtype == np.uint8
    want = np.stack([_oracle(s, size, b) for s, b in zip(scenes, bits, strict=True)])
    diff = np.abs(got.astype(int) - want.astype(int))
    # float32 against float64: a value that lands on .5 may round the other way, nothing more
    assert diff.max() <= 1
    assert (diff > 0).mean() < 1e-3


def test_shapes_keep_version_1_geometry() -> None:
    """Against version 1's own PIL drawing (4x, box-filtered): the same masks and areas."""
    size, big = 64, 64 * render_v1.SUPERSAMPLE
    ious, areas, seen = [], [], set()
    for k in range(120):
        for o in make_scene(5, "distractor", k).objects:
            layer = Image.new("L", (big, big), 0)
            cx, cy, r = o.x * big, o.y * big, world.SIZE_RADIUS[o.size] * big / world.GRID
            if o.shape == "circle":
                ImageDraw.Draw(layer).ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
            else:
                ImageDraw.Draw(layer).polygon(render_v1._polygon(o, cx, cy, r), fill=255)
            old = np.asarray(layer.resize((size, size), Image.Resampling.BOX), np.float32) / 255
            new = render._coverage(
                o.shape,
                np.array([o.x * size]),
                np.array([o.y * size]),
                np.array([r / render_v1.SUPERSAMPLE]),
                np.array([math.radians(o.rotation)]),
                np.array([0]),
                np.array([0]),
                size,
            )[0]
            a, b = old >= 0.5, new >= 0.5
            ious.append((a & b).sum() / (a | b).sum())
            areas.append(new.sum() / old.sum())
            seen.add(o.shape)
    assert seen == set(world.SHAPES)
    assert np.mean(ious) > 0.95 and min(ious) > 0.7
    assert 0.98 < np.mean(areas) < 1.02 and 0.9 < min(areas) and max(areas) < 1.1


def test_noise_has_the_scene_standard_deviation() -> None:
    bg = Background("light", "plain", (128, 128, 128), (128, 128, 128), 0.1, 0.0, 9.0)
    rng = np.random.default_rng(3)
    bits = np.stack([render.noise_bits(rng, 64) for _ in range(4)])
    images = render.render_batch([Scene(bg, ())] * 4, 64, bits).astype(np.float64) - 128
    assert abs(images.mean()) < 0.1 and abs(images.std() - 9.0) < 0.1


# --- purity: (seed, index) -> bytes -----------------------------------------------------------------


def test_an_image_depends_on_seed_and_index_only() -> None:
    stream = DistractorStream(70, seed=9, image_size=32)
    reference = np.concatenate([images for _, images, _ in stream.batches(70)])
    for batch_size, start, workers in [(1, 0, 1), (7, 0, 1), (64, 0, 1), (9, 5, 2), (25, 3, 2)]:
        parts = list(stream.batches(batch_size, start=start, workers=workers))
        assert np.array_equal(np.concatenate([ids for ids, _, _ in parts]), np.arange(start, 70))
        assert np.array_equal(np.concatenate([images for _, images, _ in parts]), reference[start:])
    for k in (0, 13, 69):
        assert np.array_equal(stream.image(k), reference[k])
        assert np.array_equal(make_image(9, "distractor", k, 32)[1], reference[k])
    scenes, images = make_images(9, "distractor", [69, 0, 13], 32)  # any order
    assert np.array_equal(images, reference[[69, 0, 13]])
    assert scenes == [stream.scene(k) for k in (69, 0, 13)]


# Pinned bytes. If one of these changes, what a seed produces changed: bump GENERATOR_VERSION (and
# keep the old renderer for old datasets) rather than update the hash.
V1_DISTRACTORS = "9f0e1192bb5cca4a439718653062ff43f626d5a8e3dc5752e44ef05e57cfab0b"  # seed 3, 40 x 32 px
V1_TRAIN = "baae574c6c7cf22a91f5ba09f9bfcb244557da95e3ce07fdda8ce2a954dd88ae"  # seed 7, train 0..9, 64 px
V2_DISTRACTORS = "c6d0e852f4566c78b7d0e44b80c74bb9e9cfffeb559f7e2013ac5f17d06d773c"  # seed 3, 40 x 32 px


def _distractor_digest(stream: DistractorStream) -> str:
    h = hashlib.sha256()
    for _, images, _ in stream.batches(16):
        h.update(images.tobytes())
    return h.hexdigest()


def test_rendered_bytes_are_pinned_per_version() -> None:
    assert GENERATOR_VERSION == 2
    assert _distractor_digest(DistractorStream(40, seed=3, image_size=32)) == V2_DISTRACTORS
    assert _distractor_digest(DistractorStream(40, seed=3, image_size=32, version=1)) == V1_DISTRACTORS
    h = hashlib.sha256()
    for i in range(10):
        h.update(make_image(7, "train", i, 64, version=1)[1].tobytes())
    assert h.hexdigest() == V1_TRAIN


def _set_version(folder: Path, version: int) -> None:
    path = folder / "scenes.json"
    data = json.loads(path.read_text())
    data["generator"]["version"] = version
    path.write_text(json.dumps(data))


def test_a_version_1_dataset_keeps_its_distractors_and_others_are_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_dataset(data, train=2, val=1, test=1, image_size=32, seed=3)
    assert load_scenes(data).version == GENERATOR_VERSION == 2
    assert DistractorStream.for_dataset(data, 40).version == 2
    _set_version(data, 1)  # a dataset written before the vectorised renderer
    stream = DistractorStream.for_dataset(data, 40)
    assert stream.version == 1
    assert _distractor_digest(stream) == V1_DISTRACTORS
    assert np.array_equal(stream.image(7), make_image(3, "distractor", 7, 32, version=1)[1])
    _set_version(data, 99)
    with pytest.raises(DatasetError, match=r"version 99.*--force"):
        DistractorStream.for_dataset(data, 40)
    with pytest.raises(ValueError, match="generator version 99"):
        DistractorStream(4, version=99)
