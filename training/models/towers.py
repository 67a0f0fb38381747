"""Encoder towers by kind, as the objectives are by name: ``build_model`` looks a config's
``image.kind`` and ``text.kind`` up here. A new encoder registers a builder with
:func:`image_tower` or :func:`text_tower` (and its defaults in ``models/config.py``).

The pretrained towers (resnet, transformer, clip) import ``transformers`` only when one is built
(``models/hf_loading.py``): it takes seconds, and a config that never asks for one never pays it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from icr.training.data.vocab import Vocabulary
from icr.training.models.clip_towers import ClipImageEncoder, ClipTextEncoder
from icr.training.models.config import PRETRAINED_PAIR_KINDS
from icr.training.models.image_cnn import ConvImageEncoder
from icr.training.models.image_precomp import PrecompImageEncoder
from icr.training.models.image_resnet import ResNetImageEncoder
from icr.training.models.image_vsrn import VSRNImageEncoder
from icr.training.models.text_gru import GRUTextEncoder
from icr.training.models.text_transformer import TransformerTextEncoder


@dataclass
class TowerContext:
    """What a builder may need besides its own config and the embedding size."""

    load_weights: bool  # True: read pretrained weights; False: rebuild the recorded structure (checkpoints)
    vocab: Vocabulary | None = None
    tokenizer_dir: str | Path | None = None
    # a CLIP/SigLIP folder that both towers use loads once
    clip_cache: dict[Any, Any] = field(default_factory=dict)


ImageBuilder = Callable[[dict[str, Any], int, TowerContext], nn.Module]
# a text tower, and whether the model keeps the word vocabulary (False: the tower has its own tokenizer)
TextBuilder = Callable[[dict[str, Any], int, TowerContext], tuple[nn.Module, bool]]
IMAGE_TOWERS: dict[str, ImageBuilder] = {}
TEXT_TOWERS: dict[str, TextBuilder] = {}


def image_tower(*kinds: str) -> Callable[[ImageBuilder], ImageBuilder]:
    def register(builder: ImageBuilder) -> ImageBuilder:
        for kind in kinds:
            IMAGE_TOWERS[kind] = builder
        return builder

    return register


def text_tower(*kinds: str) -> Callable[[TextBuilder], TextBuilder]:
    def register(builder: TextBuilder) -> TextBuilder:
        for kind in kinds:
            TEXT_TOWERS[kind] = builder
        return builder

    return register


def build_tower(
    towers: dict[str, Any], which: str, cfg: dict[str, Any], embed_dim: int, ctx: TowerContext
) -> Any:
    builder = towers.get(cfg["kind"])
    if builder is None:
        raise ValueError(
            f"unknown {which} tower kind {cfg['kind']!r}; choose one of: {', '.join(sorted(towers))}"
        )
    return builder(cfg, embed_dim, ctx)


@image_tower("cnn")
def _cnn(cfg: dict[str, Any], embed_dim: int, _: TowerContext) -> nn.Module:
    return ConvImageEncoder(cfg, embed_dim)


@image_tower("precomp")
def _precomp(cfg: dict[str, Any], embed_dim: int, _: TowerContext) -> nn.Module:
    return PrecompImageEncoder(cfg, embed_dim)


@image_tower("vsrn")
def _vsrn(cfg: dict[str, Any], embed_dim: int, _: TowerContext) -> nn.Module:
    return VSRNImageEncoder(cfg, embed_dim)


@image_tower("resnet")
def _resnet(cfg: dict[str, Any], embed_dim: int, ctx: TowerContext) -> nn.Module:
    return ResNetImageEncoder(cfg, embed_dim, ctx.load_weights)


@image_tower(*PRETRAINED_PAIR_KINDS)
def _clip_image(cfg: dict[str, Any], embed_dim: int, ctx: TowerContext) -> nn.Module:
    return ClipImageEncoder(cfg, embed_dim, ctx.load_weights, ctx.clip_cache)


@text_tower("gru")
def _gru(cfg: dict[str, Any], embed_dim: int, ctx: TowerContext) -> tuple[nn.Module, bool]:
    if ctx.vocab is None:
        raise ValueError(
            "a gru text tower needs the Vocabulary: pass vocab= (build it from the training captions)"
        )
    return GRUTextEncoder(cfg, embed_dim, ctx.vocab, ctx.load_weights), True


@text_tower("transformer")
def _transformer(cfg: dict[str, Any], embed_dim: int, ctx: TowerContext) -> tuple[nn.Module, bool]:
    return TransformerTextEncoder(cfg, embed_dim, ctx.load_weights, ctx.tokenizer_dir), False


@text_tower(*PRETRAINED_PAIR_KINDS)
def _clip_text(cfg: dict[str, Any], embed_dim: int, ctx: TowerContext) -> tuple[nn.Module, bool]:
    return ClipTextEncoder(cfg, embed_dim, ctx.load_weights, ctx.clip_cache, ctx.tokenizer_dir), False
