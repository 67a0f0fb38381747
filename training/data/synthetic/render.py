"""Draws scenes as RGB images, a batch at once: textured background, anti-aliased shapes, pixel noise.

This is the renderer of generator version 2 (version 1, PIL at 4x then box-filtered, is kept as
:mod:`render_v1`). Every step is numpy over a whole batch, and every value is computed per pixel from
that image's scene and noise bits alone, so an image is the same bytes whatever batch it is drawn in.

* Background: the same textures and formulas as version 1 (gradient, stripes, checker; hard edges).
* Shapes: each object is evaluated in a small window around it, not over the whole image. A shape is
  a union of convex pieces, a piece an intersection of half-planes. Its signed distance ``d`` in
  pixels (max over a piece's edges, min over pieces; ``|p - c| - r`` for a circle) gives the
  anti-aliased coverage ``clip(0.5 + 0.075 - d, 0, 1)`` of the pixel: the box-filtered coverage of
  a straight edge, shapes grown by 0.075 px to keep version 1's areas (see ``_GROW``). Objects are
  composited over the background in scene order, as version 1 drew them.
* Noise: Gaussian with the scene's standard deviation, drawn as 16 random bits per channel value
  mapped through the standard normal quantile function (65,536 equiprobable levels, tails cut at
  about 4.3 sigma) instead of ``rng.normal``, which alone cost more than all the rest.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence

import numpy as np

from icr.training.data.synthetic import world
from icr.training.data.synthetic.scene import Scene, SceneObject

# Images rendered together: bounds the float32 working set (about 6 MB at 64 px) at any image size;
# 64 to 128 images at 64 px was fastest on a 2-core machine.
_PIXELS_PER_CHUNK = 1 << 19


def _half_planes(vertices: Sequence[tuple[float, float]]) -> list[tuple[float, float, float]]:
    """Edges of a convex polygon containing the origin as (nx, ny, c), unit normal pointing out:
    the signed distance of point p to the edge's line is ``nx * px + ny * py - c``."""
    out = []
    for (x0, y0), (x1, y1) in zip(vertices, [*vertices[1:], vertices[0]], strict=True):
        norm = math.hypot(x1 - x0, y1 - y0)
        nx, ny = (y1 - y0) / norm, (x0 - x1) / norm
        c = nx * x0 + ny * y0
        out.append((nx, ny, c) if c > 0 else (-nx, -ny, -c))  # the origin is inside: c > 0
    return out


def _ring(n: int, radius: float, start: float, dy: float = 0.0) -> list[tuple[float, float]]:
    return [
        (radius * math.cos(start + k * 2 * math.pi / n), radius * math.sin(start + k * 2 * math.pi / n) + dy)
        for k in range(n)
    ]


class _Shape:
    """A shape in unit coordinates (radius 1, y down, unrotated): its edge lines and which edges bound
    each convex piece (the shape is the union of the pieces)."""

    def __init__(
        self, pieces: Sequence[Sequence[tuple[float, float]]], vertices: Sequence[tuple[float, float]]
    ):
        lines: list[tuple[float, float, float]] = []
        self.pieces: list[list[int]] = []
        for piece in pieces:
            ids = []
            for line in _half_planes(piece):
                # Pieces share edges (the star's inner pentagon): each distinct line is computed once.
                found = next(
                    (i for i, other in enumerate(lines) if np.allclose(line, other, atol=1e-12)), None
                )
                if found is None:
                    lines.append(line)
                    found = len(lines) - 1
                ids.append(found)
            self.pieces.append(ids)
        self.lines = np.asarray(lines, np.float64)  # (E, 3)
        self.extent = max(math.hypot(x, y) for x, y in vertices)  # farthest point from the centre


