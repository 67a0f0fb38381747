"""A run's resumable state: ``train_state.pt`` in ``train.out``, written atomically and read back only
under the config that wrote it.

The file holds the config (as its JSON form), the loop's position (:class:`RunState`), the module,
optimizer and AMP-scaler states the trainer passes in, and every random generator's state, so a
resumed run continues bit for bit.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from icr.core.atomic import atomic_write
from icr.training.config import TrainConfig

STATE_FILE = "train_state.pt"
FORMAT_VERSION = 1
# [train] keys that may change between a run and its resume: longer runs, other logging or threads
RESUMABLE_CHANGES = ("max_steps", "epochs", "workers", "log_every", "save_every", "threads")


class ConfigMismatchError(ValueError):
    """``--resume`` of a run whose ``train_state.pt`` was written with another config."""


@dataclass
class RunState:
    """What a resumed run must restore besides module and optimizer states."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    best_rsum: float = -1.0
    best_epoch: int = -1
    history: list[dict[str, Any]] = field(default_factory=list)


def comparable(config: dict[str, Any]) -> dict[str, Any]:
    """A config's JSON form minus the keys that may change between a run and its resume."""
    out: dict[str, Any] = json.loads(json.dumps(config))  # a deep copy
    for key in RESUMABLE_CHANGES:
        out["train"].pop(key, None)
    return out


def write_state(path: Path, config: TrainConfig, run: RunState, modules: dict[str, Any]) -> None:
    """``modules``: name -> state_dict (or None); a crash mid-write keeps the previous file."""
    state = {
        "format_version": FORMAT_VERSION,
        "config": config.as_dict(),
        "run": asdict(run),
        **modules,
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
    }
    atomic_write(path, lambda handle: torch.save(state, handle))


def read_state(
    path: Path, config: TrainConfig, device: torch.device
) -> tuple[RunState, dict[str, Any]] | None:
    """The run state and the module states in ``path`` (None when there is no file), with every random
    generator restored; ConfigMismatchError when the file was written under another config."""
    if not path.is_file():
        return None
    try:
        # weights_only=False: the file holds numpy's and Python's generator states beside the tensors
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise ValueError(f"{path}: cannot read the training state ({e}); delete it to restart") from None
    if comparable(state["config"]) != comparable(config.as_dict()):
        raise ConfigMismatchError(
            f"{path} was written by a run with a different config; resume with the "
            "same config and --set values, or choose a new train.out"
        )
    rng = state.pop("rng")
    torch.set_rng_state(rng["torch"].cpu())
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        # map_location moved the saved states to the GPU; the setter takes CPU byte tensors
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
    return RunState(**state.pop("run")), state
