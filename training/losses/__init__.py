"""Training objectives, one file per loss, selected by name (see :mod:`icr.training.losses.base`)."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from icr.training.losses.base import LOSSES, ContrastiveLoss, register

# Helper modules that register no loss; every other module in this package is one loss, found by
# listing the package (a new loss file needs no list to be kept), imported on first use.
_HELPERS = frozenset({"base", "softmax_family"})


def load_all() -> dict[str, type[ContrastiveLoss]]:
    """Import every loss module (registering it) and return the registry."""
    for info in pkgutil.iter_modules(__path__):
        if info.name not in _HELPERS:
            importlib.import_module(f"{__name__}.{info.name}")
    return LOSSES


def build_loss(name: str, **params: Any) -> ContrastiveLoss:
    """The loss registered as ``name``; unknown names or parameters: ValueError listing the valid ones."""
    load_all()
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of: {', '.join(sorted(LOSSES))}")
    cls = LOSSES[name]
    allowed = cls.defaults()
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"loss {name!r} has no parameter(s) {', '.join(unknown)}; "
            f"its parameters are: {', '.join(f'{k}={v!r}' for k, v in allowed.items())}"
        )
    return cls(**params)


__all__ = ["LOSSES", "ContrastiveLoss", "build_loss", "load_all", "register"]
