"""Fixtures of the black-box API tests: small real artifacts, and real `icr serve` processes.

The artifacts (a synthetic dataset, a tiny model trained for a few steps, an image index with
generated distractors, a caption index and a calibration) are built once per session in-process;
the server is a separate `icr serve` process on 127.0.0.1 that the tests only reach over HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_support import ICR, MAX_UPLOAD_BYTES, N_DISTRACTORS, ROOT, Artifacts, free_port

from tests.tiny_model import TINY_MODEL


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    import torch

    from icr.index.build import build_caption_index, build_image_index
    from icr.index.calibration import calibrate_index
    from icr.training.config import load_config
    from icr.training.data.synthetic.generate import write_dataset
    from icr.training.train import train

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("api")
    data = root / "data"
    write_dataset(data, train=160, val=40, test=40, image_size=32, seed=0)
    run = root / "run"
    config = load_config(
        None,
        [
            f'data.path="{data}"',
            f'train.out="{run}"',
            "train.batch_size=32",
            "train.epochs=2",
            "data.val_images=40",
            "train.threads=1",
            "train.seed=0",
            *TINY_MODEL,
        ],
    )
    train(config, progress=False)
    checkpoint = run / "last"
    images, captions = root / "index" / "images", root / "index" / "captions"
    build_image_index(checkpoint, data, distractors=N_DISTRACTORS, out=images, progress=False, gpu="off")
    build_caption_index(checkpoint, data, out=captions, progress=False, gpu="off")
    calibrate_index(images, progress=False, generated=200)
    return Artifacts(data, checkpoint, images, captions, root)


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


@pytest.fixture(scope="session")
def make_server(artifacts: Artifacts, tmp_path_factory: pytest.TempPathFactory):
    """Factory of servers over the session's artifacts; every one is stopped at the end."""
    started: list[Server] = []

    def make(
        jobs_db: Path | None = None,
        extra_args: list[str] | None = None,
        index: Path | None = None,
        **env: str,
    ) -> Server:
        """``index``: serve this image index folder (e.g. a copy with another calibration.json)."""
        folder = tmp_path_factory.mktemp("server")
        server = Server(
            [
                "--index",
                str(index or artifacts.images),
                "--caption-index",
                str(artifacts.captions),
                *(extra_args or []),
            ],
            # the server's own state (feedback.sqlite) in the test's folder, never the user's home
            server_env(artifacts, jobs_db or folder / "jobs.sqlite", **{"ICR_STATE_DIR": str(folder), **env}),
            folder / "server.log",
        )
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(make_server) -> Iterator[Server]:
    yield make_server().start()


@pytest.fixture(scope="session")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c
