"""The ground-truth relevance oracle on hand-built scenes, and its parser."""

from __future__ import annotations

import numpy as np
import pytest
from synth_helpers import obj, scene

from icr.training.data.synthetic.captions import write_captions
from icr.training.data.synthetic.ground_truth import is_relevant, relevance_mask, relevance_matrix, satisfies
from icr.training.data.synthetic.parse import CaptionParseError, parse_caption, try_parse_caption
from icr.training.data.synthetic.query import Descriptor, Query, Relation
from icr.training.data.synthetic.scene import SceneTable, sample_scene

# top-left large red circle, centre small blue square, bottom-right large green triangle; dark
THREE = scene(
    obj("large red circle", 0, 0),
    obj("small blue square", 1, 1),
    obj("large green triangle", 2, 2),
    tone="dark",
)
# a single small red circle in the top-right cell; light
ONE = scene(obj("small red circle", 0, 2))
# two red circles side by side in the middle row
TWO_RED = scene(obj("small red circle", 1, 0), obj("large red circle", 1, 2))


@pytest.mark.parametrize(
    ("caption", "three", "one", "two_red"),
    [
        # partial captions naming one object
        ("a red circle", True, True, True),
        ("A circle.", True, True, True),
        ("a red shape", True, True, True),
        ("a blue thing", True, False, False),
        ("a large red circle", True, False, True),
        ("a small red circle", False, True, True),
        ("a big red disc", True, False, True),  # synonyms
        ("a tiny blue box", True, False, False),
        ("a purple star", False, False, False),
        # word order: attributes after the noun
        ("a circle that is red and large", True, False, True),
        ("there is a square which is small", True, False, False),
        ("a circle that is blue", False, False, False),
        # positions
        ("a red circle in the top left corner", True, False, False),
        ("a red circle in the upper right corner", False, True, False),
        ("in the top left corner there is a red circle", True, False, False),
        ("at the top, a circle", True, True, False),
        ("a blue square in the center", True, False, False),
        ("a blue square in the middle", True, False, False),
        ("on the right side, a green triangle", True, False, False),
        ("a red circle on the left", True, False, True),
        ("a triangle at the bottom", True, False, False),
        ("a circle at the bottom", False, False, False),
        # spatial relations between two objects
        ("a red circle left of a blue square", True, False, False),
        ("a red circle to the left of a green triangle", True, False, False),
        ("a blue square to the left of a red circle", False, False, False),
        ("a red circle above a blue square", True, False, False),
        ("a green triangle below a red circle", True, False, False),
        ("a triangle beneath a square", True, False, False),
        ("a square over a triangle", True, False, False),
        ("a small circle left of a large circle", False, False, True),
        ("a large circle left of a small circle", False, False, False),
        ("a red circle left of a red circle", False, False, True),  # needs two distinct objects
        ("a circle above a circle", False, False, False),  # same row: neither is above
        # full descriptions, counts and background
        ("a large red circle, a small blue square and a large green triangle", True, False, False),
        ("three shapes: a red circle, a blue square and a green triangle", True, False, False),
        ("two shapes: a red circle and a blue square", False, False, False),  # THREE has 3 objects
        ("two objects: a red circle and a red circle", False, False, True),
        ("an image with three objects", True, False, False),
        ("a red circle and a blue square", True, False, False),
        ("a red circle on a dark background", True, False, False),
        ("a red circle against a light background", False, True, True),
    ],
)
def test_hand_built_scenes(caption: str, three: bool, one: bool, two_red: bool) -> None:
    assert is_relevant(caption, THREE) is three
    assert is_relevant(caption, ONE) is one
    assert is_relevant(caption, TWO_RED) is two_red
    # the vectorised form answers the same for all three scenes at once
    table = SceneTable.from_scenes([THREE, ONE, TWO_RED])
    assert relevance_mask(parse_caption(caption), table).tolist() == [three, one, two_red]


def test_parse_structure_of_relation_and_positions() -> None:
    q = parse_caption("In the top left corner there is a big red disc above a small turquoise plus sign.")
    assert q == Query(
        objects=(
            Descriptor(shape="circle", colour="red", size="large", row=0, col=0),
            Descriptor(shape="cross", colour="cyan", size="small"),
        ),
        relations=(Relation(0, "above", 1),),
    )
    q = parse_caption(
        "Two figures: a violet rhombus on the left side and a little orange hexagon at the bottom"
    )
    assert q.count == 2
    assert q.objects == (
        Descriptor(shape="diamond", colour="purple", col=0),
        Descriptor(shape="hexagon", colour="orange", size="small", row=2),
    )


@pytest.mark.parametrize(
    "caption",
    [
        "",
        "a red circle that is not blue",  # negation must not be silently dropped
        "a dog on a couch",
        "a red",  # attribute without a noun
        "a circle left of",  # relation without its second object
        "left of a square",  # relation without its first object
        "in the top left corner",  # position without an object
        "a small large circle",  # contradiction
        "a circle at the top at the bottom",
    ],
)
def test_captions_outside_the_grammar_are_rejected(caption: str) -> None:
    with pytest.raises(CaptionParseError, match="cannot read caption"):
        parse_caption(caption)
    assert try_parse_caption(caption) is None


