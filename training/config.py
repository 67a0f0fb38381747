"""Training configuration: TOML files plus ``--set key=value`` overrides, validated against defaults.

A config is a nested dict with the sections below. Unknown keys are errors (a typo must not
silently train with a default); ``model`` and ``decoding`` are validated by the code that consumes
them (the model builder, the target decoders). ``[loss]`` holds ``name`` plus one table of
parameters per objective (``[loss.ntxent] temperature = 0.05``), so ``--set loss.name=...`` switches
objectives without tripping over another objective's parameters.
"""

from __future__ import annotations

import copy
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from icr.core.contracts import validated
from icr.core.devices import Device
from icr.training.losses import load_all

SHIPPED_DIR = Path(__file__).resolve().parent / "configs"
_FREE_FORM = ("loss",)  # [loss.<objective>] tables: checked against the registry in _check

DEFAULTS: dict[str, Any] = {
    "name": "",
    "data": {
        "path": "icr-demo/data",  # Karpathy JSON (file or folder with images) or precomp folder
        "train_split": "train",
        "val_split": "val",
        "captions_per_image": 5,
        "val_images": 1000,  # validate on the first N images of the val split (0 = all)
        "preload": "auto",  # decode all training images into memory when they fit in 2 GiB
        "cache_dir": "",  # LTD targets; default: <data>/.icr-cache
        # Which pairs of a batch are positives: "annotations" (a caption and its own image), or
        # "ground_truth" (embedded benchmark: also every other image the caption is true of, so
        # no relevant pair is ever used as a negative).
        "positives": "annotations",
    },
    "model": {},  # see training.models (normalize_model_config fills the defaults)
    "loss": {"name": "ntxent"},  # + [loss.<name>] tables of parameters
    "decoding": {},  # kind = none | ltd | itd, mode = dual | constraint, ...: see target_decoding.py
    "optim": {
        "optimizer": "adam",  # adam | adamw
        "lr": 2e-4,
        "weight_decay": 0.0,
        # step (x gamma every lr_update epochs) | cosine (one value per epoch) | cosine_step (per
        # step, to 0 at the last) | linear (to 0) | constant
        "schedule": "step",
        "lr_update": 15,
        "gamma": 0.1,
        "warmup_steps": 0,  # linear lr warm-up
        "grad_clip": 2.0,  # max gradient norm, 0 = off
    },
    "train": {
        "epochs": 30,
        "max_steps": 0,  # stop after this many optimizer steps in total (0 = no limit); resumable
        "batch_size": 128,  # global batch (split over processes under torchrun)
        "seed": 0,
        "device": "auto",  # auto | cpu | cuda
        "amp": "auto",  # auto (CUDA: bf16 if supported, else fp16; CPU: off) | bf16 | fp16 | on (fp16) | off
        "workers": 0,  # DataLoader worker processes
        "val_every": 1,  # epochs, and after the last epoch; 0 = never (last checkpoint only)
        # Stop when validation rsum has not improved for this many epochs (0 = run all epochs):
        # "until validation stops improving", the papers' protocol. Epochs stays the upper bound
        # (and the length the lr schedule is laid out over).
        "patience": 0,
        "log_every": 20,  # steps between metrics.jsonl lines
        "save_every": 500,  # steps between resumable training-state saves
        "swa": False,  # average snapshots from the last 10% of every epoch (LTD setting)
        "swa_fraction": 0.1,
        "swa_snapshots": 5,
        "out": "runs/default",
        "threads": 0,  # torch CPU threads, 0 = torch's default
    },
}


def _merge(base: dict[str, Any], override: dict[str, Any], strict: bool, where: str = "") -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        path = f"{where}{key}"
        if strict and key not in base:
            raise ValueError(f"unknown config key {path!r}; valid keys here: {', '.join(sorted(base))}")
        if isinstance(value, dict) and isinstance(base.get(key), dict) and base.get(key):
            # sections are checked key by key, except the free-form ones (checked by their consumers)
            out[key] = _merge(base[key], value, strict and key not in _FREE_FORM, f"{path}.")
        else:
            out[key] = copy.deepcopy(value)
    return out


