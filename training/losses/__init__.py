"""Training objectives, one file per loss, selected by name (see :mod:`training.losses.base`)."""

from __future__ import annotations

import importlib

from training.losses.base import LOSSES, ContrastiveLoss, build_loss, register

# One module per registered loss; imported on first use, so importing the package has no side effects.
_MODULES = (
    "triplet",
    "triplet_hardest",
    "ntxent",
    "ntxent_multi",
    "smoothap",
    "goal",
    "sampled_softmax",
    "snm",
    "cross_example_softmax",
    "cross_example_mining",
)


def load_all() -> dict[str, type[ContrastiveLoss]]:
    """Import every loss module (registering it) and return the registry."""
    for module in _MODULES:
        importlib.import_module(f"training.losses.{module}")
    return LOSSES


__all__ = ["LOSSES", "ContrastiveLoss", "build_loss", "load_all", "register"]
