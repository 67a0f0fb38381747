"""The closed world of the synthetic scenes: attributes, their words, and the position grid.

Everything the caption generator may say and the caption parser must understand is defined here,
once, so the two cannot drift apart.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "star", "cross", "hexagon")

# Saturated colours, all far from the grey/beige backgrounds so every object stays visible.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (214, 39, 40),
    "green": (44, 160, 44),
    "blue": (31, 90, 220),
    "yellow": (240, 210, 30),
    "purple": (140, 60, 190),
    "orange": (250, 130, 20),
    "pink": (247, 120, 200),
    "cyan": (30, 200, 215),
}
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)

SIZES: tuple[str, ...] = ("small", "large")
# Object radius as a fraction of a grid cell.
SIZE_RADIUS: dict[str, float] = {"small": 0.24, "large": 0.42}

GRID = 3  # 3 x 3 cells; an object occupies one cell, no two objects share one
ROW_NAMES: tuple[str, ...] = ("top", "middle", "bottom")
COL_NAMES: tuple[str, ...] = ("left", "center", "right")

BACKGROUND_TONES: tuple[str, ...] = ("light", "dark")
BACKGROUND_TEXTURES: tuple[str, ...] = ("plain", "gradient", "stripes", "checker")

# What each relation means, once, for both relevance implementations and the caption writer:
# a relation holds when the grid coordinate of the first object compares so to the second's.
# operator.lt/gt work on ints (one scene) and elementwise on numpy arrays (many scenes).
RELATION_TESTS: dict[str, tuple[str, Callable[[Any, Any], Any]]] = {
    "left_of": ("col", operator.lt),
    "right_of": ("col", operator.gt),
    "above": ("row", operator.lt),
    "below": ("row", operator.gt),
}
RELATIONS: tuple[str, ...] = tuple(RELATION_TESTS)

# --- words ---------------------------------------------------------------------------------------
# Surface forms used by the caption generator; the parser accepts every one of them.
SHAPE_WORDS: dict[str, tuple[str, ...]] = {
    "circle": ("circle", "disc"),
    "square": ("square", "box"),
    "triangle": ("triangle",),
    "diamond": ("diamond", "rhombus"),
    "star": ("star",),
    "cross": ("cross", "plus sign"),
    "hexagon": ("hexagon",),
}
COLOUR_WORDS: dict[str, tuple[str, ...]] = {
    "red": ("red",),
    "green": ("green",),
    "blue": ("blue",),
    "yellow": ("yellow",),
    "purple": ("purple", "violet"),
    "orange": ("orange",),
    "pink": ("pink",),
    "cyan": ("cyan", "turquoise"),
}
SIZE_WORDS: dict[str, tuple[str, ...]] = {"small": ("small", "little", "tiny"), "large": ("large", "big")}
GENERIC_NOUNS: tuple[str, ...] = ("shape", "object", "thing", "figure")
GENERIC_PLURALS: tuple[str, ...] = ("shapes", "objects", "things", "figures")
NUMBER_WORDS: dict[str, int] = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5}
RELATION_WORDS: dict[str, tuple[str, ...]] = {
    "left_of": ("to the left of", "left of"),
    "right_of": ("to the right of", "right of"),
    "above": ("above", "over"),
    "below": ("below", "under", "beneath"),
}
# Position phrases name a row, a column, or both (None = unconstrained).
VERTICAL_WORDS: dict[str, int] = {"top": 0, "upper": 0, "bottom": 2, "lower": 2}
HORIZONTAL_WORDS: dict[str, int] = {"left": 0, "right": 2}
CENTRE_WORDS: tuple[str, ...] = ("center", "centre", "middle")
