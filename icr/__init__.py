"""Image-caption retrieval. The stages install as ``icr.training``, ``icr.index`` and ``icr.service``
(imports point one way: service -> index -> training); ``icr.cli`` and ``icr.demo`` orchestrate them."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("icr")
except PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"
