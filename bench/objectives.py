"""The objectives the training bench times, each with its config overrides, and their labels."""

from __future__ import annotations

OBJECTIVES = [
    ("ntxent", []),
    ("triplet", []),
    ("triplet_hardest", []),
    ("smoothap", []),
    ("goal", []),
    ("goal", ['loss.goal.triplet_weight="cir"', 'loss.goal.pair_weight="sig_ms"']),
    ("sampled_softmax", []),
    ("snm", []),
    ("cross_example_softmax", []),
    ("cross_example_mining", []),
    ("ntxent", ['decoding.kind="ltd"', 'decoding.mode="constraint"']),
    ("ntxent", ['decoding.kind="itd"', 'decoding.mode="constraint"']),
]


def label(name: str, extra: list[str]) -> str:
    parts = [name] + [e.split("=", 1)[1].strip('"') for e in extra if e.startswith(f"loss.{name}.")]
    if any(e.startswith("decoding.kind") for e in extra):
        kind = next(e.split("=", 1)[1].strip('"') for e in extra if e.startswith("decoding.kind"))
        parts.append("+" + kind)
    return "/".join(parts)
