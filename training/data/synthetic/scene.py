"""Scene structures: what the generator draws, stored beside the dataset, and what relevance is
decided from. Geometry is relative ([0, 1] image coordinates) so a scene renders at any size."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from icr.training.data.synthetic import world

# Probability of 1, 2, 3 objects: most images hold several, so captions naming one object match
# many images (the false negatives of COCO-style evaluation).
OBJECT_COUNT_P = (0.25, 0.40, 0.35)


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    size: str
    row: int  # grid cell, 0 = top
    col: int  # grid cell, 0 = left
    x: float  # centre, relative to image width
    y: float  # centre, relative to image height
    rotation: float  # degrees
    rgb: tuple[int, int, int]  # the drawn colour (the named colour, slightly jittered)


@dataclass(frozen=True)
class Background:
    tone: str  # light | dark
    texture: str  # plain | gradient | stripes | checker
    rgb: tuple[int, int, int]
    rgb2: tuple[int, int, int]  # second colour of the texture
    period: float  # stripe/checker period, relative to the image size
    angle: float  # gradient/stripe direction in degrees
    noise: float  # std of the additive pixel noise, in 0..255 units


_OBJECT_FIELDS = tuple(f.name for f in fields(SceneObject))
_BACKGROUND_FIELDS = tuple(f.name for f in fields(Background))


@dataclass(frozen=True)
class Scene:
    background: Background
    objects: tuple[SceneObject, ...]

    def to_dict(self) -> dict[str, Any]:
        # what dataclasses.asdict gives (the fields are flat), without its recursive deep copy: the
        # index build writes a million of these (15 s per 100,000 through asdict)
        return {
            "background": {f: getattr(self.background, f) for f in _BACKGROUND_FIELDS},
            "objects": [{f: getattr(o, f) for f in _OBJECT_FIELDS} for o in self.objects],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scene:
        bg = dict(d["background"])
        bg["rgb"], bg["rgb2"] = tuple(bg["rgb"]), tuple(bg["rgb2"])
        objects = tuple(SceneObject(**{**o, "rgb": tuple(o["rgb"])}) for o in d["objects"])
        return cls(Background(**bg), objects)


def _clip8(v: float) -> int:
    return 0 if v < 0 else 255 if v > 255 else int(v)


def _index(u: float, n: int) -> int:
    """A uniform draw in [0, 1) as an index in range(n)."""
    return min(int(u * n), n - 1)


# Uniforms one scene consumes: background 10, object count 1, cell order 9, per object 9.
_DRAWS = 10 + 1 + world.GRID * world.GRID + 9 * 3


def sample_scene(rng: np.random.Generator) -> Scene:
    """Draw one scene. Uses only `rng`, so a (seed, split, index) triple fixes the scene.

    All randomness comes from one vector of uniforms: a million distractor scenes (for relevance
    over a distractor gallery) must be cheap to re-derive, and per-call overhead of the generator
    would dominate.
    """
    u = rng.random(_DRAWS).tolist()
    tone = world.BACKGROUND_TONES[_index(u[0], 2)]
    base = 185 + _index(u[1], 51) if tone == "light" else 25 + _index(u[1], 50)
    # Greys with a slight warm/cool tint: never close to a saturated object colour.
    rgb = tuple(_clip8(base - 12 + _index(t, 25)) for t in u[2:5])
    delta = (12 + _index(u[5], 23)) * (-1 if tone == "light" else 1)
    background = Background(
        tone=tone,
        texture=world.BACKGROUND_TEXTURES[_index(u[6], len(world.BACKGROUND_TEXTURES))],
        rgb=rgb,  # type: ignore[arg-type]
        rgb2=tuple(_clip8(c + delta) for c in rgb),  # type: ignore[arg-type]
        period=round(0.08 + 0.17 * u[7], 5),
        angle=round(180.0 * u[8], 3),
        noise=round(2.0 + 10.0 * u[9], 3),
    )
    c = u[10]
    n = 1 if c < OBJECT_COUNT_P[0] else 2 if c < OBJECT_COUNT_P[0] + OBJECT_COUNT_P[1] else 3
    cell_keys = u[11:20]
    cells = sorted(range(world.GRID * world.GRID), key=cell_keys.__getitem__)[:n]  # n distinct cells
    objects = []
    for k, cell in enumerate(cells):
        v = u[20 + 9 * k : 29 + 9 * k]
        row, col = divmod(cell, world.GRID)
        colour = world.COLOUR_NAMES[_index(v[1], len(world.COLOUR_NAMES))]
        # Jitter stays well inside the cell, so the grid order of centres is the visual order.
        jx, jy = 0.16 * v[3] - 0.08, 0.16 * v[4] - 0.08
        objects.append(
            SceneObject(
                shape=world.SHAPES[_index(v[0], len(world.SHAPES))],
                colour=colour,
                size=world.SIZES[_index(v[2], len(world.SIZES))],
                row=row,
                col=col,
                x=round((col + 0.5 + jx) / world.GRID, 5),
                y=round((row + 0.5 + jy) / world.GRID, 5),
                rotation=round(24.0 * v[5] - 12.0, 3),
                rgb=tuple(
                    _clip8(ch - 14 + _index(t, 29))
                    for ch, t in zip(world.COLOURS[colour], v[6:9], strict=True)
                ),  # type: ignore[arg-type]
            )
        )
    return Scene(background, tuple(objects))


MAX_OBJECTS = world.GRID * world.GRID


@dataclass
class SceneTable:
    """Column form of many scenes, for deciding relevance over millions of images with numpy.

    Object attributes are stored as category indices in (M, K) arrays padded with -1, where K is
    the largest object count among the scenes.
    """

    shape: np.ndarray  # (M, K) int8
    colour: np.ndarray  # (M, K) int8
    size: np.ndarray  # (M, K) int8
    row: np.ndarray  # (M, K) int8
    col: np.ndarray  # (M, K) int8
    count: np.ndarray  # (M,) int8
    tone: np.ndarray  # (M,) int8

    def __len__(self) -> int:
        return int(self.count.shape[0])

    @classmethod
    def from_scenes(cls, scenes: list[Scene] | tuple[Scene, ...]) -> SceneTable:
        m = len(scenes)
        k = max((len(s.objects) for s in scenes), default=0)
        cols = {
            name: np.full((m, k), -1, dtype=np.int8) for name in ("shape", "colour", "size", "row", "col")
        }
        lookup = {
            "shape": {v: i for i, v in enumerate(world.SHAPES)},
            "colour": {v: i for i, v in enumerate(world.COLOUR_NAMES)},
            "size": {v: i for i, v in enumerate(world.SIZES)},
        }
        count = np.zeros(m, dtype=np.int8)
        tone = np.zeros(m, dtype=np.int8)
        for i, s in enumerate(scenes):
            count[i] = len(s.objects)
            tone[i] = world.BACKGROUND_TONES.index(s.background.tone)
            for j, o in enumerate(s.objects):
                cols["shape"][i, j] = lookup["shape"][o.shape]
                cols["colour"][i, j] = lookup["colour"][o.colour]
                cols["size"][i, j] = lookup["size"][o.size]
                cols["row"][i, j] = o.row
                cols["col"][i, j] = o.col
        return cls(count=count, tone=tone, **cols)

    def take(self, rows: np.ndarray) -> SceneTable:
        """The scenes at ``rows`` (in that order, repeats allowed)."""
        rows = np.asarray(rows)
        return SceneTable(
            **{n: getattr(self, n)[rows] for n in ("shape", "colour", "size", "row", "col", "count", "tone")}
        )

    @classmethod
    def concat(cls, tables: list[SceneTable]) -> SceneTable:
        k = max((t.shape.shape[1] for t in tables), default=0)

        def pad(a: np.ndarray) -> np.ndarray:
            return np.pad(a, ((0, 0), (0, k - a.shape[1])), constant_values=-1)

        return cls(
            **{
                n: np.concatenate([pad(getattr(t, n)) for t in tables])
                for n in ("shape", "colour", "size", "row", "col")
            },
            count=np.concatenate([t.count for t in tables]),
            tone=np.concatenate([t.tone for t in tables]),
        )
