"""Constants and helpers the API tests import by name (their fixtures are in conftest.py; a module of
its own, because `conftest` is also the name of tests/conftest.py and the two would shadow each other)."""

from __future__ import annotations

import json
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ICR = Path(sys.executable).parent / "icr"
N_DISTRACTORS = 400
MAX_UPLOAD_BYTES = 1 << 20  # small, so the oversize test sends little


def free_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Artifacts:
    data: Path
    checkpoint: Path
    images: Path
    captions: Path
    root: Path


def index_with_calibration(artifacts: Artifacts, folder: Path, calibration: dict) -> Path:
    """A copy of the session's image index folder whose calibration.json is ``calibration``."""
    from icr.index.calibration import CALIBRATION_FILE

    copy = folder / "images"
    shutil.copytree(artifacts.images, copy)
    (copy / CALIBRATION_FILE).write_text(json.dumps(calibration, indent=2))
    return copy