def test_more_mentioned_objects_than_the_scene_has() -> None:
    q = parse_caption("a circle, a square, a triangle and a star")
    assert not satisfies(q, THREE)
    assert relevance_mask(q, SceneTable.from_scenes([THREE, ONE])).tolist() == [False, False]


@pytest.mark.parametrize("tone_captions", [0.0, 0.5])
def test_generated_captions_parse_back_and_are_true_of_their_scene(tone_captions: float) -> None:
    naming_tone = {"one": [], "more": []}
    for i in range(400):
        rng = np.random.default_rng(i)
        s = sample_scene(rng)
        captions = write_captions(s, rng, tone_captions=tone_captions)
        assert len(captions) == 5
        for text, query in captions:
            parsed = parse_caption(text)
            assert parsed == query, text
            assert satisfies(parsed, s), text
            naming_tone["one" if len(query.objects) == 1 else "more"].append(query.background is not None)
    # A few full descriptions of one-object scenes name the tone by themselves; at 0.5 half of
    # the other one-object captions are given it. Captions of several objects are never changed.
    one, more = (float(np.mean(naming_tone[k])) for k in ("one", "more"))
    assert one < 0.08 if tone_captions == 0 else 0.45 < one < 0.6
    assert 0.1 < more < 0.2


def _naive_matrix(captions: list[str], scenes: list) -> np.ndarray:
    return np.array([[is_relevant(c, s) for s in scenes] for c in captions])


def test_vectorised_relevance_matches_the_scalar_definition() -> None:
    rng = np.random.default_rng(123)
    scenes = [sample_scene(rng) for _ in range(150)] + [THREE, ONE, TWO_RED]
    captions = [t for s in scenes[:60] for t, _ in write_captions(s, rng)]
    captions += [
        "a circle above a circle",
        "a red shape left of a blue shape",
        "three shapes",
        "a star on a dark background",
    ]
    fast = relevance_matrix(captions, SceneTable.from_scenes(scenes))
    assert fast.shape == (len(captions), len(scenes))
    np.testing.assert_array_equal(fast, _naive_matrix(captions, scenes))
    # captions are true of other images too: the false negatives of the 5-caption protocol
    assert (fast.sum(axis=1) > 1).mean() > 0.3


def test_scene_table_concat_pads_to_the_widest() -> None:
    a = SceneTable.from_scenes([ONE])
    b = SceneTable.from_scenes([THREE, TWO_RED])
    both = SceneTable.concat([a, b])
    assert len(both) == 3 and both.shape.shape == (3, 3)
    q = parse_caption("a red circle")
    assert relevance_mask(q, both).tolist() == [True, True, True]
    q = parse_caption("a red circle above a blue square")
    assert relevance_mask(q, both).tolist() == [False, True, False]


def test_count_captions_replace_one_object_captions_by_the_bare_count() -> None:
    """A share of the one-object captions of scenes with 2-3 objects become "two shapes" (true of the
    scene, parsed back as a count and nothing else); other captions and one-object scenes never."""
    bare, one_object_scenes = [], 0
    for i in range(400):
        rng = np.random.default_rng(i)
        s = sample_scene(rng)
        for text, query in write_captions(s, rng, count_captions=0.5):
            parsed = parse_caption(text)
            assert parsed == query and satisfies(parsed, s), text
            if query.count is not None and not query.objects:
                assert len(s.objects) >= 2 and query.count == len(s.objects)
                bare.append(text)
        one_object_scenes += len(s.objects) == 1
    assert len(bare) > 100 and one_object_scenes > 50
    assert {b.lower().rstrip(".").split()[-2] for b in bare} == {"two", "three"}


def test_generated_queries_are_reproducible_and_judged_like_captions() -> None:
    """Queries of the query stream: a function of (seed, index); each style in its share; captions and
    bare counts are true of their own scene, impossible ones of no scene at all."""
    from icr.training.data.synthetic.generate import make_scene
    from icr.training.data.synthetic.queries import QUERY_STYLES, generated_queries

    def never_true(query: Query) -> bool:  # more than three objects, or a count below those named
        return len(query.objects) > 3 or (query.count is not None and query.count < len(query.objects))

    queries = generated_queries(0, 0, 600)
    assert generated_queries(0, 100, 50) == queries[100:150]  # the same whatever the range
    assert generated_queries(1, 0, 50) != queries[:50]
    styles = [q.style for q in queries]
    assert set(styles) == set(QUERY_STYLES)
    assert 0.02 < styles.count("impossible") / 600 < 0.09 and 0.05 < styles.count("bare_count") / 600 < 0.15
    rng = np.random.default_rng(0)
    others = SceneTable.from_scenes([sample_scene(rng) for _ in range(300)] + [THREE, ONE, TWO_RED])
    for i, q in enumerate(queries):
        parsed = parse_caption(q.text)
        assert never_true(parsed) == (q.style == "impossible"), q.text
        if q.style == "impossible":
            assert not relevance_mask(parsed, others).any(), q.text
        else:
            assert satisfies(parsed, make_scene(0, "query", i)), q.text
    with pytest.raises(ValueError):
        generated_queries(0, -1, 5)
