"""Hand-built scenes for relevance tests."""

from __future__ import annotations

from icr.training.data.synthetic import world
from icr.training.data.synthetic.scene import Background, Scene, SceneObject


def obj(desc: str, row: int, col: int) -> SceneObject:
    """obj("large red circle", 0, 2): an object in the top right cell."""
    size, colour, shape = desc.split()
    return SceneObject(
        shape=shape,
        colour=colour,
        size=size,
        row=row,
        col=col,
        x=(col + 0.5) / world.GRID,
        y=(row + 0.5) / world.GRID,
        rotation=0.0,
        rgb=world.COLOURS[colour],
    )


def scene(*objects: SceneObject, tone: str = "light") -> Scene:
    rgb = (220, 220, 220) if tone == "light" else (40, 40, 40)
    return Scene(Background(tone, "plain", rgb, rgb, 0.1, 0.0, 4.0), tuple(objects))
