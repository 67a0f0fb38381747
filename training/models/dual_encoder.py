"""The dual encoder (image tower + caption tower) and the builder that turns a config into one."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from icr.training.data.vocab import Vocabulary
from icr.training.models.config import learns_logit_scale, normalize_model_config
from icr.training.models.preprocess import (
    FeatureTransform,
    ImageTransform,
    build_image_transform,
    preprocessing_summary,
)
from icr.training.models.towers import IMAGE_TOWERS, TEXT_TOWERS, TowerContext, build_tower

if TYPE_CHECKING:  # annotations only: the towers are built by kind in towers.py
    from icr.training.models.clip_towers import ClipTextEncoder
    from icr.training.models.text_gru import GRUTextEncoder
    from icr.training.models.text_transformer import TransformerTextEncoder

    TextEncoder = GRUTextEncoder | TransformerTextEncoder | ClipTextEncoder

# CLIP caps its learned logit scale at 100 (temperature 0.01) so that training stays stable.
MAX_LOG_LOGIT_SCALE = math.log(100.0)


class DualEncoder(nn.Module):
    """Two towers mapping images and captions into one space of unit vectors (cosine = dot product).

    ``config`` is the complete, JSON-serialisable model config (see :mod:`training.models.config`);
    the towers share its sub-dicts, so what they record (a pretrained backbone's structure, the
    current finetune flags) is what a checkpoint saves.

    ``logit_scale`` (``model.logit_scale``, :func:`learns_logit_scale`): a trained scalar, the log of
    the factor that turns similarities into the objective's logits (CLIP's parametrisation), or
    None. It starts from the pretrained model's ``logit_scale`` when a tower has one
    (``logit_scale_pretrained``), else the trainer starts it from the objective's temperature. It is
    saved with the weights; embeddings (and so retrieval) do not use it.
    """

    def __init__(
        self,
        config: dict[str, Any],
        image_encoder: nn.Module,
        text_encoder: TextEncoder,
        vocab: Vocabulary | None,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_dim: int = config["embed_dim"]
        self.vocab = vocab
        self.image_encoder = image_encoder
        self.text_encoder = text_encoder
        self.logit_scale: nn.Parameter | None = None
        self.logit_scale_pretrained = False
        if learns_logit_scale(config):
            pretrained = [getattr(t, "pretrained_logit_scale", None) for t in (image_encoder, text_encoder)]
            known = [p for p in pretrained if p is not None]
            self.logit_scale_pretrained = bool(known)
            # capped as in training: a larger start would sit at the cap with no gradient
            start = min(known[0], MAX_LOG_LOGIT_SCALE) if known else 0.0
            self.logit_scale = nn.Parameter(torch.tensor(start, dtype=torch.float32))

    def logit_multiplier(self) -> Tensor | None:
        """exp(logit_scale), at most 100: the factor of the similarities in the objective's logits
        (replacing 1 / temperature or scale); None without a learned scale."""
        if self.logit_scale is None:
            return None
        return self.logit_scale.clamp(max=MAX_LOG_LOGIT_SCALE).exp()  # ()

    def encoder_parameters(self) -> Iterator[nn.Parameter]:
        """The two towers' parameters (not the logit scale, whose gradient every process computes whole)."""
        return itertools.chain(self.image_encoder.parameters(), self.text_encoder.parameters())

    def encode_image(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) pixels, or features for precomp ((B, R, F) / (B, F)) and vsrn ((B, R, F))
        -> (B, D) unit rows."""
        emb: Tensor = self.image_encoder(images)  # nn.Module calls are typed Any
        return emb

    def encode_text(self, batch: dict[str, Tensor]) -> Tensor:
        """A batch from :meth:`tokenize` -> (B, D) unit rows."""
        emb: Tensor = self.text_encoder(batch)  # nn.Module calls are typed Any
        return emb

    def forward(self, images: Tensor, text_batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return self.encode_image(images), self.encode_text(text_batch)  # (B, D), (B', D)

    def tokenize(self, captions: Sequence[str]) -> dict[str, Tensor]:
        """Captions -> the batch :meth:`encode_text` takes (GRU: input_ids + lengths; transformer:
        input_ids + attention_mask)."""
        return self.text_encoder.tokenize(captions)

    def unknown_words(self, text: str) -> list[str]:
        """The words of ``text`` the text tower's tokenizer cannot read (mapped to its unknown token)."""
        return list(self.text_encoder.unknown_words(text))

    def image_transform(self, train: bool) -> ImageTransform | FeatureTransform:
        """Picklable ``f(image, rng) -> Tensor``: PIL image -> (3, S, S) float32; for precomp and
        vsrn a feature array (R, F) or (F,) -> float32 tensor. Deterministic given ``rng``."""
        return build_image_transform(self.config["image"], train)

    @property
    def preprocessing(self) -> dict[str, Any]:
        """What an indexer or server must feed :meth:`encode_image` (recorded in checkpoints)."""
        return preprocessing_summary(self.config["image"])

    @property
    def tokenizer_saver(self) -> Callable[[str | Path], None] | None:
        """Writes the HF tokenizer files into a folder; None for vocabulary-based towers."""
        return getattr(self.text_encoder, "save_tokenizer", None)

    def set_finetune(self, image: bool | None = None, text: bool | None = None) -> None:
        """Unfreeze/freeze the pretrained parts (ResNet backbone, transformer, CLIP/SigLIP tower within
        its ``finetune_last_n``, GRU word embeddings).

        The flags are recorded in ``config``. Towers with nothing pretrained (cnn, precomp, vsrn) always
        train and ignore the flag, so a schedule such as LTD's "unfreeze at epoch 30" needs no
        per-kind branching. An optimizer built before unfreezing must be given the new parameters.
        """
        for flag, tower in ((image, self.image_encoder), (text, self.text_encoder)):
            set_finetune = getattr(tower, "set_finetune", None)
            if flag is not None and set_finetune is not None:
                set_finetune(flag)


def build_model(
    config: dict[str, Any] | None,
    vocab: Vocabulary | None = None,
    *,
    load_weights: bool = True,
    tokenizer_dir: str | Path | None = None,
) -> DualEncoder:
    """Build a dual encoder from a (partial) model config; defaults are filled in.

    ``load_weights=True`` (training) reads pretrained weights from ``image.path`` /
    ``text.path`` / ``text.glove_path`` and records the pretrained networks' structure in the
    config. ``load_weights=False`` (checkpoint loading) rebuilds those networks from the recorded
    structure with random weights, for the caller to overwrite; ``tokenizer_dir`` then points at
    the checkpoint's copy of the tokenizer.
    """
    cfg = normalize_model_config(config)
    ctx = TowerContext(load_weights, vocab, tokenizer_dir)
    image_encoder = build_tower(IMAGE_TOWERS, "image", cfg["image"], cfg["embed_dim"], ctx)
    text_encoder, keeps_vocab = build_tower(TEXT_TOWERS, "text", cfg["text"], cfg["embed_dim"], ctx)
    if not keeps_vocab:
        vocab = None  # the tower has its own tokenizer; a word vocabulary would be dead weight
    return DualEncoder(cfg, image_encoder, text_encoder, vocab)
