"""Word-embedding + GRU caption tower (VSE++; bidirectional with a 2-layer head = LTD; GPO = VSE-infinity).

``pooling = "last"``: the final hidden state(s); bidirectional concatenates both directions (2H).
``pooling = "gpo"``: GPO (:mod:`training.models.gpo`) over the per-token GRU outputs of the valid
tokens; bidirectional averages the two directions' outputs first, as VSE-infinity does, so the
pooled vector has H dimensions. Either way the result goes through the head, then L2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from icr.training.data.vocab import Vocabulary, tokenize
from icr.training.models.glove import load_glove
from icr.training.models.gpo import GPO
from icr.training.models.heads import l2norm, projection_head


class GRUTextEncoder(nn.Module):
    """Embedding -> (bi)GRU over the valid tokens -> final hidden state(s) or GPO -> head -> L2."""

    def __init__(self, cfg: dict[str, Any], embed_dim: int, vocab: Vocabulary, load_weights: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab = vocab
        self.embed = nn.Embedding(len(vocab), cfg["word_dim"])
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)  # VSE++ init
        self.glove_coverage: float | None = None
        if load_weights and cfg["glove_path"] is not None:
            # Only when building for training: a checkpoint's embedding rows come from its weights.
            weights, self.glove_coverage = load_glove(cfg["glove_path"], vocab, cfg["word_dim"])
            with torch.no_grad():
                self.embed.weight.copy_(weights)
        self.rnn = nn.GRU(
            cfg["word_dim"],
            cfg["hidden"],
            num_layers=cfg["layers"],
            batch_first=True,
            bidirectional=cfg["bidirectional"],
        )
        self.pooling = cfg.get("pooling", "last")
        self.gpo = GPO() if self.pooling == "gpo" else None
        out_dim = cfg["hidden"] * (2 if cfg["bidirectional"] and self.pooling == "last" else 1)
        self.head = projection_head(out_dim, embed_dim, cfg["head_layers"], cfg["batchnorm_head"])
        self.set_finetune(cfg["finetune_embeddings"])

    def set_finetune(self, enabled: bool) -> None:
        """Train the word embeddings (True) or freeze them (False, LTD's first 30 epochs)."""
        self.cfg["finetune_embeddings"] = bool(enabled)
        self.embed.weight.requires_grad_(bool(enabled))

    def unknown_words(self, text: str) -> list[str]:
        """The words of ``text`` outside the vocabulary (read as <unk>), in order."""
        return [w for w in tokenize(text) if w not in self.vocab]

    def tokenize(self, captions: Sequence[str]) -> dict[str, Tensor]:
        """``{"input_ids": (B, T) long, "lengths": (B,) long}``: ``<start> ... <end>``, <= max_len ids."""
        if isinstance(captions, str):
            raise ValueError("tokenize takes a list of captions, got a single string; wrap it in a list")
        max_len = self.cfg["max_len"]
        rows = []
        for caption in captions:
            ids = self.vocab.encode(caption)
            if len(ids) > max_len:
                ids = ids[: max_len - 1] + [Vocabulary.END]  # keep <end>: the GRU saw it in training
            rows.append(ids)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)  # (B,)
        input_ids = torch.full(
            (len(rows), max(lengths.tolist(), default=1)), Vocabulary.PAD, dtype=torch.long
        )
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return {"input_ids": input_ids, "lengths": lengths}

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """``batch`` from :meth:`tokenize` -> (B, D) unit embeddings."""
        input_ids, lengths = batch["input_ids"], batch["lengths"]
        words = self.embed(input_ids)  # (B, T, W)
        # Packing runs the GRU over the valid tokens only, so padding never enters the state.
        packed = pack_padded_sequence(words, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, h_n = self.rnn(packed)  # h_n: (layers * dirs, B, H), in the batch's original order
        if self.gpo is not None:
            tokens, _ = pad_packed_sequence(out, batch_first=True)  # (B, T, H * dirs), zero padding
            if self.cfg["bidirectional"]:
                hidden = self.cfg["hidden"]
                tokens = (tokens[..., :hidden] + tokens[..., hidden:]) / 2  # (B, T, H), as VSE-infinity
            state, _ = self.gpo(tokens, lengths)  # (B, H)
        elif self.cfg["bidirectional"]:
            # Final states of both directions: forward after the last valid token, backward after
            # reading the whole caption back to the first. The LTD seed instead took index
            # length-1 of the concatenated outputs, where the backward half has seen one token only.
            state = torch.cat([h_n[-2], h_n[-1]], dim=1)  # (B, 2H)
        else:
            state = h_n[-1]  # (B, H): the output at the last valid step, as in VSE++
        return l2norm(self.head(state))  # (B, D)
