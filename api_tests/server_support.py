"""Constants and helpers the API tests import by name (their fixtures are in conftest.py; a module of
its own, because `conftest` is also the name of tests/conftest.py and the two would shadow each other)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

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


class Server:
    """One `icr serve` process; ``start()`` returns when /readyz says ready."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            str(ICR),
            "serve",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> Server:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                self.args, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT
            )
        deadline = time.monotonic() + timeout
        key = (
            {"X-API-Key": self.env["ICR_API_KEY"]} if "ICR_API_KEY" in self.env else {}
        )  # ICR_HEALTH_NEED_KEY
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"icr serve exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.url + "/readyz", headers=key, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"icr serve not ready after {timeout} s:\n{self.log_text()}")

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (uvicorn shuts down gracefully: lifespan exit runs), SIGKILL if it hangs."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""


def server_env(artifacts: Artifacts, jobs_db: Path, **extra: str) -> dict[str, str]:
    return {
        "ICR_DATASETS": json.dumps({"synthetic": str(artifacts.data)}),
        "ICR_JOBS_DB": str(jobs_db),
        "ICR_MAX_UPLOAD_BYTES": str(MAX_UPLOAD_BYTES),
        # the fuzzing tests send thousands of refused requests on purpose; the penalty that would
        # slow them has a test of its own (test_hardening.py)
        "ICR_REFUSALS_PER_SECOND": "0",
        **extra,
    }
