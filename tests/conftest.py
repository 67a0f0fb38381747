"""Fixtures shared by the unit tests: one tiny embedded benchmark and one tiny trained checkpoint per
session (seconds on a 2-core CPU), instead of one per test module. Tests treat both as read-only:
whatever a test writes goes under its own ``tmp_path``."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_model import TINY_MODEL

from icr.training.config import load_config
from icr.training.data.synthetic.generate import write_dataset


@pytest.fixture(scope="session")
def tiny_benchmark(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded benchmark at 32 px: 40 train, 12 val and 12 test images (seed 0)."""
    out = tmp_path_factory.mktemp("tiny-benchmark") / "data"
    write_dataset(out, train=40, val=12, test=12, image_size=32, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_benchmark: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smallest model (tests/tiny_model.py) after 3 training steps on the tiny benchmark."""
    from icr.training.train import train

    run = tmp_path_factory.mktemp("tiny-checkpoint") / "run"
    config = load_config(
        None,
        [
            f'data.path="{tiny_benchmark}"',
            f'train.out="{run}"',
            "train.batch_size=8",
            "train.epochs=1",
            "train.max_steps=3",
            "data.val_images=12",
            "train.threads=1",
            "train.seed=0",
            *TINY_MODEL,
        ],
    )
    train(config, progress=False)
    return run / "last"


@pytest.fixture(scope="module")
def faiss_one_thread():
    """FAISS on one thread for a module (``pytestmark = pytest.mark.usefixtures("faiss_one_thread")``):
    the machine may be shared with a training job, and small indices gain nothing from threads."""
    from icr.index.vector_index import omp_threads

    with omp_threads(1):
        yield
