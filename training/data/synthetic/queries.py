"""Generated queries: what users ask of the embedded benchmark, including what it cannot answer.

The benchmark's captions are each written for an image of its split, and each is true of it. A
user's queries are not: some ask for a scene no image holds, some for things no scene can hold,
some for a bare count ("two shapes"). A calibration fitted on captions alone reads a high top score
as relevance; fitted on these too, it has evidence that a high score can mean nothing relevant.

Each query is written for a scene of the generator's own ``query`` stream (in no split and no
distractor set), one query per scene, in one of these styles:

* ``caption``: one of the benchmark's five caption styles (:data:`captions.STYLES`);
* ``bare_count``: the scene's object count alone ("two shapes", :func:`captions.bare_count`), in
  ``BARE_COUNT_TONE`` of them with its background tone ("three objects on a dark background");
* ``impossible``: four objects (no scene holds more than three), or a stated count that contradicts
  the objects listed ("two shapes: a red circle, a blue square and a green star"): never true.

Ground truth judges them like any caption (the parser reads them back). Query ``i`` of a seed is
the same whatever ``n`` is, so a fit and an evaluation draw disjoint ranges of one stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from icr.training.data.synthetic import world
from icr.training.data.synthetic.captions import (
    STYLES,
    _join,
    _pick,
    background_phrase,
    bare_count,
    noun_phrase,
)
from icr.training.data.synthetic.generate import _child_rng, make_scene
from icr.training.data.synthetic.query import Descriptor
from icr.training.data.synthetic.scene import Scene

QUERY_STYLES: tuple[str, ...] = ("caption", "bare_count", "impossible")
# Shares of bare_count and impossible queries (the rest are captions); bare counts only where the
# scene has 2-3 objects.
BARE_COUNT_SHARE = 0.1
IMPOSSIBLE_SHARE = 0.05
# Bare counts that also name the background tone, as users combine them.
BARE_COUNT_TONE = 0.3
# A fit draws queries from 0 on, an evaluation from EVAL_OFFSET on: never the same scenes.
EVAL_OFFSET = 1_000_000


@dataclass(frozen=True)
class GeneratedQuery:
    text: str
    style: str  # one of QUERY_STYLES


def _impossible(scene: Scene, rng: np.random.Generator) -> str:
    """The scene's objects named with a count below their number, or with more objects added until
    there are four: true of no scene."""
    names = [noun_phrase(Descriptor(o.shape, o.colour, o.size), rng) for o in scene.objects]
    if len(names) == 3 and rng.random() < 0.5:
        return f"{_pick(rng, ('two shapes: ', 'an image with two objects: '))}{_join(names)}"
    while len(names) < 4:
        names.append(noun_phrase(Descriptor(_pick(rng, world.SHAPES), _pick(rng, world.COLOUR_NAMES)), rng))
    return _join(names)


def generated_queries(seed: int, start: int, n: int) -> list[GeneratedQuery]:
    """Queries ``start .. start + n - 1`` of the ``query`` stream of ``seed`` (see the module docstring)."""
    if n < 0 or start < 0:
        raise ValueError(f"start and n must be >= 0, got {start} and {n}")
    out = []
    for i in range(start, start + n):
        scene = make_scene(seed, "query", i)
        rng = _child_rng(seed, "query", i, 2)
        u = rng.random()
        if u < IMPOSSIBLE_SHARE:
            out.append(GeneratedQuery(_impossible(scene, rng), "impossible"))
        elif u < IMPOSSIBLE_SHARE + BARE_COUNT_SHARE and len(scene.objects) >= 2:
            text, _ = bare_count(scene, rng)
            if rng.random() < BARE_COUNT_TONE:  # "three objects on a dark background"
                text += background_phrase(scene.background.tone, rng)
            out.append(GeneratedQuery(text, "bare_count"))
        else:
            text, _ = STYLES[int(rng.integers(len(STYLES)))](scene, rng)
            out.append(GeneratedQuery(text, "caption"))
    return out
