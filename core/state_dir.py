"""Where icr keeps its own state (the server's job database, labels and write log) by default."""

from __future__ import annotations

import os
from pathlib import Path


def default_state_dir() -> Path:
    """$XDG_STATE_HOME/icr, or ~/.local/state/icr."""
    base = os.environ.get("XDG_STATE_HOME")
    return (Path(base) if base else Path.home() / ".local" / "state") / "icr"
