"""Caption parser: reads a caption's content into a :class:`Query`.

A small left-to-right grammar over the closed vocabulary of :mod:`world`:

    caption    := [count ':'] item* [background]
    item       := np | position | relation | 'that is' attr ('and' attr)*
    np         := article? attr* (shape noun | generic noun)
    position   := prep? 'the'? (vertical | horizontal | centre)+ ('corner' | 'side')?
    relation   := 'to the left of' | 'left of' | 'above' | 'below' | ...

A position phrase belongs to the object just named, or, when it opens the caption or follows
another position, to the next object ("in the top left corner there is a red circle"). A relation
links the object before it to the object after it. Words outside the vocabulary raise
:class:`CaptionParseError` rather than being skipped: ignoring "not" or "without" would silently
turn a caption into its opposite.
"""

from __future__ import annotations

import re

from icr.training.data.synthetic import world
from icr.training.data.synthetic.query import Descriptor, Query, Relation


class CaptionParseError(ValueError):
    """The caption uses words or constructions outside the synthetic world's grammar."""


ARTICLES = frozenset({"a", "an", "the", "one"})
FILLERS = frozenset(
    {
        "there",
        "is",
        "are",
        "with",
        "and",
        "against",
        "image",
        "picture",
        "photo",
        "scene",
        "of",
        "showing",
        "shows",
        "containing",
        "contains",
        "in",
        "on",
        "at",
        "near",
        "some",
        "we",
        "see",
        "can",
        "you",
        "it",
        "has",
    }
)
PREPOSITIONS = frozenset({"in", "at", "on", "near"})
POSITION_TAILS = frozenset({"corner", "side", "part"})
POSTNOMINAL = (("that", "is"), ("which", "is"), ("that's",))


def _phrase_table(words: dict[str, tuple[str, ...]]) -> dict[tuple[str, ...], str]:
    return {tuple(p.split()): key for key, phrases in words.items() for p in phrases}


SHAPE_PHRASES = _phrase_table(world.SHAPE_WORDS)
COLOUR_PHRASES = _phrase_table(world.COLOUR_WORDS)
SIZE_PHRASES = _phrase_table(world.SIZE_WORDS)
RELATION_PHRASES = _phrase_table(world.RELATION_WORDS)
_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def _match(tokens: list[str], i: int, table: dict[tuple[str, ...], str]) -> tuple[str, int] | None:
    """Longest phrase of `table` starting at tokens[i]: (value, number of tokens)."""
    for n in (4, 3, 2, 1):
        value = table.get(tuple(tokens[i : i + n]))
        if value is not None:
            return value, n
    return None


