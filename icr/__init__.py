"""Image-caption retrieval. The stages install as ``icr.training``, ``icr.index`` and ``icr.service``
(imports point one way: service -> index -> training); ``icr.cli`` and ``icr.demo`` orchestrate them.

``icr.load(checkpoint)`` returns an :class:`icr.encoder.Encoder` (``encode_text``, ``encode_images``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers; at run time __getattr__ imports them on first use
    from icr.encoder import Encoder, load

__all__ = ["Encoder", "__version__", "load"]

try:
    __version__ = version("icr")
except PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    """``icr.load`` and ``icr.Encoder``, imported when first asked for: every ``import icr.<stage>``
    runs this file, and the encoder brings torch and the model code (seconds)."""
    if name in ("Encoder", "load"):
        from icr import encoder  # noqa: PLC0415 (torch and the model code: only for icr.load)

        return getattr(encoder, name)
    raise AttributeError(f"module 'icr' has no attribute {name!r}")
