"""Checkpoint directories: ``model.safetensors`` + a self-describing ``config.json``.

``config.json`` holds everything needed to rebuild and use the model without training code:
the model config (including the structure of any pretrained network), the vocabulary or a
reference to the tokenizer copy in ``tokenizer/``, the image preprocessing, the embedding size and
metric, the sha256 of the weights, and whatever the trainer passes as ``meta`` (objective and its
parameters, data fingerprint, step, epoch, metrics).

A checkpoint is written to a temporary sibling directory and renamed into place, so a crash never
leaves a half-written checkpoint where a complete one is expected. The resumable training state
(optimizer, scheduler, RNG) does not belong in this directory: saving replaces the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save_file

from icr.core.atomic import fsync_file, sha256_file, staged_dir
from icr.core.contracts import validated
from icr.training.data.vocab import Vocabulary
from icr.training.models import DualEncoder, build_model

FORMAT = "icr-checkpoint"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
HINT = "Re-run `icr train`, or point --checkpoint at a directory written by `icr train`."
RESERVED_KEYS = (
    "format",
    "format_version",
    "model",
    "vocab",
    "tokenizer",
    "preprocessing",
    "embed_dim",
    "metric",
    "weights_sha256",
)


# --- writing --------------------------------------------------------------------------------------
def _weights_to_save(model: DualEncoder) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> contiguous CPU tensor, alias -> kept name) with tied tensors stored once.

    safetensors refuses tensors that share memory; a tied weight (the same tensor under two names)
    is written under its first name and recorded as an alias so loading can check it.
    """
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = tensor.detach().to("cpu").contiguous()
    return kept, aliases


def check_replaceable(directory: Path) -> None:
    """Refuse to replace a non-empty directory that is not a checkpoint (it may hold user data);
    :func:`save_checkpoint` checks it, and a command may check it before minutes of work."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise ValueError(f"{directory}: exists and is not a directory; choose another checkpoint path")
    if not any(directory.iterdir()):
        return
    try:
        read_checkpoint_config(directory)
    except (ValueError, FileNotFoundError):
        raise ValueError(
            f"{directory}: exists, is not empty and is not a checkpoint; refusing to replace it. "
            "Choose a new checkpoint directory or remove this one."
        ) from None


def save_checkpoint(directory: str | os.PathLike[str], model: DualEncoder, meta: dict[str, Any]) -> Path:
    """Write ``model`` and ``meta`` as a checkpoint directory; returns its path.

    An existing checkpoint at ``directory`` is replaced only once the new one is complete.
    ``meta`` must be JSON-serialisable and must not use the reserved keys (``RESERVED_KEYS``).
    """
    directory = Path(directory)
    clash = sorted(set(meta) & set(RESERVED_KEYS))
    if clash:
        raise ValueError(f"meta keys {clash} are reserved for the checkpoint format; rename them")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as err:
        raise ValueError(f"checkpoint meta must be JSON-serialisable: {err}") from None
    check_replaceable(directory)
    with staged_dir(directory) as tmp:
        weights, aliases = _weights_to_save(model)
        weights_path = tmp / WEIGHTS_FILE
        save_file(weights, str(weights_path), metadata={"format": "pt", "aliases": json.dumps(aliases)})
        fsync_file(weights_path)
        tokenizer = None
        if model.tokenizer_saver is not None:
            model.tokenizer_saver(tmp / TOKENIZER_DIR)
            tokenizer = TOKENIZER_DIR
        config = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model": model.config,
            "vocab": model.vocab.to_dict() if model.vocab is not None else None,
            "tokenizer": tokenizer,
            "preprocessing": model.preprocessing,
            "embed_dim": model.embed_dim,
            "metric": "cosine",
            "weights_sha256": sha256_file(weights_path),
            **meta,
        }
        config_path = tmp / CONFIG_FILE
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        fsync_file(config_path)
    return directory


class CheckpointMeta(BaseModel):
    """A checkpoint's ``config.json``: what every reader relies on, then what the trainer records.

    Returned by :func:`read_checkpoint_config` and :func:`load_checkpoint`. Keys a later version may
    add are kept (``extra="allow"``) so an older reader can still load the model.
    """

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    format: Literal["icr-checkpoint"]
    format_version: Literal[1]
    model: dict[str, Any]
    vocab: dict[str, Any] | None
    tokenizer: str | None  # the tokenizer folder inside the checkpoint, for transformer towers
    preprocessing: dict[str, Any] = Field(default_factory=dict)
    embed_dim: int = Field(ge=1)
    metric: Literal["cosine", "inner_product"]
    weights_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    # written by the trainer (``Trainer.checkpoint_meta``); absent from a checkpoint written otherwise
    objective: dict[str, Any] | None = None  # name, params, the learned logit scale if any
    decoding: dict[str, Any] | None = None  # the [decoding] section it trained with
    data: dict[str, Any] | None = None  # path, kind, train_split, fingerprint of the training data
    step: int | None = None
    epoch: int | None = None
    val_metrics: dict[str, float] | None = None  # the validation that made it best/ (None: last/)
    train_config: dict[str, Any] | None = None  # the whole TrainConfig, as its JSON form

    @property
    def captions_per_image(self) -> int:
        """``data.captions_per_image`` it was trained with (5, the default, when not recorded): every
        later reader of the dataset (index build, calibrate, evaluate, COCOS) must use the same."""
        data = (self.train_config or {}).get("data") or {}
        return int(data.get("captions_per_image", 5))

    def as_dict(self) -> dict[str, Any]:
        """The ``config.json`` document, every key it holds."""
        return self.model_dump(mode="json")


# --- reading --------------------------------------------------------------------------------------
def _checkpoint_dir(directory: str | os.PathLike[str]) -> Path:
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"{directory}: checkpoint directory not found. {HINT}")
    if not directory.is_dir():
        raise ValueError(f"{directory}: a checkpoint is a directory, this is a file. {HINT}")
    return directory


def read_checkpoint_config(directory: str | os.PathLike[str]) -> CheckpointMeta:
    """The checkpoint's ``config.json``, checked for format and version; weights are not read."""
    path = _checkpoint_dir(directory) / CONFIG_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: checkpoint config not found. {HINT}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read the checkpoint config ({err}). {HINT}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path}:{err.lineno}:{err.colno}: checkpoint config is not valid JSON ({err.msg}). {HINT}"
        ) from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ValueError(f"{path}: not an icr checkpoint config (format is not {FORMAT!r}). {HINT}")
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path}: checkpoint format_version {version!r}, this code reads version {FORMAT_VERSION} "
            f"(use the icr release that wrote it). {HINT}"
        )
    return validated(CheckpointMeta, config, str(path), "checkpoint config", HINT)


