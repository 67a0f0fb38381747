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

from icr.training.data.synthetic import world
from icr.training.data.synthetic.parse import parse_caption
from icr.training.data.synthetic.query import Descriptor, Query
from icr.training.data.synthetic.scene import Scene, SceneObject, SceneTable


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


def relevance_of_hits(
    queries: Sequence[Query], ids: np.ndarray, table: SceneTable, *, judged_from: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ground truth for every query's retrieved gallery items.

    ``ids`` (Q, depth) are rows of ``table`` (the gallery's scenes; -1 = no hit). Returns the
    relevance of each hit (Q, depth) bool, and per query the relevant items of the whole gallery
    (Q,) and of its rows from ``judged_from`` on (Q,), e.g. the generated distractors after a
    split's images.
    """
    ids = np.asarray(ids)
    relevant = np.zeros(ids.shape, dtype=bool)
    n_relevant = np.zeros(len(queries), dtype=np.int64)
    n_judged = np.zeros(len(queries), dtype=np.int64)
    for q, query in enumerate(queries):
        mask = relevance_mask(query, table)  # (M,)
        row = ids[q]
        relevant[q] = np.where(row >= 0, mask[np.maximum(row, 0)], False)
        n_relevant[q] = int(mask.sum())
        n_judged[q] = int(mask[judged_from:].sum())
    return relevant, n_relevant, n_judged


class PairTruth:
    """Ground truth for any block of (image, caption) pairs of one split, e.g. a training batch.

    Built once from the split's parsed captions and its images' scenes; a 128 x 640 block costs a
    few milliseconds.
    """

    def __init__(self, queries: Sequence[Query], table: SceneTable) -> None:
        self.queries = list(queries)
        self.table = table

    def __call__(self, img_idx: np.ndarray, cap_idx: np.ndarray) -> np.ndarray:
        """(len(img_idx), len(cap_idx)) bool: image ``img_idx[i]`` satisfies caption ``cap_idx[j]``."""
        block = self.table.take(np.asarray(img_idx))
        return relevance_matrix([self.queries[int(c)] for c in cap_idx], block).T
