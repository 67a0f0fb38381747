"""Training configuration: TOML files plus ``--set key=value`` overrides, validated into a typed config.

:class:`TrainConfig` holds every default and its description. Unknown keys are errors (a typo must
not silently train with a default); ``model`` and ``decoding`` are validated by the code that
consumes them (the model builder, the target decoders). ``[loss]`` holds ``name`` plus one table of
parameters per objective (``[loss.ntxent] temperature = 0.05``), so ``--set loss.name=...`` switches
objectives without tripping over another objective's parameters.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from icr.core.contracts import validated
from icr.core.devices import Device
from icr.training.losses import load_all

SHIPPED_DIR = Path(__file__).resolve().parent / "configs"
_FREE_FORM = ("loss",)  # [loss.<objective>] tables: checked against the registry in _check_loss
# Assignments are validated too, so a config changed in code is held to the same types as a file.
_SECTION = ConfigDict(strict=True, extra="forbid", validate_assignment=True)


class DataSection(BaseModel):
    """``[data]``: which dataset, which splits, how batches find their positives."""

    model_config = _SECTION
    path: str = Field(
        "icr-demo/data", description="Karpathy JSON (file or folder with images) or precomp folder"
    )
    train_split: str = "train"
    val_split: str = "val"
    captions_per_image: int = Field(5, ge=1)
    val_images: int = Field(
        1000, ge=0, description="validate on the first N images of the val split (0 = all)"
    )
    preload: Literal["auto"] | bool = Field(
        "auto", description="decode all training images into memory (auto: when they fit in 2 GiB)"
    )
    cache_dir: str = Field("", description="LTD targets; default: <data>/.icr-cache")
    positives: Literal["annotations", "ground_truth"] = Field(
        "annotations",
        description="which pairs of a batch are positives: a caption and its own image (annotations), "
        "or, on the embedded benchmark, every image the caption is true of (ground_truth), so no "
        "relevant pair is ever used as a negative",
    )


class OptimSection(BaseModel):
    """``[optim]``: the optimizer and its learning-rate schedule."""

    model_config = _SECTION
    optimizer: Literal["adam", "adamw"] = "adam"
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    schedule: Literal["step", "cosine", "cosine_step", "linear", "constant"] = Field(
        "step",
        description="step (x gamma every lr_update epochs) | cosine (one value per epoch) | cosine_step "
        "(per step, to 0 at the last) | linear (to 0) | constant",
    )
    lr_update: int = Field(15, ge=1, description="epochs between step decays")
    gamma: float = Field(0.1, gt=0)
    warmup_steps: int = Field(0, ge=0, description="linear lr warm-up")
    grad_clip: float = Field(2.0, ge=0, description="max gradient norm, 0 = off")


class TrainSection(BaseModel):
    """``[train]``: the loop, its device and precision, checkpoints and logs."""

    model_config = _SECTION
    epochs: int = Field(30, ge=1)
    max_steps: int = Field(
        0, ge=0, description="stop after this many optimizer steps in total (0 = no limit); resumable"
    )
    batch_size: int = Field(128, ge=1, description="global batch (split over processes under torchrun)")
    seed: int = 0
    device: Device = "auto"
    amp: Literal["auto", "bf16", "fp16", "on", "off"] = Field(
        "auto",
        description="auto (CUDA: bf16 if supported, else fp16; CPU: off) | bf16 | fp16 | on (fp16) | off",
    )
    workers: int = Field(0, ge=0, description="DataLoader worker processes")
    val_every: int = Field(
        1,
        ge=0,
        description="epochs between validations, and after the last epoch; 0 = never (last checkpoint only)",
    )
    patience: int = Field(
        0,
        ge=0,
        description="stop when validation rsum has not improved for this many epochs (0 = run all "
        "epochs): the papers' 'until validation stops improving'; epochs stays the upper bound and "
        "the length the lr schedule is laid out over",
    )
    min_epochs: int = Field(
        0,
        ge=0,
        description="patience cannot stop a run before this many epochs (the papers' regime: the "
        "learning-rate step + 5), so no run is cut short by a noisy dip before its lr decay",
    )
    log_every: int = Field(20, ge=1, description="steps between metrics.jsonl lines")
    save_every: int = Field(500, ge=1, description="steps between resumable training-state saves")
    swa: bool = Field(False, description="average snapshots from the last swa_fraction of every epoch (LTD)")
    swa_fraction: float = Field(0.1, gt=0, le=1)
    swa_snapshots: int = Field(5, ge=1)
    out: str = "runs/default"
    threads: int = Field(0, ge=0, description="torch CPU threads, 0 = torch's default")


class LossSection(BaseModel):
    """``[loss]``: the objective's name, plus one table of parameters per objective (the extras)."""

    model_config = ConfigDict(strict=True, extra="allow", validate_assignment=True)
    name: str = Field("ntxent", description="a registered objective (icr train --list-losses)")

    def params(self) -> dict[str, Any]:
        """Parameters of the selected objective: its ``[loss.<name>]`` table (empty: the defaults)."""
        return dict((self.model_extra or {}).get(self.name, {}))


class TrainConfig(BaseModel):
    """One training run's configuration, every default included (``icr train --show-config``)."""

    model_config = ConfigDict(strict=True, extra="forbid", validate_assignment=True)
    name: str = Field("", description="the run's name; a config file's stem by default")
    data: DataSection = Field(default_factory=DataSection)
    model: dict[str, Any] = Field(
        default_factory=dict,
        description="the towers; training.models.normalize_model_config fills the defaults",
    )
    loss: LossSection = Field(default_factory=LossSection)
    decoding: dict[str, Any] = Field(
        default_factory=dict,
        description="kind = none | ltd | itd, mode = dual | constraint, ...: see training.target_decoding",
    )
    optim: OptimSection = Field(default_factory=OptimSection)
    train: TrainSection = Field(default_factory=TrainSection)

    def as_dict(self) -> dict[str, Any]:
        """The plain JSON form, as checkpoints and the resumable state record it."""
        return self.model_dump(mode="json")


SECTIONS: dict[str, type[BaseModel]] = {"data": DataSection, "optim": OptimSection, "train": TrainSection}


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


def load_config(name_or_path: str | None, overrides: list[str] | None = None) -> TrainConfig:
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
    return typed_config(_merge(TrainConfig().as_dict(), user, strict=True))


def typed_config(config: dict[str, Any]) -> TrainConfig:
    """A complete config dict (every section present) as a :class:`TrainConfig`; ValueError naming the
    section, every bad key and how to fix it."""
    source = f"config {config.get('name') or '(overrides only)'}"
    for section, model in SECTIONS.items():  # one section at a time, so the message names it
        fix = f"Fix it in the TOML file or with --set {section}.KEY=VALUE"
        validated(model, config[section], source, f"[{section}]", fix)
    _check_loss(config["loss"])
    typed = validated(
        TrainConfig, config, source, "config", "Fix it in the TOML file or with --set KEY=VALUE"
    )
    if not typed.data.path:
        raise ValueError("data.path is empty; set it to a dataset folder, e.g. --set data.path=icr-demo/data")
    return typed


def _check_loss(loss: Any) -> None:
    registry = load_all()
    name = loss.get("name") if isinstance(loss, dict) else None
    if name not in registry:
        raise ValueError(
            f"loss.name={name!r} is not an objective; choose one of {', '.join(sorted(registry))}"
        )
    for key, value in loss.items():
        if key != "name" and (key not in registry or not isinstance(value, dict)):
            raise ValueError(
                f"[loss] may hold name and one parameter table per objective "
                f"([loss.ntxent] temperature = 0.05); {key!r} is neither"
            )
