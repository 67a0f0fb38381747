"""VSRN image tower (Li et al., ICCV 2019, ``KunpengLi1994/VSRN``) over pre-extracted region features.

regions (B, R, F) -> ``Linear(F, D)`` (Xavier) -> [L2 per region] -> ``reasoning_layers`` residual
graph-reasoning layers (VSRN ``Rs_GCN``) -> L2 per region -> global representation -> [BatchNorm1d]
-> L2. The global representation is VSRN's ``GRU(D, D)`` run over the regions in order (its final
hidden state), or VSE-infinity's GPO (``pooling = "gpo"``).

The optional steps follow VSRN's code: it L2-normalises the projected regions except on
``f30k_precomp`` (``region_norm = false``), where it instead adds ``BatchNorm1d`` on the global
vector (``batchnorm_head = true``). VSRN's caption-generation branch is not implemented: the ECIR
2022 reproduction removes it (``loss = retrieval_loss``) so that only the objective differs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from icr.training.models.gpo import GPO
from icr.training.models.heads import l2norm, xavier_linear


class ReasoningLayer(nn.Module):
    """VSRN ``Rs_GCN`` (a non-local block over regions): ``v + W(R g(v))`` with ``R = theta(v) phi(v)^T / N``.

    ``g``, ``theta``, ``phi`` are 1x1 projections (Linear per region, D -> D); ``W`` is a Linear
    followed by ``BatchNorm1d`` over channels whose weight and bias start at 0, so the layer is the
    identity at initialisation. Works on (B, N, D) (VSRN uses Conv1d on (B, D, N): the same maps).
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.g = nn.Linear(dim, dim)
        self.theta = nn.Linear(dim, dim)
        self.phi = nn.Linear(dim, dim)
        self.w = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        nn.init.zeros_(self.bn.weight)
        nn.init.zeros_(self.bn.bias)

    def forward(self, v: Tensor) -> Tensor:
        """(B, N, D) -> (B, N, D)."""
        affinity = self.theta(v) @ self.phi(v).transpose(1, 2) / v.shape[1]  # (B, N, N)
        y = affinity @ self.g(v)  # (B, N, D)
        # BN over channels, stats over B x N
        wy: Tensor = self.bn(self.w(y).transpose(1, 2)).transpose(1, 2)
        return v + wy


class VSRNImageEncoder(nn.Module):
    """Region features (B, R, F) -> (B, D) unit embeddings (see the module docstring)."""

    def __init__(self, cfg: dict[str, Any], embed_dim: int) -> None:
        super().__init__()
        if cfg["caption_branch"]:
            raise ValueError(
                "model.image.caption_branch = true is not supported: the ECIR 2022 VSRN runs remove "
                "VSRN's caption-generation loss so that the comparison differs in the retrieval "
                "objective only; set model.image.caption_branch = false"
            )
        self.feature_dim = cfg["feature_dim"]
        self.region_norm = cfg["region_norm"]
        self.pooling = cfg["pooling"]
        self.fc = xavier_linear(self.feature_dim, embed_dim)
        self.reasoning = nn.ModuleList(ReasoningLayer(embed_dim) for _ in range(cfg["reasoning_layers"]))
        if self.pooling == "gru":
            self.rnn = nn.GRU(embed_dim, embed_dim, num_layers=1, batch_first=True)
        else:
            self.gpo = GPO()
        self.bn = nn.BatchNorm1d(embed_dim) if cfg["batchnorm_head"] else None

    def forward(self, features: Tensor) -> Tensor:
        """``features``: (B, R, F) region features -> (B, D) unit embeddings."""
        if features.dim() != 3 or features.shape[-1] != self.feature_dim:
            raise ValueError(
                f"the vsrn image tower needs region features of shape (B, R, {self.feature_dim}) "
                f"(model.image.feature_dim = {self.feature_dim}), got {tuple(features.shape)}; graph "
                "reasoning needs several regions per image, so one vector per image cannot be used "
                "(use model.image.kind = 'precomp' for those)"
            )
        v = self.fc(features)  # (B, R, D)
        if self.region_norm:
            v = l2norm(v)
        for layer in self.reasoning:
            v = layer(v)
        v = l2norm(v)  # (B, R, D), as VSRN before its GRU
        if self.pooling == "gru":
            _, h_n = self.rnn(v)  # (1, B, D): the state after the last region
            state = h_n[-1]
        else:
            lengths = torch.full((v.shape[0],), v.shape[1], dtype=torch.long)
            state, _ = self.gpo(v, lengths)
        if self.bn is not None:
            state = self.bn(state)
        return l2norm(state)  # (B, D)
