"""Caption writer: five captions per scene, of varying detail and word order, each true of its scene.

Every caption is written from a :class:`Query` chosen to be true of the scene, using the words of
:mod:`world`. Relevance is never decided from this text: the parser reads captions back into
queries (the tests check that every caption parses back to a query its scene satisfies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from icr.training.data.synthetic import world
from icr.training.data.synthetic.ground_truth import holds
from icr.training.data.synthetic.query import Descriptor, Query, Relation
from icr.training.data.synthetic.scene import Scene, SceneObject

CAPTIONS_PER_IMAGE = 5
_NUMBER = {2: "two", 3: "three"}


def _pick(rng: np.random.Generator, options: tuple[str, ...] | list[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def position_phrase(row: int | None, col: int | None, rng: np.random.Generator) -> str:
    """Words for a row, a column, or both; only combinations the parser reads back exactly."""
    if row == 1 and col == 1:
        return _pick(rng, ("in the center", "in the middle", "in the centre"))
    if row is not None and col is not None:
        v = _pick(rng, ("top", "upper") if row == 0 else ("bottom", "lower"))
        h = world.COL_NAMES[col]
        return _pick(rng, (f"in the {v} {h} corner", f"at the {v} {h}"))
    if row is not None:
        v = world.ROW_NAMES[row]
        return _pick(rng, (f"at the {v}", f"near the {v}"))
    h = world.COL_NAMES[col]  # type: ignore[index]
    return _pick(rng, (f"on the {h}", f"on the {h} side"))


def _position_of(o: SceneObject, rng: np.random.Generator) -> tuple[int | None, int | None]:
    """A true position statement for the object: its full cell or just its row or its column.

    Middle row/column alone has no phrase, so those cells are described by their other coordinate.
    """
    if o.row == 1 and o.col == 1:
        return 1, 1
    if o.row == 1:
        return None, o.col
    if o.col == 1:
        return o.row, None
    return [(o.row, o.col), (o.row, None), (None, o.col)][int(rng.integers(3))]


def noun_phrase(d: Descriptor, rng: np.random.Generator) -> str:
    """'a small red circle' / 'a blue shape' (prenominal size and colour, no position)."""
    words = []
    if d.size:
        words.append(_pick(rng, world.SIZE_WORDS[d.size]))
    if d.colour:
        words.append(_pick(rng, world.COLOUR_WORDS[d.colour]))
    words.append(_pick(rng, world.SHAPE_WORDS[d.shape]) if d.shape else _pick(rng, world.GENERIC_NOUNS))
    return _article(" ".join(words))


def _with_position(d: Descriptor, rng: np.random.Generator) -> str:
    text = noun_phrase(d, rng)
    if d.row is not None or d.col is not None:
        text += " " + position_phrase(d.row, d.col, rng)
    return text


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _partial(o: SceneObject, rng: np.random.Generator, *, position_p: float = 0.0) -> Descriptor:
    """A descriptor naming some of the object's attributes (always its shape or its colour)."""
    keep_shape, keep_colour = rng.random() < 0.75, rng.random() < 0.75
    if not (keep_shape or keep_colour):
        keep_shape = rng.random() < 0.5
        keep_colour = not keep_shape
    row = col = None
    if rng.random() < position_p:
        row, col = _position_of(o, rng)
    return Descriptor(
        shape=o.shape if keep_shape else None,
        colour=o.colour if keep_colour else None,
        size=o.size if rng.random() < 0.4 else None,
        row=row,
        col=col,
    )


def _full(o: SceneObject) -> Descriptor:
    return Descriptor(shape=o.shape, colour=o.colour, size=o.size)


# --- the five styles -------------------------------------------------------------------------------
# Each takes (scene, rng) and returns (text, query).


def full_description(scene: Scene, rng: np.random.Generator) -> tuple[str, Query]:
    order = rng.permutation(len(scene.objects))
    with_positions = rng.random() < 0.3
    descriptors = []
    for i in order:
        o = scene.objects[i]
        row, col = _position_of(o, rng) if with_positions else (None, None)
        descriptors.append(Descriptor(o.shape, o.colour, o.size, row, col))
    text = _join([_with_position(d, rng) for d in descriptors])
    n = len(scene.objects)
    count = None
    if n >= 2 and rng.random() < 0.5:
        count = n
        noun = _pick(rng, world.GENERIC_PLURALS)
        text = _pick(rng, (f"{_NUMBER[n]} {noun}: ", f"an image with {_NUMBER[n]} {noun}: ")) + text
    background = None
    if rng.random() < 0.4:
        background = scene.background.tone
        text += background_phrase(background, rng)
    return text, Query(tuple(descriptors), (), count, background)


def background_phrase(tone: str, rng: np.random.Generator) -> str:
    return _pick(rng, (f" on a {tone} background", f" against a {tone} background"))


def single_object(scene: Scene, rng: np.random.Generator) -> tuple[str, Query]:
    o = scene.objects[int(rng.integers(len(scene.objects)))]
    d = _partial(o, rng, position_p=0.35)
    text = _with_position(d, rng)
    if rng.random() < 0.3:
        text = _pick(rng, ("there is ", "a picture of ", "an image showing ")) + text
    return text, Query((d,))


