"""Image preprocessing with PIL and numpy only (torchvision is not part of the default install).

The transforms are small frozen dataclasses rather than closures so that DataLoader workers can
pickle them. Randomness comes only from the ``numpy.random.Generator`` passed in, so a training
sample is reproducible from its seed.

Eval: resize the shorter side to ``resize`` (or ``image_size`` when ``resize`` is None), then
center-crop ``image_size`` -- torchvision's ``Resize(256) + CenterCrop(224)`` as used by VSE++/LTD.
Train with ``augment="crop_flip"``: torchvision's ``RandomResizedCrop(image_size)`` (scale
0.08-1, ratio 3/4-4/3) followed by a horizontal flip with p = 0.5.

The ``clip`` image kind follows the Hugging Face image processors instead (CLIP, SigLIP): bicubic
resampling, ``resize_mode = "square"`` for SigLIP (both sides to ``resize``, aspect not kept), and
the centre crop's offset rounded down where torchvision rounds to nearest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from icr.training.models.config import PRETRAINED_PAIR_KINDS, takes_features

_RESAMPLING = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}
_SCALE = (0.08, 1.0)
_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))


def _is_pixels(image: Any, size: int) -> bool:
    """Whether ``image`` is an (S, S, 3) uint8 array, S = ``size``."""
    return isinstance(image, np.ndarray) and image.shape == (size, size, 3) and image.dtype == np.uint8


def _as_rgb(image: Any) -> Image.Image:
    """A PIL RGB image from a PIL image of any mode or an (H, W, 3) uint8 array."""
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(
                f"an image array must be (H, W, 3) uint8, got {image.shape} {image.dtype}; "
                "pass a PIL image or convert the array"
            )
        return Image.fromarray(image, "RGB")
    if not isinstance(image, Image.Image):
        raise ValueError(f"expected a PIL image or an (H, W, 3) uint8 array, got {type(image).__name__}")
    return image if image.mode == "RGB" else image.convert("RGB")


def _resize_shorter(image: Image.Image, size: int, resample: str = "bilinear") -> Image.Image:
    """Shorter side -> ``size``, aspect kept (torchvision ``Resize(int)`` rounding, which the Hugging
    Face processors share)."""
    w, h = image.size
    if min(w, h) == size:
        return image  # exact pixels, no resampling (the synthetic 64x64 images)
    if w <= h:
        new = (size, int(size * h / w))
    else:
        new = (int(size * w / h), size)
    return image.resize(new, _RESAMPLING[resample])


def _resize_square(image: Image.Image, size: int, resample: str) -> Image.Image:
    """Both sides -> ``size`` (SigLIP's processor: the aspect ratio is not kept)."""
    if image.size == (size, size):
        return image
    return image.resize((size, size), _RESAMPLING[resample])


def _center_crop(image: Image.Image, size: int, offset: str = "round") -> Image.Image:
    """The centre ``size`` x ``size`` square; an odd margin is split by rounding the left/top offset
    to nearest (``"round"``, torchvision) or down (``"floor"``, Hugging Face image processors)."""
    w, h = image.size
    if (w, h) == (size, size):
        return image
    if offset == "floor":
        left, top = (w - size) // 2, (h - size) // 2
    else:
        left, top = int(round((w - size) / 2.0)), int(round((h - size) / 2.0))
    return image.crop((left, top, left + size, top + size))


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a RandomResizedCrop box; torchvision's sampling procedure."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(*_SCALE)
        aspect = math.exp(rng.uniform(*_LOG_RATIO))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, left + w, top + h
    # Fallback after 10 misses: the largest central crop within the allowed aspect ratios.
    ratio = width / height
    lo, hi = math.exp(_LOG_RATIO[0]), math.exp(_LOG_RATIO[1])
    if ratio < lo:
        w, h = width, int(round(width / lo))
    elif ratio > hi:
        w, h = int(round(height * hi)), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


@dataclass(frozen=True)
class ImageTransform:
    """PIL image (any mode) or (H, W, 3) uint8 array -> normalised (3, S, S) float32 tensor."""

    image_size: int
    resize: int | None
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    augment: str = "none"
    train: bool = False
    resample: str = "bilinear"  # or "bicubic" (CLIP, SigLIP)
    resize_mode: str = "shorter"  # or "square" (SigLIP)
    crop_offset: str = "round"  # or "floor" (Hugging Face processors), see _center_crop

    def __call__(self, image: Any, rng: np.random.Generator | None = None) -> Tensor:
        img = _as_rgb(image)
        size = self.image_size
        if self.train and self.augment == "crop_flip":
            if rng is None:
                raise ValueError(
                    "the training transform with augment='crop_flip' needs a numpy Generator rng"
                )
            box = random_resized_crop_box(*img.size, rng)
            img = img.resize((size, size), _RESAMPLING[self.resample], box=box)
            if rng.random() < 0.5:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        else:
            if self.resize_mode == "square":
                img = _resize_square(img, self.resize or size, self.resample)
            else:
                img = _resize_shorter(img, self.resize or size, self.resample)
            img = _center_crop(img, size, self.crop_offset)
        return self._normalised(np.asarray(img)[None])[0]  # (3, S, S)

    def stack(
        self, images: Sequence[Any] | np.ndarray, rng_of: Callable[[int], np.random.Generator]
    ) -> Tensor:
        """(N, 3, S, S): the images transformed one by one (``rng_of(j)`` the j-th image's generator)
        and stacked; without augmentation, images already S x S RGB are normalised in one operation."""
        size = self.image_size
        if self.train and self.augment == "crop_flip":
            return torch.stack([self(image, rng_of(j)) for j, image in enumerate(images)])
        plain = (self.resize or size) == size  # nothing resizes an S x S image
        if plain and isinstance(images, np.ndarray) and images.shape[1:] == (size, size, 3):
            if images.dtype == np.uint8:
                return self._normalised(images)  # (N, S, S, 3): a rendered batch, no PIL round trip
        if plain and len(images) and all(_is_pixels(im, size) for im in images):
            return self._normalised(np.stack(list(images)))  # S x S uint8 arrays (preloaded): no PIL either
        rgb = [_as_rgb(image) for image in images]
        if not plain or any(im.size != (size, size) for im in rgb):
            return torch.stack([self(im) for im in rgb])
        return self._normalised(np.stack([np.asarray(im) for im in rgb]))

    def _normalised(self, pixels: np.ndarray) -> Tensor:
        """(N, S, S, 3) uint8 -> (N, 3, S, S) float32, scaled to [0, 1] and normalised per channel.

        The result is channels_last in memory (a permuted view of the pixel order), which is what
        the CNN's convolutions want on CPU: no transposing copy here and none in the model.
        """
        mean, std = torch.tensor(self.mean), torch.tensor(self.std)  # (3,) float32
        pixels = np.require(pixels, requirements=("C", "W"))  # from_numpy warns on a read-only array
        x = torch.from_numpy(pixels).to(torch.float32).div_(255.0)  # (N, S, S, 3)
        return x.sub_(mean).div_(std).permute(0, 3, 1, 2)  # (N, 3, S, S), channels_last strides


@dataclass(frozen=True)
class FeatureTransform:
    """Precomputed features (R, F) regions or (F,) vector -> float32 tensor of the same shape."""

    feature_dim: int

    def __call__(self, features: Any, rng: np.random.Generator | None = None) -> Tensor:  # noqa: ARG002 (no aug.)
        arr = np.asarray(features, dtype=np.float32)
        if arr.ndim not in (1, 2) or arr.shape[-1] != self.feature_dim:
            raise ValueError(
                f"precomputed image features must be (R, {self.feature_dim}) or ({self.feature_dim},), "
                f"got shape {arr.shape}; set model.image.feature_dim to the dataset's feature size"
            )
        return torch.from_numpy(np.ascontiguousarray(arr))

    def stack(
        self,
        features: Sequence[Any] | np.ndarray,
        rng_of: Callable[[int], np.random.Generator],  # noqa: ARG002 (no randomness)
    ) -> Tensor:
        """(N, R, F) or (N, F): the samples' features stacked (no randomness)."""
        return torch.stack([self(f) for f in features])


def build_image_transform(image_cfg: dict[str, Any], train: bool) -> ImageTransform | FeatureTransform:
    """The transform of a normalised image config (see :mod:`training.models.config`)."""
    if takes_features(image_cfg):
        return FeatureTransform(image_cfg["feature_dim"])
    conventions = _processor_conventions(image_cfg)  # first: it names the unfilled keys of a clip config
    return ImageTransform(
        image_size=image_cfg["image_size"],
        resize=image_cfg["resize"],
        mean=tuple(image_cfg["mean"]),
        std=tuple(image_cfg["std"]),
        augment=image_cfg["augment"],
        train=train,
        **conventions,
    )


def _processor_conventions(image_cfg: dict[str, Any]) -> dict[str, str]:
    """Resampling, resize mode and crop rounding: the Hugging Face processor's for a pretrained pair
    (``clip``), torchvision's (the dataclass defaults) for every other kind."""
    if image_cfg.get("kind") not in PRETRAINED_PAIR_KINDS:
        return {}
    unfilled = [
        key for key in ("image_size", "resample", "resize_mode", "mean", "std") if image_cfg[key] is None
    ]
    if unfilled:
        raise ValueError(
            f"model.image {unfilled} are null: build the model (it fills them in from model.image.path) "
            "before asking for its image transform"
        )
    return {
        "resample": image_cfg["resample"],
        "resize_mode": image_cfg["resize_mode"],
        "crop_offset": "floor",
    }


def preprocessing_summary(image_cfg: dict[str, Any]) -> dict[str, Any]:
    """What a consumer of a checkpoint (index builder, service) needs to feed the image tower."""
    if takes_features(image_cfg):
        return {"input": "features", "feature_dim": image_cfg["feature_dim"]}
    keys = ("image_size", "resize", "mean", "std", "augment")
    return {"input": "image", **{k: image_cfg[k] for k in keys}, **_processor_conventions(image_cfg)}
