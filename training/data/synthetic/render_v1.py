"""The renderer of generator version 1, kept so that a dataset written by version 1 still renders its
distractors byte-identically (an index built on it stores only distractor ids and re-derives the
images). New datasets use :mod:`render` (version 2): the same scenes, drawn with about 6x less CPU.

Draws a scene as an RGB image: textured background, anti-aliased shapes (PIL at 4x, box-filtered
down), pixel noise from ``rng.normal``. Do not change: its output is pinned by a test."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

from icr.training.data.synthetic import world
from icr.training.data.synthetic.scene import Background, Scene, SceneObject

SUPERSAMPLE = 4  # shapes are drawn 4x larger and box-filtered down: smooth edges at 64 px


def _background(bg: Background, size: int) -> np.ndarray:
    """(size, size, 3) float32 background."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32) / size  # (S, S) each, in [0, 1)
    a = math.radians(bg.angle)
    along = xs * math.cos(a) + ys * math.sin(a)  # (S, S) coordinate along the texture direction
    c1 = np.asarray(bg.rgb, np.float32)
    c2 = np.asarray(bg.rgb2, np.float32)
    if bg.texture == "plain":
        w = np.zeros_like(xs)
    elif bg.texture == "gradient":
        w = (along - along.min()) / max(float(np.ptp(along)), 1e-6)
    elif bg.texture == "stripes":
        w = (np.floor(along / bg.period) % 2).astype(np.float32)
    elif bg.texture == "checker":
        w = ((np.floor(xs / bg.period) + np.floor(ys / bg.period)) % 2).astype(np.float32)
    else:
        raise ValueError(f"unknown background texture {bg.texture!r}; expected {world.BACKGROUND_TEXTURES}")
    background: np.ndarray = c1 * (1 - w[..., None]) + c2 * w[..., None]
    return background


def _polygon(o: SceneObject, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """Vertices of the shape in pixel coordinates (rotation applied)."""
    if o.shape == "square":
        pts = [(math.cos(t), math.sin(t)) for t in (math.pi / 4 + k * math.pi / 2 for k in range(4))]
        pts = [(x * 0.85 * math.sqrt(2), y * 0.85 * math.sqrt(2)) for x, y in pts]
    elif o.shape == "diamond":  # taller than wide, so it is not just a rotated square
        pts = [(0.0, -1.0), (0.68, 0.0), (0.0, 1.0), (-0.68, 0.0)]
    elif o.shape == "triangle":
        pts = [(math.cos(t), math.sin(t)) for t in (-math.pi / 2 + k * 2 * math.pi / 3 for k in range(3))]
        pts = [(x * 1.1, y * 1.1 + 0.15) for x, y in pts]
    elif o.shape == "star":
        pts = []
        for k in range(10):
            t = -math.pi / 2 + k * math.pi / 5
            rad = 1.05 if k % 2 == 0 else 0.45
            pts.append((rad * math.cos(t), rad * math.sin(t)))
    elif o.shape == "cross":
        w = 0.34
        pts = [
            (-w, -1),
            (w, -1),
            (w, -w),
            (1, -w),
            (1, w),
            (w, w),
            (w, 1),
            (-w, 1),
            (-w, w),
            (-1, w),
            (-1, -w),
            (-w, -w),
        ]
    elif o.shape == "hexagon":
        pts = [(math.cos(t), math.sin(t)) for t in (k * math.pi / 3 for k in range(6))]
    else:
        raise ValueError(f"unknown shape {o.shape!r}; expected one of {world.SHAPES}")
    a = math.radians(o.rotation)
    ca, sa = math.cos(a), math.sin(a)
    return [(cx + r * (x * ca - y * sa), cy + r * (x * sa + y * ca)) for x, y in pts]


def render_v1(scene: Scene, size: int, rng: np.random.Generator) -> np.ndarray:
    """(size, size, 3) uint8 image of `scene`; `rng` draws only the pixel noise."""
    big = size * SUPERSAMPLE
    cell = big / world.GRID
    # Objects are drawn on a transparent layer and composited, so edges blend with the texture.
    layer = Image.new("RGBA", (big, big), (0, 0, 0, 0))
    draw = ImageDraw.Draw(layer)
    for o in scene.objects:
        cx, cy, r = o.x * big, o.y * big, world.SIZE_RADIUS[o.size] * cell
        fill = (*o.rgb, 255)
        if o.shape == "circle":
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        else:
            draw.polygon(_polygon(o, cx, cy, r), fill=fill)
    small = np.asarray(layer.resize((size, size), Image.Resampling.BOX), dtype=np.float32)  # (S, S, 4)
    alpha = small[..., 3:4] / 255.0
    # RGB of the box-filtered layer is premultiplied by coverage only where alpha > 0.
    rgb = np.where(alpha > 0, small[..., :3], 0.0)
    image = _background(scene.background, size) * (1 - alpha) + rgb * alpha
    image += rng.normal(0.0, scene.background.noise, size=image.shape).astype(np.float32)
    pixels: np.ndarray = np.clip(np.rint(image), 0, 255).astype(np.uint8)
    return pixels
