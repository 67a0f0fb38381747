"""Out-of-domain queries: what a user may type that no calibration query resembles.

The per-query honesty section (:mod:`icr.training.evaluation.metrics.query_honesty`) checks that
none of them is promised anything. Groups:

* ``nonsense``: keyboard mashes, punctuation, symbols, invisible characters, filler;
* ``other_domain``: ordinary captions of photos (COCO-like scenes, landmarks), none of which the
  embedded benchmark's shapes can satisfy;
* ``word_salad``: the fitting queries' own words in random order (:func:`word_salad`): every word
  known, the phrase never seen;
* ``held_out_kind``: captions of one query kind, searched with a calibration fitted without that
  kind (built by the evaluation, not here).

A file of one query per line (``--ood-queries``) replaces the first two groups for another domain.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from icr.training.data.vocab import tokenize

NONSENSE: tuple[str, ...] = (
    "qwerty",
    "!!!",
    "\u200b",  # a zero-width space
    "asdfghjkl",
    "???",
    "...",
    "zzzzzz",
    "lorem ipsum dolor sit amet",
    "xyzzy plugh",
    "12345",
    "\U0001f642",  # an emoji
    "#$%^&*",
    "aaaaaaaaaaaa",
    "hjkl hjkl hjkl",
    "test",
    "asd qwe zxc",
    "blah blah blah",
    "foo bar baz",
    "null",
    "\u00a0\u2003",  # a no-break space and an em space
    "kjhgfd poiuy",
    "ok",
    "hello",
    "undefined",
    "mnbvcxz",
)
OTHER_DOMAIN: tuple[str, ...] = (
    "the eiffel tower at night",
    "a dog catching a frisbee in the park",
    "a man riding a wave on a surfboard",
    "two people eating pizza at a table",
    "a cat sleeping on a laptop keyboard",
    "a bowl of fruit on a wooden table",
    "a red double decker bus on a city street",
    "snow covered mountains under a blue sky",
    "a plate of spaghetti with tomato sauce",
    "an airplane taking off from a runway",
    "children playing soccer on a field",
    "a stop sign at an intersection",
    "a giraffe standing next to a tree",
    "a woman holding an umbrella in the rain",
    "a bathroom with a white sink and a mirror",
    "a train crossing a bridge over a river",
    "a sunset over the ocean",
    "a group of elephants walking through tall grass",
    "a kitchen with stainless steel appliances",
    "a skateboarder doing a trick on a ramp",
    "a vase of flowers on a windowsill",
    "a baseball player swinging a bat",
    "a laptop and a cup of coffee on a desk",
    "horses grazing in a green pasture",
    "a birthday cake with candles",
)


def word_salad(texts: Sequence[str], n: int, seed: int = 0, words: tuple[int, int] = (3, 6)) -> list[str]:
    """``n`` strings of ``words[0]``-``words[1]`` words drawn at random from ``texts``' words."""
    vocabulary = sorted({w for t in texts for w in tokenize(t)})
    if not vocabulary:
        raise ValueError("word salad needs texts with words")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(words[0], words[1] + 1, size=n)
    return [" ".join(vocabulary[int(i)] for i in rng.integers(len(vocabulary), size=m)) for m in lengths]


def read_ood_file(path: str | Path) -> list[str]:
    """One query per line (blank lines skipped); ValueError naming the file when it has none."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read the out-of-domain queries ({err})") from None
    queries = [line for line in lines if line.strip()]
    if not queries:
        raise ValueError(f"{path}: no out-of-domain queries (one per line)")
    return queries
