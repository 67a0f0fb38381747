"""`icr.load(checkpoint)`: any icr checkpoint as an encoder of captions and images into unit vectors.

The rows are float32 and L2-normalised (cosine = dot product), computed in batches with the
checkpoint's own tokenizer and eval preprocessing, on the CPU or a GPU (``device``).

Image files are opened as a gallery build opens them (:func:`icr.core.image_input.open_image`: the
gallery formats, the pixel and aspect-ratio bounds, EXIF orientation), so a vector from here equals
the one `icr index build --images` stores for the same file. An error names the file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from icr.core.devices import resolve_device
from icr.core.image_input import GALLERY_FORMATS, ImageLimits, ImageRefused, open_image
from icr.training.checkpoint import CheckpointMeta, load_checkpoint
from icr.training.embedding import embed_captions, embed_image_batch
from icr.training.models import DualEncoder
from icr.training.models.config import takes_features

ImageInput = str | os.PathLike[str] | Image.Image
GALLERY_LIMITS = ImageLimits(formats=GALLERY_FORMATS)
DEFAULT_BATCH_SIZE = 64


def _open(item: Any, position: int) -> Image.Image:
    """A PIL image as given, or the file at a path decoded within the gallery limits."""
    if isinstance(item, Image.Image):
        return item
    if not isinstance(item, str | os.PathLike):
        raise ValueError(f"images[{position}] is a {type(item).__name__}; pass a file path or a PIL image")
    try:
        return open_image(item, GALLERY_LIMITS)
    except FileNotFoundError:
        raise FileNotFoundError(f"{item}: image file not found (images[{position}])") from None
    except ImageRefused as err:  # says which limit, or which formats are accepted
        raise ValueError(f"{item}: cannot decode image (images[{position}]): {err}") from None
    except OSError as err:
        raise ValueError(f"{item}: cannot read image (images[{position}]): {err}") from None


def _batch_size(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"batch_size must be a positive integer, got {value!r}")
    return value


def _as_list(items: Any, what: str, example: str) -> list[Any]:
    if isinstance(items, str | bytes | os.PathLike | Image.Image):
        raise ValueError(f"{what} takes a list, got a single {type(items).__name__}; wrap it: {example}")
    return list(items)


class Encoder:
    """A loaded checkpoint: :meth:`encode_text` and :meth:`encode_images` give (N, ``dim``) float32
    unit rows. ``model`` is the :class:`~icr.training.models.DualEncoder` (eval mode, on ``device``),
    ``meta`` the checkpoint's ``config.json``."""

    def __init__(
        self, model: DualEncoder, meta: CheckpointMeta, path: Path, device: str, batch_size: int
    ) -> None:
        self.model = model
        self.meta = meta
        self.path = path
        self.device = device
        self.batch_size = _batch_size(batch_size)

    @property
    def dim(self) -> int:
        """The embedding size D."""
        return self.model.embed_dim

    def __repr__(self) -> str:
        return f"Encoder({str(self.path)!r}, dim={self.dim}, device={self.device!r})"

    def encode_text(self, captions: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """(N, D) float32 unit rows of ``captions``, in order, ``batch_size`` at a time."""
        texts = _as_list(captions, "encode_text", "encode_text([caption])")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"captions[{i}] is a {type(text).__name__}, not a str")
        size = _batch_size(batch_size or self.batch_size)
        return embed_captions(self.model, texts, batch_size=size, device=self.device)

    def encode_images(self, images: Sequence[ImageInput], batch_size: int | None = None) -> np.ndarray:
        """(N, D) float32 unit rows of ``images`` (file paths or PIL images), in order, with the
        checkpoint's eval preprocessing; files are decoded one batch at a time."""
        if takes_features(self.model.config["image"]):
            raise ValueError(
                f"{self.path}: this checkpoint's image tower ({self.model.config['image']['kind']}) reads "
                "pre-extracted region features, not images"
            )
        items = _as_list(images, "encode_images", "encode_images([path])")
        size = _batch_size(batch_size or self.batch_size)
        out = [np.zeros((0, self.dim), np.float32)]
        for start in range(0, len(items), size):
            batch = [_open(item, start + j) for j, item in enumerate(items[start : start + size])]
            out.append(embed_image_batch(self.model, batch, device=self.device))
        return np.concatenate(out).astype(np.float32, copy=False)


def load(
    checkpoint: str | os.PathLike[str], device: str = "auto", batch_size: int = DEFAULT_BATCH_SIZE
) -> Encoder:
    """The checkpoint folder (`icr train`, `icr model import`) as an :class:`Encoder` on ``device``
    (``auto``: CUDA when a GPU is visible, else the CPU; ``cpu``; ``cuda``). Its weights' sha256 is
    checked; a missing or broken checkpoint is an error naming the file."""
    where = resolve_device(device)
    size = _batch_size(batch_size)
    model, meta = load_checkpoint(checkpoint, device=where)
    return Encoder(model, meta, Path(checkpoint), where, size)
