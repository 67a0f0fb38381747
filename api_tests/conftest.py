"""Fixtures of the black-box API tests: small real artifacts, and real `icr serve` processes.

The artifacts (a synthetic dataset, a tiny model trained for a few steps, an image index with
generated distractors, a caption index and a calibration) are built once per session in-process;
the server is a separate `icr serve` process on 127.0.0.1 that the tests only reach over HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_support import N_DISTRACTORS, Artifacts, Server, server_env

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