def checkpoint_sha256(directory: str | os.PathLike[str]) -> str:
    """The sha256 of the checkpoint's weights as recorded in ``config.json`` (its identity).

    Cheap: the weights are not re-hashed here; :func:`load_checkpoint` verifies the record.
    """
    return read_checkpoint_config(directory).weights_sha256


def _read_weights(path: Path, expected_sha: str) -> dict[str, torch.Tensor]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: checkpoint weights not found. {HINT}") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read the checkpoint weights ({err}). {HINT}") from None
    actual = hashlib.sha256(data).hexdigest()  # hashed and parsed from the same bytes
    if actual != expected_sha:
        raise ValueError(
            f"{path}: sha256 {actual[:12]}... does not match {expected_sha[:12]}... recorded in "
            f"{CONFIG_FILE}; the weights file is truncated, corrupt or from another checkpoint. {HINT}"
        )
    try:
        return load_safetensors_bytes(data)
    except (SafetensorError, ValueError, RuntimeError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err}). {HINT}") from None


def _load_weights(model: DualEncoder, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Copy ``weights`` into ``model``; ValueError if they do not fit the config's architecture."""
    own = model.state_dict()
    wrong = [
        f"{name} {tuple(t.shape)} in the file vs {tuple(own[name].shape)} in the config"
        for name, t in weights.items()
        if name in own and t.shape != own[name].shape
    ]
    if wrong:
        raise ValueError(
            f"{path}: weights do not match the model described by {CONFIG_FILE}: {len(wrong)} shape "
            f"mismatch(es), e.g. {'; '.join(wrong[:3])}. {HINT}"
        )
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # A tied weight is stored once: a name missing from the file is fine if it shares memory with
    # a name that was loaded.
    loaded_ptrs = {own[name].data_ptr() for name in weights if name in own}
    missing = [name for name in missing if own[name].data_ptr() not in loaded_ptrs]
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match the model described by {CONFIG_FILE} (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}). {HINT}"
        )


def load_checkpoint(
    directory: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> tuple[DualEncoder, CheckpointMeta]:
    """(model in eval mode on ``device``, its ``config.json``). Uses no training code.

    Checks the format version and the weights' sha256; every problem is a ValueError or
    FileNotFoundError naming the file and saying what to do.
    """
    directory = _checkpoint_dir(directory)
    config = read_checkpoint_config(directory)
    config_path = directory / CONFIG_FILE
    weights = _read_weights(directory / WEIGHTS_FILE, config.weights_sha256)
    vocab = None
    if config.vocab is not None:
        try:
            vocab = Vocabulary.from_dict(config.vocab)
        except ValueError as err:
            raise ValueError(f"{config_path}: bad vocabulary: {err}. {HINT}") from None
    tokenizer_dir = None
    if config.tokenizer is not None:
        tokenizer_dir = directory / config.tokenizer
        if not tokenizer_dir.is_dir():
            raise FileNotFoundError(f"{tokenizer_dir}: the checkpoint's tokenizer folder is missing. {HINT}")
    try:
        model = build_model(config.model, vocab, load_weights=False, tokenizer_dir=tokenizer_dir)
    except ValueError as err:
        raise ValueError(f"{config_path}: cannot rebuild the model: {err}. {HINT}") from None
    _load_weights(model, weights, directory / WEIGHTS_FILE)
    model.to(device)
    model.eval()
    return model, config