def _shapes() -> dict[str, _Shape]:
    """The polygons of version 1 (`render_v1._polygon`), split into convex pieces."""
    square = [(0.85, 0.85), (-0.85, 0.85), (-0.85, -0.85), (0.85, -0.85)]
    diamond = [(0.0, -1.0), (0.68, 0.0), (0.0, 1.0), (-0.68, 0.0)]
    triangle = _ring(3, 1.1, -math.pi / 2, dy=0.15)
    hexagon = _ring(6, 1.0, 0.0)
    tips = _ring(5, 1.05, -math.pi / 2)  # star: tip j lies between inner vertices j - 1 and j
    inner = _ring(5, 0.45, -math.pi / 2 + math.pi / 5)
    # The inner pentagon plus one tip is convex (177 degrees at the inner vertices beside the tip),
    # and every such piece holds the whole pentagon, so the union has no seams inside.
    star = [[*inner[:j], tips[j], *inner[j:]] for j in range(5)]
    star_outline = [p for j in range(5) for p in (tips[j], inner[j])]
    w = 0.34
    bars: list[list[tuple[float, float]]] = [
        [(1.0, w), (-1.0, w), (-1.0, -w), (1.0, -w)],  # the cross: a horizontal and a vertical bar
        [(w, 1.0), (-w, 1.0), (-w, -1.0), (w, -1.0)],
    ]
    return {
        "square": _Shape([square], square),
        "diamond": _Shape([diamond], diamond),
        "triangle": _Shape([triangle], triangle),
        "star": _Shape(star, star_outline),
        "cross": _Shape(bars, [p for bar in bars for p in bar]),
        "hexagon": _Shape([hexagon], hexagon),
    }


SHAPES = _shapes()
# Version 1's PIL fill took in the pixels on a shape's outline at 4x, so its shapes came out fatter
# than their geometry. Growing the shapes by 0.075 px keeps their area: new / old = 1.000 on average
# over 625 objects (mean |old - new| of the noise-free images is then at its lowest, 0.15 levels).
_GROW = 0.075
_EXTENT = {"circle": 1.0, **{name: shape.extent for name, shape in SHAPES.items()}}


@functools.cache
def _noise_levels() -> np.ndarray:
    """(65536,) float32: the standard normal quantiles at (i + 0.5) / 65536, i = 0..65535."""
    normal = statistics.NormalDist()
    return np.asarray([normal.inv_cdf((i + 0.5) / 65536) for i in range(65536)], np.float32)


def noise_words(size: int) -> int:
    """How many 64-bit outputs of its generator an image's noise takes."""
    return (size * size * 3 + 3) // 4


def words_to_bits(words: np.ndarray, size: int) -> np.ndarray:
    """(B, noise_words) uint64 -> (B, size * size * 3) uint16 noise bits, each word cut into four
    16-bit values from its least significant end (the same on any byte order)."""
    words = np.asarray(words, "<u8")
    return words.view("<u2")[:, : size * size * 3]


def noise_bits(rng: np.random.Generator, size: int) -> np.ndarray:
    """(size * size * 3,) uint16: the bits the pixel noise of one image is drawn from, the next
    ceil(size * size * 3 / 4) 64-bit outputs of ``rng``'s bit generator, cut into 16-bit words from
    the least significant end."""
    bits: np.ndarray = words_to_bits(rng.bit_generator.random_raw(noise_words(size))[None], size)[0]
    return bits


def _window(shape: str, radius: float, size: int) -> tuple[int, int]:
    """(half, width) of the square window holding every pixel that ``shape`` at ``radius`` pixels can
    touch: its farthest vertex, plus the 0.575 px anti-aliasing band, which the max over half-planes
    mitres at corners to up to 1.6 px at the sharpest tip (the star's, 42 degrees), rounded up. The
    window starts ``half`` pixels left of (above) the centre's pixel, moved inside the image where
    it would stick out."""
    half = math.ceil(_EXTENT[shape] * radius + 2.0)
    return half, min(2 * half + 1, size)


def _parity(q: np.ndarray) -> np.ndarray:
    """``q % 2`` of integer-valued floats, exactly, without numpy's slow float remainder."""
    parity: np.ndarray = q - 2 * np.floor(q * np.float32(0.5))
    return parity


