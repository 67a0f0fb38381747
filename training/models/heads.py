"""Projection heads shared by the towers, and the L2 normalisation every tower ends with."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F


def l2norm(x: Tensor) -> Tensor:
    """Unit rows, so that ``img @ cap.T`` is the cosine similarity every loss assumes."""
    return F.normalize(x, p=2.0, dim=-1, eps=1e-12)


def xavier_linear(in_dim: int, out_dim: int, bias: bool = True) -> nn.Linear:
    """Linear layer with Xavier-uniform weights and zero bias (VSE++ ``init_weights``, LTD heads)."""
    layer = nn.Linear(in_dim, out_dim, bias=bias)
    nn.init.xavier_uniform_(layer.weight)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)
    return layer


def projection_head(in_dim: int, out_dim: int, layers: int, batchnorm: bool = False) -> nn.Module:
    """Feature -> embedding map (before the final L2 norm).

    * ``layers=0``: identity when the sizes agree (VSE++ GRU: hidden state is the embedding),
      else one Linear.
    * ``layers=1``: ``Linear(in, out)`` (VSE++ image FC).
    * ``layers=2``: ``Linear(in, in, no bias) -> ReLU -> Linear(in, out, no bias)`` (LTD/PCME head).

    ``batchnorm`` appends ``BatchNorm1d(out)`` as LTD does for its triplet runs. Note that batch
    statistics make the result depend on how the batch is split across processes.
    """
    if layers == 0:
        parts: list[nn.Module] = [nn.Identity() if in_dim == out_dim else xavier_linear(in_dim, out_dim)]
    elif layers == 1:
        parts = [xavier_linear(in_dim, out_dim)]
    elif layers == 2:
        parts = [
            xavier_linear(in_dim, in_dim, bias=False),
            nn.ReLU(),
            xavier_linear(in_dim, out_dim, bias=False),
        ]
    else:
        raise ValueError(f"head layers must be 0, 1 or 2, got {layers}")
    if batchnorm:
        parts.append(nn.BatchNorm1d(out_dim))
    return parts[0] if len(parts) == 1 else nn.Sequential(*parts)
