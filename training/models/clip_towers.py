"""Pretrained CLIP / SigLIP towers from a local folder (image kind ``clip``, text kind ``clip``).

The folder is what ``CLIPModel.save_pretrained`` or ``SiglipModel.save_pretrained`` (plus the
tokenizer's and image processor's ``save_pretrained``) writes; its ``model_type`` picks the family,
so one kind serves both:

* image: CLIP's vision transformer -> post-LayerNorm [CLS] -> ``visual_projection``; SigLIP's
  vision transformer -> its attention-pooling head (the pooled output). Then L2.
* text: CLIP's text transformer -> the EOS token's state -> ``text_projection``, captions padded to
  the longest with the attention mask; SigLIP's text transformer -> the last position -> its
  ``head``, captions padded to ``max_len`` and no attention mask: SigLIP was trained that way, and
  its pooled position is the last one, padding included.

The embedding is the model's own (CLIP ``projection_dim``, SigLIP's hidden size), so
``model.embed_dim`` must equal it: no extra head, so an image tower and a text tower from one folder
start aligned, as pretrained.

Training modes (``finetune``, ``finetune_last_n``): frozen (eval mode, no gradients); the last N
transformer layers + the final LayerNorm + the projection; or every weight.

A checkpoint rebuilds the network from ``hf_config`` (the full model's config) and its weights from
the checkpoint, the tokenizer from its copy, and the preprocessing from the keys recorded in the
image config: the original folder is not needed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from icr.training.models.heads import l2norm
from icr.training.models.hf_loading import (
    config_dict,
    load_pretrained,
    load_tokenizer,
    model_from_config_dict,
    unknown_words,
)

if TYPE_CHECKING:  # annotations only: transformers is imported inside hf_loading's functions
    from transformers import PreTrainedModel

FAMILIES = ("clip", "siglip")
PROCESSOR_FILE = "preprocessor_config.json"
# The Hugging Face defaults when a folder has no preprocessor_config.json (OPENAI_CLIP_MEAN/STD,
# IMAGENET_STANDARD_MEAN/STD in transformers.image_utils).
_DEFAULT_MEAN_STD = {
    "clip": ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]),
    "siglip": ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
}
_PIL_RESAMPLING = {2: "bilinear", 3: "bicubic"}  # PIL's codes, as preprocessor_config.json stores them

Cache = dict[tuple[str, str], "PreTrainedModel"]


# --- the pretrained model -------------------------------------------------------------------------
def _check_folder(folder: Path, tower: str) -> None:
    """A clear error for a folder that is missing or not a CLIP/SigLIP model, before loading weights."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"{folder}: model.{tower}.path is not a Hugging Face model folder (no config.json); point it at "
            "a local folder written by CLIPModel/SiglipModel.save_pretrained (nothing is downloaded)"
        )
    try:
        model_type = json.loads(config_path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{config_path}: cannot read the model config ({err})") from None
    if model_type not in FAMILIES:
        raise ValueError(
            f"{folder}: model_type {model_type!r} is not CLIP or SigLIP; the clip tower kind needs a full "
            f"CLIPModel or SiglipModel folder (model_type one of {list(FAMILIES)}), e.g. "
            "CLIPModel.from_pretrained('openai/clip-vit-base-patch32').save_pretrained(folder)"
        )


def pretrained_model(cfg: dict[str, Any], tower: str, load_weights: bool, cache: Cache) -> PreTrainedModel:
    """The full CLIPModel / SiglipModel behind a tower: loaded from ``cfg["path"]`` (training) or
    rebuilt with random weights from ``cfg["hf_config"]`` (a checkpoint supplies the weights).

    ``cache`` is shared by the two towers of one build: both halves of a folder load once.
    """
    what = f"the CLIP/SigLIP {tower} tower"
    if load_weights:
        if cfg["path"] is None:
            raise ValueError(
                f"model.{tower}.path is required for a clip {tower} tower: a local folder saved with "
                "CLIPModel/SiglipModel.save_pretrained; nothing is downloaded"
            )
        folder = Path(cfg["path"]).expanduser()
        key = ("path", str(folder.resolve()))
        if key not in cache:
            _check_folder(folder, tower)
            cache[key] = load_pretrained(folder, what, attention=True)
    else:
        if cfg["hf_config"] is None:
            raise ValueError(
                f"model.{tower}.hf_config is null: build the model from model.{tower}.path instead"
            )
        key = ("config", json.dumps(cfg["hf_config"], sort_keys=True))
        if key not in cache:
            cache[key] = model_from_config_dict(cfg["hf_config"], what, attention=True)
    model = cache[key]
    if model.config.model_type not in FAMILIES:
        raise ValueError(f"{what}: model_type {model.config.model_type!r} is not one of {list(FAMILIES)}")
    cfg["hf_config"] = config_dict(model.config)
    return model


def embedding_size(config: Any, tower: str) -> int:
    """The size of the ``tower`` ("image" or "text") embeddings of a CLIP/SigLIP model's config: CLIP's
    ``projection_dim``; SigLIP's vision width (its pooling head keeps it) or text ``projection_size``."""
    if config.model_type == "clip":
        return int(config.projection_dim)
    if tower == "image":
        return int(config.vision_config.hidden_size)
    return int(config.text_config.projection_size)


def _check_embed_dim(out_dim: int, embed_dim: int, tower: str, family: str) -> None:
    if out_dim != embed_dim:
        raise ValueError(
            f"model.embed_dim is {embed_dim}, but the {family} {tower} tower gives {out_dim}-d embeddings "
            f"(its own projection); set model.embed_dim = {out_dim}"
        )


def _check_last_n(cfg: dict[str, Any], tower: str, layers: int) -> None:
    n = cfg["finetune_last_n"]
    if n is not None and n > layers:
        raise ValueError(
            f"model.{tower}.finetune_last_n = {n}, but the model has {layers} transformer layers; use at "
            f"most {layers}, or null to fine-tune the whole tower"
        )


# --- preprocessing --------------------------------------------------------------------------------
def _square_side(value: Any, key: str) -> int:
    """An int, or {"height": h, "width": w} with h == w (the only crops and squares we reproduce)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if (
        isinstance(value, dict)
        and value.get("height") == value.get("width")
        and isinstance(value.get("height"), int)
    ):
        return int(value["height"])
    raise ValueError(f"{PROCESSOR_FILE}: {key} {value!r} is not supported (a square size is)")


def _rgb_list(value: Any, key: str) -> list[float]:
    values = [value] * 3 if isinstance(value, int | float) else value
    if not (isinstance(values, list) and len(values) == 3):
        raise ValueError(f"{PROCESSOR_FILE}: {key} must be three numbers, got {value!r}")
    return [float(v) for v in values]


def processor_preprocessing(
    processor: dict[str, Any] | None, family: str, vision_size: int
) -> dict[str, Any]:
    """The image config's preprocessing keys that reproduce a Hugging Face image processor.

    ``processor`` is the folder's ``preprocessor_config.json`` (None: the family's defaults at the
    vision model's ``image_size``): CLIP resizes the shorter side and centre-crops, SigLIP resizes
    both sides; both bicubic. Anything our PIL transform cannot reproduce is a ValueError.
    """
    mean, std = _DEFAULT_MEAN_STD[family]
    if processor is None:
        mode = "square" if family == "siglip" else "shorter"
        return {
            "image_size": vision_size,
            "resize": vision_size,
            "resize_mode": mode,
            "resample": "bicubic",
            "mean": list(mean),
            "std": list(std),
        }
    if not processor.get("do_resize", True):
        raise ValueError(f"{PROCESSOR_FILE}: do_resize false is not supported (images of any size arrive)")
    if (
        processor.get("do_rescale", True) is False
        or abs(float(processor.get("rescale_factor", 1 / 255)) - 1 / 255) > 1e-12
    ):
        raise ValueError(f"{PROCESSOR_FILE}: only do_rescale with rescale_factor 1/255 is supported")
    size = processor.get("size", vision_size)
    if isinstance(size, dict) and "shortest_edge" in size:
        if size.get("longest_edge") is not None:
            raise ValueError(f"{PROCESSOR_FILE}: size.longest_edge is not supported")
        resize, mode = int(size["shortest_edge"]), "shorter"
    elif isinstance(size, dict) or family == "siglip":
        resize, mode = _square_side(size, "size"), "square"
    else:  # a bare int: CLIP's processor resizes the shorter side to it (default_to_square false)
        resize, mode = _square_side(size, "size"), "shorter"
    crop = processor.get("do_center_crop", "crop_size" in processor)
    image_size = _square_side(processor.get("crop_size"), "crop_size") if crop else resize
    if processor.get("do_normalize", True):
        mean = _rgb_list(processor.get("image_mean", mean), "image_mean")
        std = _rgb_list(processor.get("image_std", std), "image_std")
    else:
        mean, std = [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]
    resample = processor.get("resample", 3)
    if resample not in _PIL_RESAMPLING:
        raise ValueError(
            f"{PROCESSOR_FILE}: resample {resample!r} is not supported (2 bilinear or 3 bicubic)"
        )
    return {
        "image_size": image_size,
        "resize": resize,
        "resize_mode": mode,
        "resample": _PIL_RESAMPLING[resample],
        "mean": list(mean),
        "std": list(std),
    }


def _read_processor(folder: Path) -> dict[str, Any] | None:
    path = folder / PROCESSOR_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read the image processor config ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _fill_preprocessing(cfg: dict[str, Any], family: str, vision_size: int, load_weights: bool) -> None:
    """Fill the image config's null preprocessing keys from the folder's processor (recorded in
    ``cfg["processor"]``, so a checkpoint refills them identically), then check the crop size."""
    if load_weights:
        cfg["processor"] = _read_processor(Path(cfg["path"]).expanduser())
    derived = processor_preprocessing(cfg["processor"], family, vision_size)
    for key, value in derived.items():
        if cfg[key] is None:
            cfg[key] = value
    if cfg["image_size"] != vision_size:
        raise ValueError(
            f"model.image.image_size is {cfg['image_size']}, but the {family} vision model takes "
            f"{vision_size} x {vision_size} images; leave image_size null (the processor's)"
        )
    if cfg["resize"] < cfg["image_size"]:
        raise ValueError(
            f"model.image.resize ({cfg['resize']}) must be >= model.image.image_size ({cfg['image_size']})"
        )


# --- the towers -----------------------------------------------------------------------------------
class _PretrainedTower(nn.Module):
    """What the two towers share: the trainable parts of each training mode, frozen = eval mode."""

    cfg: dict[str, Any]
    model: nn.Module
    proj: nn.Module | None  # CLIP's projection; SigLIP's lives inside ``model`` (its head)
    pretrained_logit_scale: float | None

    def _layers(self) -> nn.ModuleList:
        encoder: Any = self.model.encoder  # an HF encoder: its layers are a ModuleList
        layers: nn.ModuleList = encoder.layers
        return layers

    def _top(self) -> list[nn.Module]:
        """The final LayerNorm and the projection: trainable in every fine-tuning mode."""
        raise NotImplementedError

    def set_finetune(self, enabled: bool) -> None:
        """Train the tower (the last ``finetune_last_n`` layers + final norm + projection, or all of it)
        or freeze it in eval mode; recorded in the config."""
        self.cfg["finetune"] = bool(enabled)
        n = self.cfg["finetune_last_n"]
        self.requires_grad_(bool(enabled) and n is None)
        if enabled and n is not None:
            layers = self._layers()
            for part in [*layers[len(layers) - n :], *self._top()]:
                part.requires_grad_(True)
        self.train(self.training)

    def train(self, mode: bool = True) -> _PretrainedTower:
        super().train(mode)
        if not self.cfg["finetune"]:
            self.model.eval()  # frozen: no dropout, the embedding is a fixed function of the input
        return self

    def _grad_enabled(self) -> bool:
        # Frozen: no graph at all. Partly unfrozen: autograd starts at the first trainable layer on its own.
        return bool(self.cfg["finetune"]) and torch.is_grad_enabled()


def _logit_scale(model: PreTrainedModel) -> float | None:
    scale = getattr(model, "logit_scale", None)
    return float(scale.detach().reshape(-1)[0]) if isinstance(scale, torch.Tensor) else None


class ClipImageEncoder(_PretrainedTower):
    """(B, 3, S, S) pixels -> vision transformer -> pooled, projected -> (B, D) unit rows."""

    def __init__(self, cfg: dict[str, Any], embed_dim: int, load_weights: bool, cache: Cache) -> None:
        super().__init__()
        self.cfg = cfg  # shared with DualEncoder.config["image"]: the builder fills in the null keys
        full: Any = pretrained_model(cfg, "image", load_weights, cache)  # CLIPModel | SiglipModel
        self.family: str = full.config.model_type
        self.model = full.vision_model
        vision = full.config.vision_config
        if self.family == "clip":
            self.proj = full.visual_projection
        else:
            if not getattr(vision, "vision_use_head", True):
                raise ValueError(
                    "this SigLIP model has no vision pooling head (vision_use_head false); the clip image "
                    "tower needs its pooled output"
                )
            self.proj = None
        _check_embed_dim(embedding_size(full.config, "image"), embed_dim, "image", self.family)
        _check_last_n(cfg, "image", len(self._layers()))
        _fill_preprocessing(cfg, self.family, int(vision.image_size), load_weights)
        self.pretrained_logit_scale = _logit_scale(full)
        self.set_finetune(cfg["finetune"])

    def _top(self) -> list[nn.Module]:
        model: Any = self.model  # CLIPVisionModel | SiglipVisionModel
        return [model.post_layernorm, self.proj if self.proj is not None else model.head]

    def forward(self, images: Tensor) -> Tensor:
        """``images``: (B, 3, S, S) normalised pixels -> (B, D) unit embeddings."""
        with torch.set_grad_enabled(self._grad_enabled()):
            pooled = self.model(pixel_values=images).pooler_output  # (B, H) CLIP, (B, D) SigLIP head
            if self.proj is not None:
                pooled = self.proj(pooled)  # (B, D)
        return l2norm(pooled)  # (B, D)


class ClipTextEncoder(_PretrainedTower):
    """Captions -> the folder's tokenizer -> text transformer -> pooled, projected -> (B, D) unit rows."""

    def __init__(
        self,
        cfg: dict[str, Any],
        embed_dim: int,
        load_weights: bool,
        cache: Cache,
        tokenizer_dir: str | Path | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg  # shared with DualEncoder.config["text"]: the builder fills in hf_config, max_len
        full: Any = pretrained_model(cfg, "text", load_weights, cache)  # CLIPModel | SiglipModel
        self.family: str = full.config.model_type
        self.model = full.text_model
        text = full.config.text_config
        self.proj = full.text_projection if self.family == "clip" else None
        _check_embed_dim(embedding_size(full.config, "text"), embed_dim, "text", self.family)
        _check_last_n(cfg, "text", len(self._layers()))
        positions = int(text.max_position_embeddings)
        if cfg["max_len"] is None:
            cfg["max_len"] = positions
        if cfg["max_len"] > positions:
            raise ValueError(
                f"model.text.max_len is {cfg['max_len']}, but the {self.family} text model has "
                f"{positions} positions; use at most {positions} (null: all of them)"
            )
        source = tokenizer_dir if tokenizer_dir is not None else cfg["path"]
        if source is None:
            raise ValueError("the clip text tower needs its tokenizer: set model.text.path")
        self.tokenizer = load_tokenizer(Path(source).expanduser())
        self._check_tokenizer(text, source)
        self.pretrained_logit_scale = _logit_scale(full)
        self.set_finetune(cfg["finetune"])

    def _check_tokenizer(self, text: Any, source: str | Path) -> None:
        if len(self.tokenizer) > int(text.vocab_size):
            raise ValueError(
                f"{source}: the tokenizer has {len(self.tokenizer)} tokens, the text model's vocab_size "
                f"{text.vocab_size}; the folder's tokenizer does not belong to this model"
            )
        if self.tokenizer.pad_token_id is None:
            raise ValueError(f"{source}: the tokenizer has no pad token; captions cannot be batched")
        # CLIP pools the first EOS token (any eos_token_id but the legacy 2, which pools the largest id)
        eos = getattr(text, "eos_token_id", None)
        if self.family == "clip" and eos != 2 and self.tokenizer.eos_token_id != eos:
            raise ValueError(
                f"{source}: the tokenizer's EOS token id {self.tokenizer.eos_token_id} differs from the text "
                f"model's eos_token_id {eos}; CLIP pools the EOS token, so they must agree"
            )

    def _top(self) -> list[nn.Module]:
        model: Any = self.model  # CLIPTextModel | SiglipTextModel
        return [model.final_layer_norm, self.proj if self.proj is not None else model.head]

    def save_tokenizer(self, directory: str | Path) -> None:
        """Write the tokenizer files so a checkpoint does not depend on the original folder."""
        self.tokenizer.save_pretrained(str(directory))

    def unknown_words(self, text: str) -> list[str]:
        """The words of ``text`` the tokenizer maps to its unknown token."""
        return unknown_words(self.tokenizer, text)

    def tokenize(self, captions: Sequence[str]) -> dict[str, Tensor]:
        """``{"input_ids": (B, T) long, "attention_mask": (B, T) long}``; CLIP: T = the longest caption
        (at most max_len); SigLIP: T = max_len, as it was trained."""
        if isinstance(captions, str):
            raise ValueError("tokenize takes a list of captions, got a single string; wrap it in a list")
        encoded = self.tokenizer(
            list(captions),
            padding="max_length" if self.family == "siglip" else True,
            truncation=True,
            max_length=self.cfg["max_len"],
            return_attention_mask=True,
            return_tensors="pt",
        )
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """``batch`` from :meth:`tokenize` -> (B, D) unit embeddings."""
        with torch.set_grad_enabled(self._grad_enabled()):
            if self.family == "siglip":
                out = self.model(input_ids=batch["input_ids"])  # no mask: see the module docstring
            else:
                out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            pooled = out.pooler_output  # (B, H) CLIP EOS state, (B, D) SigLIP head
            if self.proj is not None:
                pooled = self.proj(pooled)  # (B, D)
        return l2norm(pooled)  # (B, D)