def _background(scenes: Sequence[Scene], size: int, out: np.ndarray) -> None:
    """Writes the (B, 3, size, size) float32 backgrounds into ``out``: the textures of version 1,
    ``rgb + (rgb2 - rgb) * w`` with w in [0, 1] (0 or 1 for stripes and checker)."""
    grid = np.arange(size, dtype=np.float32) / np.float32(size)
    xs, ys = grid[None, None, :], grid[None, :, None]  # (1, 1, S) and (1, S, 1)
    bgs = [s.background for s in scenes]
    unknown = {bg.texture for bg in bgs} - set(world.BACKGROUND_TEXTURES)
    if unknown:
        raise ValueError(
            f"unknown background texture {unknown.pop()!r}; expected {world.BACKGROUND_TEXTURES}"
        )
    w = np.zeros((len(scenes), size, size), np.float32)  # plain: 0
    for texture in ("gradient", "stripes", "checker"):
        rows = [i for i, bg in enumerate(bgs) if bg.texture == texture]
        if not rows:
            continue
        group = [bgs[i] for i in rows]
        period = np.asarray([bg.period for bg in group], np.float32)[:, None, None]  # (G, 1, 1)
        if texture == "checker":  # the parities of the column and row bands differ
            w[rows] = _parity(np.floor(xs / period)) != _parity(np.floor(ys / period))
            continue
        a = [math.radians(bg.angle) for bg in group]
        cos = np.asarray([math.cos(t) for t in a], np.float32)[:, None, None]
        sin = np.asarray([math.sin(t) for t in a], np.float32)[:, None, None]
        along = xs * cos + ys * sin  # (G, S, S): the coordinate along the texture direction
        if texture == "gradient":
            lo = along.min(axis=(1, 2), keepdims=True)
            span = np.maximum(along.max(axis=(1, 2), keepdims=True) - lo, np.float32(1e-6))
            w[rows] = (along - lo) / span
        else:
            w[rows] = _parity(np.floor(along / period))
    c1 = np.asarray([bg.rgb for bg in bgs], np.float32)[:, :, None, None]  # (B, 3, 1, 1)
    c2 = np.asarray([bg.rgb2 for bg in bgs], np.float32)[:, :, None, None]
    np.multiply(c2 - c1, w[:, None], out=out)
    out += c1


def _coverage(
    shape: str,
    cx: np.ndarray,
    cy: np.ndarray,
    r: np.ndarray,
    rot: np.ndarray,
    x0: np.ndarray,
    y0: np.ndarray,
    width: int,
) -> np.ndarray:
    """(N, width, width) float32 coverage of N objects of one shape in their windows, whose top-left
    pixels are (x0, y0). cx, cy, r in pixels, rot in radians (float64, (N,))."""
    offsets = np.arange(width, dtype=np.float64) + 0.5  # pixel centres
    dx = (x0[:, None] + offsets - cx[:, None]).astype(np.float32)[:, None, :]  # (N, 1, W)
    dy = (y0[:, None] + offsets - cy[:, None]).astype(np.float32)[:, :, None]  # (N, W, 1)
    if shape == "circle":
        d = np.sqrt(dx * dx + dy * dy) - r.astype(np.float32)[:, None, None]
    else:
        spec = SHAPES.get(shape)
        if spec is None:
            raise ValueError(f"unknown shape {shape!r}; expected one of {world.SHAPES}")
        # math, not numpy: numpy's vectorised cos may round differently from its scalar tail, and an
        # image must not depend on how many objects share its batch.
        ca = np.asarray([math.cos(t) for t in rot.tolist()])[:, None]  # (N, 1)
        sa = np.asarray([math.sin(t) for t in rot.tolist()])[:, None]
        nx, ny, c = spec.lines[:, 0], spec.lines[:, 1], spec.lines[:, 2]  # (E,)
        # The edge normals rotated with the object, so the pixel offsets need no rotation.
        rx = (nx * ca - ny * sa).astype(np.float32)  # (N, E)
        ry = (nx * sa + ny * ca).astype(np.float32)
        cr = (c * r[:, None]).astype(np.float32)
        lines = [
            dx * rx[:, e, None, None] + (dy * ry[:, e, None, None] - cr[:, e, None, None])
            for e in range(len(c))
        ]
        d = None
        for piece in spec.pieces:
            inside = functools.reduce(np.maximum, (lines[e] for e in piece))
            d = inside if d is None else np.minimum(d, inside)
        assert d is not None
    coverage: np.ndarray = np.clip(np.float32(0.5 + _GROW) - d, 0, 1)
    return coverage


