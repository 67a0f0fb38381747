"""Training objectives, one file per loss, selected by name (see :mod:`icr.training.losses.base`)."""

from __future__ import annotations

import importlib
import pkgutil

from icr.training.losses.base import LOSSES, ContrastiveLoss, build_loss, register

# Helper modules that register no loss; every other module in this package is one loss, found by
# listing the package (a new loss file needs no list to be kept), imported on first use.
_HELPERS = frozenset({"base", "softmax_family"})


def load_all() -> dict[str, type[ContrastiveLoss]]:
    """Import every loss module (registering it) and return the registry."""
    for info in pkgutil.iter_modules(__path__):
        if info.name not in _HELPERS:
            importlib.import_module(f"{__name__}.{info.name}")
    return LOSSES


__all__ = ["LOSSES", "ContrastiveLoss", "build_loss", "load_all", "register"]
