"""Image tower over pre-extracted features: regions (B, R, F) or one vector per image (B, F).

Pooling over regions: mean, max, or VSE-infinity's learned GPO (:mod:`training.models.gpo`; all
images have the same R regions, so every set has length R).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from icr.training.models.gpo import GPO
from icr.training.models.heads import l2norm, xavier_linear


class PrecompImageEncoder(nn.Module):
    """``Linear(F, D)`` per region, pooled over regions (mean, max or GPO), then L2 (VSE++ precomp FC)."""

    def __init__(self, cfg: dict[str, Any], embed_dim: int) -> None:
        super().__init__()
        self.feature_dim = cfg["feature_dim"]
        self.pooling = cfg["pooling"]
        self.fc = xavier_linear(self.feature_dim, embed_dim)
        if self.pooling == "gpo":
            self.gpo = GPO()

    def forward(self, features: Tensor) -> Tensor:
        """``features``: (B, R, F) or (B, F) -> (B, D) unit embeddings."""
        if features.dim() == 2:
            features = features.unsqueeze(1)  # (B, 1, F): a vector is a single region
        if features.dim() != 3 or features.shape[-1] != self.feature_dim:
            raise ValueError(
                f"expected features of shape (B, R, {self.feature_dim}) or (B, {self.feature_dim}), "
                f"got {tuple(features.shape)}; set model.image.feature_dim to the dataset's feature size"
            )
        regions = self.fc(features)  # (B, R, D)
        if self.pooling == "mean":
            pooled = regions.mean(dim=1)  # (B, D)
        elif self.pooling == "max":
            pooled = regions.amax(dim=1)
        else:
            lengths = torch.full((regions.shape[0],), regions.shape[1], dtype=torch.long)
            pooled, _ = self.gpo(regions, lengths)
        return l2norm(pooled)