class _Parser:
    def __init__(self, caption: str):
        self.caption = caption
        self.tokens = _TOKEN.findall(caption.lower())
        self.objects: list[Descriptor] = []
        self.relations: list[Relation] = []
        self.count: int | None = None
        self.background: str | None = None
        self.pending: dict[str, str] = {}  # attributes (size, colour) of the noun phrase being read
        self.pending_position: tuple[int | None, int | None] | None = None
        self.pending_relation: tuple[int, str] | None = None
        self.postnominal = False  # after "that is": attributes go to the last object
        self.last_was_object = False  # a position phrase now belongs to the last object

    def fail(self, why: str) -> CaptionParseError:
        return CaptionParseError(f"cannot read caption {self.caption!r}: {why}")

    def set_attr(self, name: str, value: str) -> None:
        if self.postnominal:
            target = self.objects[-1].__dict__
            if target[name] is not None and target[name] != value:
                raise self.fail(f"conflicting {name}: {target[name]} and {value}")
            self.objects[-1] = Descriptor(**{**target, name: value})
            return
        if self.pending.get(name) not in (None, value):
            raise self.fail(f"conflicting {name}: {self.pending[name]} and {value}")
        self.pending[name] = value

    def close_noun_phrase(self, shape: str | None) -> None:
        row, col = self.pending_position if self.pending_position is not None else (None, None)
        self.objects.append(Descriptor(shape=shape, row=row, col=col, **self.pending))
        self.pending = {}
        self.pending_position = None
        if self.pending_relation is not None:
            a, rel = self.pending_relation
            self.relations.append(Relation(a, rel, len(self.objects) - 1))
            self.pending_relation = None
        self.last_was_object = True

    def merge_position(
        self, old: tuple[int | None, int | None], new: tuple[int | None, int | None]
    ) -> tuple[int | None, int | None]:
        """'at the top, on the left' = the top-left cell; 'at the top ... at the bottom' is an error."""
        merged = []
        for a, b in zip(old, new, strict=True):
            if a is not None and b is not None and a != b:
                raise self.fail("two different positions for one object")
            merged.append(a if b is None else b)
        return merged[0], merged[1]

    def read_position(self, i: int) -> int | None:
        """Reads a position phrase at i; returns tokens consumed, or None if there is none."""
        t = self.tokens
        j = i
        if j < len(t) and t[j] in PREPOSITIONS:
            j += 1
            if j < len(t) and t[j] == "the":
                j += 1
        row = col = None
        centre = False
        start = j
        while j < len(t):
            w = t[j]
            if w in world.VERTICAL_WORDS and row is None:
                row = world.VERTICAL_WORDS[w]
            elif w in world.HORIZONTAL_WORDS and col is None:
                if j + 1 < len(t) and t[j + 1] == "of":
                    break  # "left of" is a relation, not a position
                col = world.HORIZONTAL_WORDS[w]
            elif w in world.CENTRE_WORDS and not centre:
                centre = True
            else:
                break
            j += 1
        if j == start:
            return None
        if centre:  # "center" alone is the middle cell; "top middle" is the middle column
            row = 1 if row is None else row
            col = 1 if col is None else col
        if j < len(t) and t[j] in POSITION_TAILS:
            j += 1
        if self.last_was_object or self.postnominal:
            last = self.objects[-1]
            row, col = self.merge_position((last.row, last.col), (row, col))
            self.objects[-1] = Descriptor(last.shape, last.colour, last.size, row, col)
        else:
            self.pending_position = self.merge_position(self.pending_position or (None, None), (row, col))
        return j - i

    def run(self) -> Query:  # noqa: C901 (one branch per word class of the caption grammar)
        t = self.tokens
        if not t:
            raise self.fail("it is empty")
        i = 0
        while i < len(t):
            w = t[i]
            # counts: "three shapes", "an image with two objects"
            if w in world.NUMBER_WORDS and i + 1 < len(t) and t[i + 1] in world.GENERIC_PLURALS:
                if self.count is not None:
                    raise self.fail("two object counts")
                self.count = world.NUMBER_WORDS[w]
                i += 2
                continue
            if w in ("dark", "light") and i + 1 < len(t) and t[i + 1] == "background":
                self.background = w
                i += 2
                continue
            rel = _match(t, i, RELATION_PHRASES)
            if rel is not None:
                if not self.objects or self.pending:
                    raise self.fail(f"relation {' '.join(t[i : i + rel[1]])!r} without an object before it")
                self.pending_relation = (len(self.objects) - 1, rel[0])
                self.postnominal = self.last_was_object = False
                i += rel[1]
                continue
            used = self.read_position(i)
            if used is not None:
                i += used
                continue
            post = next((len(p) for p in POSTNOMINAL if tuple(t[i : i + len(p)]) == p), 0)
            if post:
                if not self.last_was_object:
                    raise self.fail("'that is' without an object before it")
                self.postnominal = True
                self.last_was_object = False
                i += post
                continue
            for name, table in (("size", SIZE_PHRASES), ("colour", COLOUR_PHRASES)):
                m = _match(t, i, table)
                if m is not None:
                    self.set_attr(name, m[0])
                    if not self.postnominal:
                        self.last_was_object = False
                    i += m[1]
                    break
            else:
                shape = _match(t, i, SHAPE_PHRASES)
                if shape is not None or w in world.GENERIC_NOUNS or w == "something":
                    self.postnominal = False
                    self.close_noun_phrase(shape[0] if shape else None)
                    i += shape[1] if shape else 1
                elif w in ARTICLES:
                    self.postnominal = self.last_was_object = False
                    i += 1
                elif w in FILLERS:  # "a circle is at the top": the position still attaches
                    i += 1
                else:
                    raise self.fail(f"unknown word {w!r}")
        if self.pending:
            raise self.fail(f"attributes {sorted(self.pending.values())} are not followed by a noun")
        if self.pending_relation is not None:
            raise self.fail("a relation is not followed by an object")
        if self.pending_position is not None:
            raise self.fail("a position is not followed by an object")
        if not self.objects and self.count is None:
            raise self.fail("it names no object")
        return Query(tuple(self.objects), tuple(self.relations), self.count, self.background)


def parse_caption(caption: str) -> Query:
    """The content of `caption` as a :class:`Query`; raises :class:`CaptionParseError`."""
    return _Parser(caption).run()


def try_parse_caption(caption: str) -> Query | None:
    """Like :func:`parse_caption` but None for captions outside the grammar (e.g. user queries)."""
    try:
        return parse_caption(caption)
    except CaptionParseError:
        return None
