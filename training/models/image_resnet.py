"""ImageNet ResNet image tower (VSE++ / ECIR / LTD) with a pretrained backbone from a local path.

``model.image.path`` decides the backbone library:

* a folder -> transformers ``ResNetModel`` (``config.json`` + weights, e.g. microsoft/resnet-50);
* a file   -> a torchvision ``resnet50``/``resnet152`` ``state_dict`` (``.pth``); needs torchvision,
  which is only in the ``[gpu]`` extra, so it is imported here, lazily, inside a try.

The builder records the backbone's structure in ``model.image.backbone`` so a checkpoint rebuilds
it without the original path (the weights then come from the checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from icr.training.models.heads import l2norm, projection_head
from icr.training.models.hf_loading import config_dict, load_pretrained, model_from_config_dict

_WHAT = "the ResNet image backbone"


class _HFResNet(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> Tensor:
        pooled: Tensor = self.model(pixel_values=images).pooler_output  # (B, F, 1, 1)
        return pooled.flatten(1)  # (B, F)


class _TorchvisionResNet(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model  # its fc is an Identity: the output is the pooled 2048-d feature

    def forward(self, images: Tensor) -> Tensor:
        features: Tensor = self.model(images)  # (B, F)
        return features


def _torchvision_resnet(arch: str) -> tuple[nn.Module, int]:
    try:
        import torchvision  # noqa: PLC0415 (torchvision: the optional [gpu] extra)
    # Not only ImportError: a CUDA-built wheel on CPU torch fails with OSError/RuntimeError.
    except Exception as err:
        raise ValueError(
            f"a torchvision ResNet backbone needs torchvision, which does not import here ({err}); install "
            "the [gpu] extra, or set model.image.path to a Hugging Face ResNet folder (microsoft/resnet-50)"
        ) from None
    model = getattr(torchvision.models, arch)(weights=None)
    feature_dim = model.fc.in_features
    model.fc = nn.Identity()
    return model, feature_dim


def _load_torchvision_weights(model: nn.Module, path: Path) -> None:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{path}: cannot read a torchvision state_dict from this file ({err})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a torchvision ResNet state_dict, got {type(state).__name__}")
    state = {k: v for k, v in state.items() if not k.startswith("fc.")}  # the classifier is not used
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{path}: weights do not fit torchvision's {type(model).__name__}: {err}") from None


def build_backbone(cfg: dict[str, Any], load_weights: bool) -> tuple[nn.Module, dict[str, Any], int]:
    """(backbone module mapping (B, 3, H, W) -> (B, F), its structure dict, F)."""
    if load_weights:
        if cfg["path"] is None:
            raise ValueError(
                "model.image.path is required for a resnet image tower: a local Hugging Face ResNet folder "
                "(config.json + weights) or a torchvision .pth state_dict; nothing is downloaded"
            )
        path = Path(cfg["path"])
        if path.is_dir():
            hf_model = load_pretrained(path, _WHAT, attention=False)
            if hf_model.config.model_type != "resnet":
                raise ValueError(
                    f"{path}: expected a ResNet model folder, got model_type {hf_model.config.model_type!r}"
                )
            return (
                _HFResNet(hf_model),
                {"library": "transformers", "config": config_dict(hf_model.config)},
                int(hf_model.config.hidden_sizes[-1]),
            )
        if path.is_file():
            model, dim = _torchvision_resnet(cfg["arch"])
            _load_torchvision_weights(model, path)
            return _TorchvisionResNet(model), {"library": "torchvision", "arch": cfg["arch"]}, dim
        raise ValueError(f"{path}: model.image.path does not exist; give a local ResNet folder or .pth file")

    structure = cfg["backbone"]
    if not isinstance(structure, dict) or structure.get("library") not in ("transformers", "torchvision"):
        raise ValueError(
            "model.image.backbone does not describe a ResNet (expected {'library': 'transformers' or "
            "'torchvision', ...}); build the model from model.image.path instead"
        )
    if structure["library"] == "torchvision":
        arch = structure.get("arch")
        if arch not in ("resnet50", "resnet152"):
            raise ValueError(f"model.image.backbone.arch must be resnet50 or resnet152, got {arch!r}")
        model, dim = _torchvision_resnet(arch)
        return _TorchvisionResNet(model), dict(structure), dim
    hf_model = model_from_config_dict(structure.get("config") or {}, _WHAT, attention=False)
    return _HFResNet(hf_model), dict(structure), int(hf_model.config.hidden_sizes[-1])


class ResNetImageEncoder(nn.Module):
    """Backbone -> pooled (B, F) -> head -> L2.

    ``head_layers=1`` is VSE++/ECIR: the pooled features are L2-normalised, then ``Linear(F, D)``.
    ``head_layers=2`` is LTD: ``Linear(F, F) -> ReLU -> Linear(F, D)`` (no biases, Xavier).
    """

    def __init__(self, cfg: dict[str, Any], embed_dim: int, load_weights: bool) -> None:
        super().__init__()
        self.cfg = cfg  # shared with DualEncoder.config["image"]: the builder fills in "backbone"
        self.backbone, cfg["backbone"], feature_dim = build_backbone(cfg, load_weights)
        self.feature_dim = feature_dim
        self.head = projection_head(feature_dim, embed_dim, cfg["head_layers"], cfg["batchnorm_head"])
        self.set_finetune(cfg["finetune"])

    def set_finetune(self, enabled: bool) -> None:
        """Train the backbone (True) or keep it frozen (False); recorded in the config."""
        self.cfg["finetune"] = bool(enabled)
        self.backbone.requires_grad_(bool(enabled))
        self.train(self.training)

    def train(self, mode: bool = True) -> ResNetImageEncoder:
        super().train(mode)
        if not self.cfg["finetune"]:
            # A frozen backbone stays in eval mode even under model.train(): in train mode its
            # BatchNorm layers would normalise with batch statistics and keep updating their running
            # statistics, so "frozen" features would drift (the ECIR copy of VSE++ does exactly
            # this, seed notes 2.3) and would differ between the training step and evaluation.
            self.backbone.eval()
        return self

    def forward(self, images: Tensor) -> Tensor:
        """``images``: (B, 3, H, W) normalised pixels -> (B, D) unit embeddings."""
        with torch.set_grad_enabled(self.cfg["finetune"] and torch.is_grad_enabled()):
            features = self.backbone(images)  # (B, F)
        if self.cfg["head_layers"] == 1:
            features = l2norm(features)  # VSE++ normalises the CNN features before the FC
        return l2norm(self.head(features))  # (B, D)
