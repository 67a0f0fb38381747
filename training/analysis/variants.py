"""The loss comparison's variants as the command line names them: the default set and how a
comma-separated list splits (a module of its own, so ``icr analyze --help`` imports no training code)."""

from __future__ import annotations

DEFAULT_VARIANTS: tuple[str, ...] = (
    "triplet",
    "triplet_hardest",
    "ntxent",
    "smoothap",
    "sampled_softmax",
    "cross_example_softmax",
    "ntxent+ltd:dual",
    "ntxent+ltd:constraint",
)


def split_variants(text: str) -> list[str]:
    """``a,goal[x=1,y=2],b`` -> ``["a", "goal[x=1,y=2]", "b"]``: commas inside brackets stay."""
    out, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(current)
            current = ""
        else:
            current += ch
    return [v.strip() for v in [*out, current] if v.strip()]
