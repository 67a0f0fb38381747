"""A stock CLIP or SigLIP folder as an icr checkpoint, with no training (`icr model import`).

The checkpoint holds the model the trainer would build from the folder with both towers frozen
(``finetune = false``): the pretrained towers, their own projection heads and the logit scale as
loaded (:mod:`training.models.clip_towers`), the folder's tokenizer and processor settings. Its
embeddings are the stock model's ``get_text_features`` / ``get_image_features``, L2-normalised.
``config.json`` records where it came from (``imported_from``: the folder, its ``model_type`` and
the sha256 of each weights file) and no training (``step`` and ``epoch`` null).

Everything the import needs is checked before any weight is read, each with an error that names
the folder and says how to fix it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icr.core.atomic import sha256_file
from icr.training.checkpoint import CheckpointMeta, check_replaceable, read_checkpoint_config, save_checkpoint
from icr.training.models import DualEncoder, build_model
from icr.training.models.clip_towers import FAMILIES, PROCESSOR_FILE, embedding_size
from icr.training.models.hf_loading import load_config

# model_type -> the class whose save_pretrained writes such a folder
MODEL_CLASSES = {"clip": "CLIPModel", "siglip": "SiglipModel"}
# The weights save_pretrained writes: one file, or shards with their index.
WEIGHT_PATTERNS = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin")
# Any one of these holds a tokenizer's vocabulary (fast JSON, BPE vocab, SentencePiece).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "spiece.model", "sentencepiece.bpe.model")
_SAVE_HINT = (
    "save the processor into the folder too, on a machine with network: "
    "{processor}.from_pretrained(NAME).save_pretrained(FOLDER) (it writes the tokenizer and "
    f"{PROCESSOR_FILE})"
)


@dataclass(frozen=True)
class StockFolder:
    """A local CLIP/SigLIP folder that passed every check: its family and its weights files."""

    path: Path
    model_type: str  # one of FAMILIES
    weights: tuple[Path, ...]

    def hint(self) -> str:
        processor = "CLIPProcessor" if self.model_type == "clip" else "SiglipProcessor"
        return _SAVE_HINT.format(processor=processor)


def _model_type(folder: Path) -> str:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{folder}: not a Hugging Face model folder (no config.json); point it at a folder written by "
            "CLIPModel or SiglipModel.save_pretrained"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_path}: cannot read the model config ({err})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in FAMILIES:
        supported = ", ".join(f"{t!r} ({cls})" for t, cls in MODEL_CLASSES.items())
        raise ValueError(
            f"{config_path}: model_type {model_type!r} cannot be imported; supported: {supported}, "
            "a full dual-encoder folder (not one tower, such as CLIPVisionModel)"
        )
    return str(model_type)


def inspect_folder(folder: str | os.PathLike[str]) -> StockFolder:
    """The folder's family and weights, after checking that it holds everything an import needs:
    config.json of a supported model_type, weights, a tokenizer and ``preprocessor_config.json``."""
    path = Path(folder).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path}: model folder not found")
    if not path.is_dir():
        raise ValueError(f"{path}: is a file; point at the model folder that holds config.json")
    stock = StockFolder(path, _model_type(path), ())
    weights = sorted({p for pattern in WEIGHT_PATTERNS for p in path.glob(pattern) if p.is_file()})
    if not weights:
        raise FileNotFoundError(
            f"{path}: no weights ({' or '.join(WEIGHT_PATTERNS)}); the folder must be written by "
            f"{MODEL_CLASSES[stock.model_type]}.save_pretrained"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{path}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); {stock.hint()}"
        )
    if not (path / PROCESSOR_FILE).is_file():
        # The family's defaults would be a guess about the model's image size and normalisation.
        raise FileNotFoundError(f"{path}: no {PROCESSOR_FILE} (the image preprocessing); {stock.hint()}")
    return StockFolder(path, stock.model_type, tuple(weights))


def stock_model_config(folder: StockFolder) -> dict[str, Any]:
    """The model config the trainer would build from the folder with both towers frozen."""
    config = load_config(folder.path, f"the {folder.model_type} model")
    sizes = {tower: embedding_size(config, tower) for tower in ("image", "text")}
    if sizes["image"] != sizes["text"]:
        raise ValueError(
            f"{folder.path}: its image embeddings have {sizes['image']} dimensions and its text "
            f"embeddings {sizes['text']}; a dual encoder needs one space"
        )
    tower = {"kind": "clip", "path": str(folder.path.resolve()), "finetune": False}
    return {"embed_dim": sizes["image"], "logit_scale": "auto", "image": dict(tower), "text": dict(tower)}


def _imported_from(folder: StockFolder, model: DualEncoder, log: Callable[[str], None]) -> dict[str, Any]:
    hashes = {}
    for path in folder.weights:
        log(f"hashing {path.name} ({path.stat().st_size / 2**20:,.1f} MiB)")
        hashes[path.name] = sha256_file(path)
    record: dict[str, Any] = {
        "path": str(folder.path.resolve()),
        "model_type": folder.model_type,
        "weights_sha256": hashes,
    }
    # the model's own, before DualEncoder caps its learned copy at 100 (embeddings never use it)
    scale = getattr(model.image_encoder, "pretrained_logit_scale", None)
    if scale is not None:
        record["pretrained_logit_scale"] = scale
    return record


def _check_out(out: Path, replace: bool) -> None:
    """Refuse before any work: a folder that is not a checkpoint always, a checkpoint unless ``replace``."""
    check_replaceable(out)
    if out.is_dir() and any(out.iterdir()) and not replace:
        raise FileExistsError(f"{out}: already holds a checkpoint; choose another --out or pass --force")


def import_stock_model(
    folder: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    replace: bool = False,
    log: Callable[[str], None] = lambda _message: None,
) -> CheckpointMeta:
    """Write the checkpoint of the stock model in ``folder`` to ``out``; returns its ``config.json``.

    ``out`` is written beside and renamed into place (:func:`save_checkpoint`). An existing
    checkpoint there is replaced only with ``replace``; any other non-empty folder never.
    ``log`` receives one line per step.
    """
    out = Path(out).expanduser()
    stock = inspect_folder(folder)
    _check_out(out, replace)
    log(f"{stock.path}: {MODEL_CLASSES[stock.model_type]}, {len(stock.weights)} weights file(s)")
    config = stock_model_config(stock)
    log(f"loading the model (both towers frozen, {config['embed_dim']}-d embeddings)")
    model = build_model(config).eval()
    meta = {"imported_from": _imported_from(stock, model, log), "step": None, "epoch": None}
    log(f"writing {out}")
    save_checkpoint(out, model, meta)
    return read_checkpoint_config(out)