def resolve_config_path(name_or_path: str) -> Path:
    """A path to a TOML file, or the name of a shipped config (``icr train --list-configs``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = SHIPPED_DIR / f"{name_or_path.removesuffix('.toml')}.toml"
    if shipped.is_file():
        return shipped
    raise FileNotFoundError(
        f"config {name_or_path!r} is neither a file nor a shipped config; shipped configs: "
        f"{', '.join(shipped_configs())}"
    )


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.toml"))


def parse_override(item: str) -> tuple[list[str], Any]:
    """``train.epochs=3`` -> (["train", "epochs"], 3). Values are TOML literals; bare words are strings."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set expects key=value (e.g. train.epochs=3), got {item!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip().split("."), value


def apply_overrides(config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(config)
    for item in overrides:
        keys, value = parse_override(item)
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {key!r} is not a section")
        node[keys[-1]] = value
    return out


def load_config(name_or_path: str | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Defaults <- config file <- overrides, with unknown keys rejected."""
    user: dict[str, Any] = {}
    if name_or_path:
        path = resolve_config_path(name_or_path)
        try:
            user = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML ({e})") from None
        user.setdefault("name", path.stem)
    user = apply_overrides(user, overrides or [])
    config = _merge(DEFAULTS, user, strict=True)
    _check(config)
    return config


class DataSection(BaseModel):
    """``[data]``: which dataset, which splits, how batches find their positives."""

    model_config = ConfigDict(strict=True, extra="forbid")
    path: str
    train_split: str
    val_split: str
    captions_per_image: int = Field(ge=1)
    val_images: int = Field(ge=0)
    preload: Literal["auto"] | bool
    cache_dir: str
    positives: Literal["annotations", "ground_truth"]


class OptimSection(BaseModel):
    """``[optim]``: the optimizer and its learning-rate schedule."""

    model_config = ConfigDict(strict=True, extra="forbid")
    optimizer: Literal["adam", "adamw"]
    lr: float = Field(gt=0)
    weight_decay: float = Field(ge=0)
    schedule: Literal["step", "cosine", "cosine_step", "linear", "constant"]
    lr_update: int = Field(ge=1)
    gamma: float = Field(gt=0)
    warmup_steps: int = Field(ge=0)
    grad_clip: float = Field(ge=0)


class TrainSection(BaseModel):
    """``[train]``: the loop, its device and precision, checkpoints and logs."""

    model_config = ConfigDict(strict=True, extra="forbid")
    epochs: int = Field(ge=1)
    max_steps: int = Field(ge=0)
    batch_size: int = Field(ge=1)
    seed: int
    device: Device
    amp: Literal["auto", "bf16", "fp16", "on", "off"]
    workers: int = Field(ge=0)
    val_every: int = Field(ge=0)
    patience: int = Field(ge=0)
    log_every: int = Field(ge=1)
    save_every: int = Field(ge=1)
    swa: bool
    swa_fraction: float = Field(gt=0, le=1)
    swa_snapshots: int = Field(ge=1)
    out: str
    threads: int = Field(ge=0)


SECTIONS: dict[str, type[BaseModel]] = {"data": DataSection, "optim": OptimSection, "train": TrainSection}


def _check(config: dict[str, Any]) -> None:
    source = f"config {config.get('name') or '(overrides only)'}"
    for section, model in SECTIONS.items():
        fix = f"Fix it in the TOML file or with --set {section}.KEY=VALUE"
        validated(model, config[section], source, f"[{section}]", fix)

    registry = load_all()
    if config["loss"].get("name") not in registry:
        raise ValueError(
            f"loss.name={config['loss'].get('name')!r} is not an objective; choose one of "
            f"{', '.join(sorted(registry))}"
        )
    for key, value in config["loss"].items():
        if key != "name" and (key not in registry or not isinstance(value, dict)):
            raise ValueError(
                f"[loss] may hold name and one parameter table per objective "
                f"([loss.ntxent] temperature = 0.05); {key!r} is neither"
            )
    if not os.fspath(config["data"]["path"]):
        raise ValueError("data.path is empty; set it to a dataset folder, e.g. --set data.path=icr-demo/data")


def loss_params(config: dict[str, Any]) -> dict[str, Any]:
    """Parameters of the selected objective: the ``[loss.<name>]`` table (empty: the defaults)."""
    return dict(config["loss"].get(config["loss"]["name"], {}))
