"""Image tower over pre-extracted features: regions (B, R, F) or one vector per image (B, F)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from training.models.heads import l2norm, xavier_linear


class PrecompImageEncoder(nn.Module):
    """``Linear(F, D)`` per region, pooled over regions (mean or max), then L2 (VSE++ precomp FC)."""

    def __init__(self, cfg: dict[str, Any], embed_dim: int) -> None:
        super().__init__()
        self.feature_dim = cfg["feature_dim"]
        self.pooling = cfg["pooling"]
        self.fc = xavier_linear(self.feature_dim, embed_dim)

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
        pooled = regions.mean(dim=1) if self.pooling == "mean" else regions.amax(dim=1)  # (B, D)
        return l2norm(pooled)
