"""The meaning of a caption: what must exist in a scene for the caption to be true."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Descriptor:
    """One object the caption mentions; None means the caption says nothing about that attribute."""

    shape: str | None = None
    colour: str | None = None
    size: str | None = None
    row: int | None = None
    col: int | None = None


@dataclass(frozen=True)
class Relation:
    """Spatial relation between two mentioned objects (indices into Query.objects)."""

    a: int
    relation: str  # left_of | right_of | above | below
    b: int


@dataclass(frozen=True)
class Query:
    """A caption's content. A scene satisfies it when distinct objects of the scene match the
    descriptors and the relations hold between them, the object count equals `count` (when given)
    and the background tone equals `background` (when given). Objects the caption does not mention
    are allowed, as in natural captions."""

    objects: tuple[Descriptor, ...]
    relations: tuple[Relation, ...] = ()
    count: int | None = None
    background: str | None = None
