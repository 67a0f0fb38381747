"""Generalized Pooling Operator (GPO) of VSE-infinity (Chen et al., CVPR 2021, ``woodfrog/vse_infty``).

For a set of ``n`` feature vectors, every dimension's ``n`` values are sorted in descending order
and pooled with weights ``w_0..w_{n-1}`` that depend only on the rank ``k`` and on ``n``:

    pooled[d] = sum_k w_k * sort_desc(x[:, d])[k]

The weights come from sinusoidal position encodings of ``0..n-1`` read by a small bidirectional
GRU (outputs of both directions averaged) and a bias-free ``Linear(d_hidden, 1)``, followed by a
softmax over the ``n`` positions with temperature 0.1. One-hot weights on position 0 give max
pooling, uniform weights give mean pooling; GPO learns anything in between.

Sets of different sizes are batched by padding: padded elements never win the sort (they are set
to ``-inf`` first), get zero weight, and the GRU reads only the valid positions (packed sequence),
so a sample's result does not depend on what else is in its batch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

TEMPERATURE = 0.1


def positional_encoding(
    length: int, dim: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """(length, dim) sinusoidal encodings (Transformer style: sin on even, cos on odd columns)."""
    if dim % 2 != 0:
        raise ValueError(f"the GPO positional-encoding size must be even, got {dim}")
    position = torch.arange(length, dtype=dtype, device=device).unsqueeze(1)  # (L, 1)
    div = torch.exp(
        torch.arange(0, dim, 2, dtype=dtype, device=device) * (-math.log(10000.0) / dim)
    )  # (dim/2,)
    pe = torch.zeros(length, dim, device=device, dtype=dtype)
    pe[:, 0::2] = torch.sin(position * div)
    pe[:, 1::2] = torch.cos(position * div)
    return pe


class GPO(nn.Module):
    """``forward(features (B, N, D), lengths (B,)) -> (pooled (B, D), weights (B, N))``.

    Positions ``>= lengths[b]`` of sample ``b`` are padding: ignored by the sort, weight 0.
    """

    def __init__(self, d_pe: int = 32, d_hidden: int = 32) -> None:
        super().__init__()
        if d_pe % 2 != 0:
            raise ValueError(f"the GPO positional-encoding size must be even, got {d_pe}")
        self.d_pe = d_pe
        self.d_hidden = d_hidden
        self.gru = nn.GRU(d_pe, d_hidden, num_layers=1, batch_first=True, bidirectional=True)
        self.linear = nn.Linear(d_hidden, 1, bias=False)

    def _valid(self, lengths: Tensor, n: int, device: torch.device) -> Tensor:
        """(B, n) bool mask of the valid positions; checks the lengths."""
        if lengths.dim() != 1:
            raise ValueError(f"GPO lengths must be a (B,) tensor, got shape {tuple(lengths.shape)}")
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 1 or hi > n:
            raise ValueError(f"GPO lengths must be in [1, {n}] (the set size), got min {lo} max {hi}")
        return torch.arange(n, device=device).unsqueeze(0) < lengths.to(device).unsqueeze(1)

    def pool_weights(self, lengths: Tensor, n: int, device: torch.device) -> Tensor:
        """(B, n) softmax weights over the valid positions of each sample (0 on padding)."""
        self._valid(lengths, n, device)  # checks the lengths
        # The weights depend on the length alone: run the GRU once per distinct length, not once per
        # sample (every image has the same R regions; captions share a few lengths). Same values and
        # gradients, a fraction of the GRU's cost.
        distinct, which = lengths.unique(return_inverse=True)  # (U,), (B,)
        valid = self._valid(distinct, n, device)  # (U, n)
        pes = positional_encoding(n, self.d_pe, device, self.linear.weight.dtype)
        pes = pes.unsqueeze(0).expand(distinct.shape[0], n, self.d_pe)
        pes = pes.masked_fill(~valid.unsqueeze(-1), 0.0)  # (U, n, d_pe)
        packed = pack_padded_sequence(pes, distinct.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.gru(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=n)  # (U, n, 2 * d_hidden)
        out = (out[..., : self.d_hidden] + out[..., self.d_hidden :]) / 2  # both directions averaged
        scores = self.linear(out).squeeze(-1)  # (U, n)
        scores = scores.masked_fill(~valid, float("-inf"))
        return torch.softmax(scores / TEMPERATURE, dim=1)[which.to(device)]  # (B, n)

    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        if features.dim() != 3:
            raise ValueError(f"GPO features must be (B, N, D), got shape {tuple(features.shape)}")
        n = features.shape[1]
        weights = self.pool_weights(lengths, n, features.device)  # (B, n)
        valid = self._valid(lengths, n, features.device).unsqueeze(-1)  # (B, n, 1)
        # Padding -> -inf so it sorts last, then 0 so that 0 weight x value contributes nothing.
        ranked = features.masked_fill(~valid, float("-inf")).sort(dim=1, descending=True).values
        ranked = ranked.masked_fill(~valid, 0.0)  # (B, n, D): the first lengths[b] rows are valid
        pooled = (ranked * weights.unsqueeze(-1).to(ranked.dtype)).sum(dim=1)  # (B, D)
        return pooled, weights
