"""Ground-truth relevance: does a scene satisfy a caption?

Decided from the scene structure and the parsed caption (:func:`parse.parse_caption`), never from
the captions an image was written with, so it applies to any caption-image pair: other images of
the benchmark, distractors, or a user's query.

Two implementations: :func:`satisfies` (one scene, plain Python, the readable definition) and
:func:`relevance_mask` (numpy over a :class:`SceneTable`, for millions of distractors). Tests
check that they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import permutations

import numpy as np

from training.data.synthetic import world
from training.data.synthetic.parse import parse_caption
from training.data.synthetic.query import Descriptor, Query
from training.data.synthetic.scene import Scene, SceneObject, SceneTable


def _matches(d: Descriptor, o: SceneObject) -> bool:
    return (
        (d.shape is None or d.shape == o.shape)
        and (d.colour is None or d.colour == o.colour)
        and (d.size is None or d.size == o.size)
        and (d.row is None or d.row == o.row)
        and (d.col is None or d.col == o.col)
    )


def holds(relation: str, a: SceneObject, b: SceneObject) -> bool:
    try:
        coord, compare = world.RELATION_TESTS[relation]
    except KeyError:
        raise ValueError(f"unknown relation {relation!r}; expected one of {world.RELATIONS}") from None
    return bool(compare(getattr(a, coord), getattr(b, coord)))


def satisfies(query: Query, scene: Scene) -> bool:
    """True when distinct objects of `scene` can play the mentioned objects of `query`."""
    if query.count is not None and len(scene.objects) != query.count:
        return False
    if query.background is not None and scene.background.tone != query.background:
        return False
    for chosen in permutations(scene.objects, len(query.objects)):  # none when the query names more
        if all(_matches(d, o) for d, o in zip(query.objects, chosen, strict=True)) and all(
            holds(r.relation, chosen[r.a], chosen[r.b]) for r in query.relations
        ):
            return True
    return False


def is_relevant(caption: str | Query, scene: Scene) -> bool:
    """Whether the image of `scene` satisfies `caption` (text or an already parsed query)."""
    query = parse_caption(caption) if isinstance(caption, str) else caption
    return satisfies(query, scene)


_CATEGORY = {
    "shape": {v: i for i, v in enumerate(world.SHAPES)},
    "colour": {v: i for i, v in enumerate(world.COLOUR_NAMES)},
    "size": {v: i for i, v in enumerate(world.SIZES)},
}


def relevance_mask(query: Query, table: SceneTable) -> np.ndarray:
    """(M,) bool: which scenes of `table` satisfy `query`; same answers as :func:`satisfies`."""
    m, k = table.shape.shape
    ok = np.ones(m, dtype=bool)
    if query.count is not None:
        ok &= table.count == query.count
    if query.background is not None:
        ok &= table.tone == world.BACKGROUND_TONES.index(query.background)
    n = len(query.objects)
    if n > k:
        return np.zeros(m, dtype=bool)
    # match[q][:, s]: object slot s of each scene fits descriptor q (padding slots hold -1: never)
    match = []
    for d in query.objects:
        mq = table.shape >= 0  # (M, K)
        for attr in ("shape", "colour", "size"):
            value = getattr(d, attr)
            if value is not None:
                mq &= getattr(table, attr) == _CATEGORY[attr][value]
        for attr in ("row", "col"):
            value = getattr(d, attr)
            if value is not None:
                mq &= getattr(table, attr) == value
        match.append(mq)
    found = np.zeros(m, dtype=bool)
    for slots in permutations(range(k), n):  # injective assignments of mentioned objects to slots
        hit = ok.copy()
        for q, s in enumerate(slots):
            hit &= match[q][:, s]
        for r in query.relations:
            coord, compare = world.RELATION_TESTS[r.relation]
            values = getattr(table, coord)
            hit &= compare(values[:, slots[r.a]], values[:, slots[r.b]])
        found |= hit
    return found


def relevance_matrix(captions: Sequence[str | Query], table: SceneTable) -> np.ndarray:
    """(len(captions), M) bool: caption c is satisfied by scene m."""
    out = np.zeros((len(captions), len(table)), dtype=bool)
    for c, caption in enumerate(captions):
        query = parse_caption(caption) if isinstance(caption, str) else caption
        out[c] = relevance_mask(query, table)
    return out