def spatial_relation(scene: Scene, rng: np.random.Generator) -> tuple[str, Query]:
    if len(scene.objects) < 2:
        return position_first(scene, rng)
    i, j = rng.choice(len(scene.objects), size=2, replace=False)
    a, b = scene.objects[i], scene.objects[j]
    # distinct cells, so at least one relation holds
    relation = _pick(rng, [r for r in world.RELATIONS if holds(r, a, b)])
    da, db = _partial(a, rng), _partial(b, rng)
    text = f"{noun_phrase(da, rng)} {_pick(rng, world.RELATION_WORDS[relation])} {noun_phrase(db, rng)}"
    return text, Query((da, db), (Relation(0, relation, 1),))


def _postnominal_one(o: SceneObject, rng: np.random.Generator) -> tuple[str, Descriptor]:
    # Attributes after the noun ("a circle that is red and large"): at least one of them.
    attrs = [a for a in ("colour", "size") if rng.random() < 0.7] or [_pick(rng, ("colour", "size"))]
    rng.shuffle(attrs)
    words = [
        _pick(rng, world.COLOUR_WORDS[o.colour] if a == "colour" else world.SIZE_WORDS[o.size]) for a in attrs
    ]
    d = Descriptor(
        shape=o.shape,
        colour=o.colour if "colour" in attrs else None,
        size=o.size if "size" in attrs else None,
    )
    head = _article(_pick(rng, world.SHAPE_WORDS[o.shape]))
    return f"{head} {_pick(rng, ('that is', 'which is'))} {' and '.join(words)}", d


def postnominal(scene: Scene, rng: np.random.Generator) -> tuple[str, Query]:
    k = 2 if len(scene.objects) >= 2 and rng.random() < 0.5 else 1
    chosen = rng.choice(len(scene.objects), size=k, replace=False)
    parts, descriptors = zip(*(_postnominal_one(scene.objects[i], rng) for i in chosen), strict=True)
    text = "; ".join(parts) if k == 2 else parts[0]
    if rng.random() < 0.3:
        text = "there is " + text
    return text, Query(tuple(descriptors))


def position_first(scene: Scene, rng: np.random.Generator) -> tuple[str, Query]:
    o = scene.objects[int(rng.integers(len(scene.objects)))]
    row, col = _position_of(o, rng)
    d = _partial(o, rng)
    d = Descriptor(d.shape, d.colour, d.size, row, col)
    lead = position_phrase(row, col, rng)
    text = (
        f"{lead} there is {noun_phrase(d, rng)}" if rng.random() < 0.5 else f"{lead}, {noun_phrase(d, rng)}"
    )
    return text, Query((d,))


STYLES: tuple[Callable[[Scene, np.random.Generator], tuple[str, Query]], ...] = (
    full_description,
    single_object,
    spatial_relation,
    postnominal,
    position_first,
)


def _surface(text: str, rng: np.random.Generator) -> str:
    # Real captions vary in case and final punctuation; the tokens do not.
    text = text[0].upper() + text[1:] if rng.random() < 0.7 else text
    return text + "." if rng.random() < 0.5 else text


def bare_count(scene: Scene, rng: np.random.Generator) -> tuple[str, Query]:
    """'two shapes' / 'an image with three objects': how many objects, nothing else (scenes of 2-3)."""
    n = len(scene.objects)
    noun = _pick(rng, world.GENERIC_PLURALS)
    text = _pick(rng, (f"{_NUMBER[n]} {noun}", f"an image with {_NUMBER[n]} {noun}"))
    return text, Query((), (), n, None)


def write_captions(
    scene: Scene, rng: np.random.Generator, *, tone_captions: float = 0.0, count_captions: float = 0.0
) -> list[tuple[str, Query]]:
    """Five captions in shuffled style order; a repeated text is redrawn (a few tries).

    ``tone_captions``: the probability that a one-object caption is also given the background tone
    ("a red shape on a dark background"). Training data only: the benchmark's captions name the
    tone in about 8 % of cases, too rarely for a model to learn reliably that it matters; one-object
    captions, because a model hardly ever gets them wrong and tone added to every kind cost
    relations more (README, "The demo model"). ``count_captions``: the probability that a
    one-object caption of a scene of 2-3 objects is replaced by its bare count ("two shapes",
    :func:`bare_count`), which the benchmark's captions never are alone: without them a model ranks
    three-object scenes first for "two shapes". At 0 no random number is drawn for either, so the
    benchmark's bytes do not change.
    """
    out: list[tuple[str, Query]] = []
    seen: set[str] = set()
    for k in rng.permutation(len(STYLES)):
        for _ in range(4):
            text, query = STYLES[k](scene, rng)
            if text not in seen:
                break
        seen.add(text)
        one_object = len(query.objects) == 1 and query.background is None
        several = len(scene.objects) >= 2
        if count_captions and one_object and several and rng.random() < count_captions:
            text, query = bare_count(scene, rng)
        elif tone_captions and one_object and rng.random() < tone_captions:
            text += background_phrase(scene.background.tone, rng)
            query = replace(query, background=scene.background.tone)
        out.append((_surface(text, rng), query))
    return out