def render_batch(scenes: Sequence[Scene], size: int, bits: np.ndarray) -> np.ndarray:
    """(B, size, size, 3) uint8 images of ``scenes``; ``bits`` (B, size * size * 3) uint16 holds each
    image's noise bits (:func:`noise_bits`, channel-major: all red values, then green, then blue).
    Image i depends on ``scenes[i]`` and ``bits[i]`` only."""
    bits = np.asarray(bits)
    if bits.shape != (len(scenes), size * size * 3):
        raise ValueError(f"bits must have shape {(len(scenes), size * size * 3)}, got {bits.shape}")
    step = max(1, _PIXELS_PER_CHUNK // (size * size))
    out = np.empty((len(scenes), size, size, 3), np.uint8)
    for lo in range(0, len(scenes), step):
        planes = _render_chunk(scenes[lo : lo + step], size, bits[lo : lo + step])  # (b, 3, S, S)
        for c in range(3):  # a plane at a time: far cheaper than one transposing copy
            out[lo : lo + step, :, :, c] = planes[:, c]
    return out


def _render_chunk(scenes: Sequence[Scene], size: int, bits: np.ndarray) -> np.ndarray:
    # Channels first: every numpy loop then runs along image rows, not along 3 channels.
    canvas = np.empty((len(scenes), 3, size, size), np.float32)
    _background(scenes, size, canvas)
    cell = size / world.GRID
    groups: dict[tuple[str, str], list[tuple[int, int, SceneObject]]] = {}
    for i, scene in enumerate(scenes):
        for k, o in enumerate(scene.objects):
            groups.setdefault((o.shape, o.size), []).append((i, k, o))
    # Coverage of every object in its window, a (shape, size) group at a time.
    layers = []
    for (shape, size_name), members in groups.items():
        r = world.SIZE_RADIUS[size_name] * cell
        half, width = _window(shape, r, size)
        cx = np.asarray([o.x * size for _, _, o in members])
        cy = np.asarray([o.y * size for _, _, o in members])
        x0 = np.clip(np.floor(cx).astype(np.int64) - half, 0, size - width)
        y0 = np.clip(np.floor(cy).astype(np.int64) - half, 0, size - width)
        rot = np.asarray([math.radians(o.rotation) for _, _, o in members])
        alpha = _coverage(shape, cx, cy, np.full(len(members), r), rot, x0, y0, width)
        offsets = np.arange(width)
        image = np.asarray([i for i, _, _ in members], np.int64)
        corner = (image * (3 * size * size) + y0 * size + x0)[:, None, None, None]
        # Flat canvas index of every window value: (N, 3, W, W).
        index = corner + (np.arange(3) * (size * size))[:, None, None] + offsets[:, None] * size + offsets
        rgb = np.asarray([o.rgb for _, _, o in members], np.float32)[:, :, None, None]  # (N, 3, 1, 1)
        slot = np.asarray([k for _, k, _ in members])
        layers.append((slot, index, alpha[:, None], rgb))
    # Objects are composited in scene order; an image has one object per slot, so the windows
    # composited together (one slot, one group) never overlap.
    flat = canvas.reshape(-1)
    for k in range(max((len(s.objects) for s in scenes), default=0)):
        for slot, index, alpha, rgb in layers:
            sel = np.flatnonzero(slot == k)
            if not len(sel):
                continue
            idx = index[sel]
            pixels = flat[idx]  # (n, 3, W, W)
            pixels += (rgb[sel] - pixels) * alpha[sel]
            flat[idx] = pixels
    noise = np.take(_noise_levels(), bits)  # (B, 3 * S * S) standard normal
    noise *= np.asarray([s.background.noise for s in scenes], np.float32)[:, None]
    canvas += noise.reshape(canvas.shape)
    np.rint(canvas, out=canvas)
    np.clip(canvas, 0, 255, out=canvas)
    return canvas.astype(np.uint8)


def render(scene: Scene, size: int, rng: np.random.Generator) -> np.ndarray:
    """(size, size, 3) uint8 image of ``scene``; ``rng`` gives only the noise bits (:func:`noise_bits`)."""
    image: np.ndarray = render_batch([scene], size, noise_bits(rng, size)[None])[0]
    return image
