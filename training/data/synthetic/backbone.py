"""A small CNN "pretrained backbone" for the embedded benchmark, and the frozen region features it gives.

The papers train retrieval on frozen features of a detector pretrained on another task (BUTD on
Visual Genome attributes). This is the same regime in miniature: the backbone learns to name the
attributes of the objects in each cell of a ``grid x grid`` map (shape, colour, size, or empty)
and, from the pooled map, the background tone and the object count. It never sees a caption, so
retrieval trained on its features starts from what a different task taught it, as in the papers.

Imported only by :mod:`icr.training.data.synthetic.features` and the evaluation's distractor path,
inside functions (this module imports torch).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm import tqdm

from icr.training.data.synthetic import world
from icr.training.data.synthetic.scene import Scene
from icr.training.evaluation.metrics.global_pr import pr_curve
from icr.training.evaluation.metrics.relevant_pairs import Relevance

# Per-cell multi-label targets, in this order (the cell head's outputs).
CELL_LABELS: tuple[str, ...] = (*world.SHAPES, *world.COLOUR_NAMES, *world.SIZES, "empty")
_GROUPS = {
    "shape": slice(0, len(world.SHAPES)),
    "colour": slice(len(world.SHAPES), len(world.SHAPES) + len(world.COLOUR_NAMES)),
    "size": slice(len(world.SHAPES) + len(world.COLOUR_NAMES), len(CELL_LABELS) - 1),
}
_EMPTY = len(CELL_LABELS) - 1
COUNTS: tuple[int, ...] = (1, 2, 3)  # object counts the generator draws (scene.OBJECT_COUNT_P)
# A centre this close (relative to the image side) to a cell border counts as inside both cells:
# with grid 4 the middle objects of the 3 x 3 scene grid sit on a border (0.5 +- 0.027), and a label
# decided by a sub-pixel position would be noise. Centres never come closer than 0.06 to a border
# for grid 3, so there every object keeps exactly one cell.
CENTRE_MARGIN = 0.04
DOWNSAMPLING = 8  # three stride-2 convolutions
GLOBAL_WEIGHT = 0.1  # of the tone and count terms in the loss (see _loss)


@dataclass(frozen=True)
class BackboneConfig:
    """What rebuilds the network from its saved weights (stored in the features manifest)."""

    image_size: int
    grid: int = 4
    dim: int = 256
    width: int = 32  # channels of the first stage; 2x and 4x after

    def __post_init__(self) -> None:
        if self.grid < 1 or self.grid > self.image_size // DOWNSAMPLING:
            raise ValueError(
                f"--grid must be in 1..{self.image_size // DOWNSAMPLING} for {self.image_size} px images "
                f"(the map is 1/{DOWNSAMPLING} of the image), got {self.grid}"
            )
        if self.dim < 1 or self.width < 1:
            raise ValueError(f"--dim and width must be positive, got {self.dim} and {self.width}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BackboneConfig:
        return cls(**{k: int(d[k]) for k in ("image_size", "grid", "dim", "width")})


def _block(cin: int, cout: int, stride: int) -> list[nn.Module]:
    # bias=False: the norm has the bias. BatchNorm learns faster than GroupNorm here, and the
    # features are extracted in eval mode (running statistics), so each image's row depends on it alone.
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class Backbone(nn.Module):
    """Conv trunk (1/8 resolution) -> average pool to ``grid x grid`` -> 1x1 conv + ReLU = the
    region features; linear heads on them: per cell (``CELL_LABELS``) and on their mean (tone, count).

    The heads are linear on exactly the features that are extracted, so their held-out accuracy is
    a linear probe of those features.
    """

    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        w = cfg.width
        self.cfg = cfg
        self.trunk = nn.Sequential(
            *_block(3, w, 2), *_block(w, 2 * w, 2), *_block(2 * w, 2 * w, 1), *_block(2 * w, 4 * w, 2)
        )
        self.pool = nn.AdaptiveAvgPool2d(cfg.grid)
        self.project = nn.Sequential(nn.Conv2d(4 * w, cfg.dim, 1), nn.ReLU())
        self.cell_head = nn.Conv2d(cfg.dim, len(CELL_LABELS), 1)
        self.global_head = nn.Linear(cfg.dim, len(world.BACKGROUND_TONES) + len(COUNTS))

    def feature_map(self, images: Tensor) -> Tensor:
        """(B, 3, S, S) normalised pixels -> (B, dim, grid, grid) post-ReLU region features."""
        # channels_last: oneDNN's convolutions are faster on CPU in this layout; same values.
        x = self.trunk(images.contiguous(memory_format=torch.channels_last))  # (B, 4w, S/8, S/8)
        fmap: Tensor = self.project(self.pool(x))  # (B, dim, g, g)
        return fmap

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """-> cell logits (B, L, g, g) and global logits (B, tones + counts)."""
        fmap = self.feature_map(images)
        return self.cell_head(fmap), self.global_head(fmap.mean(dim=(2, 3)))


def to_input(images: np.ndarray | Tensor) -> Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float, roughly zero-mean unit-scale."""
    x = torch.as_tensor(images).permute(0, 3, 1, 2).float()  # (B, 3, H, W)
    return (x / 255.0 - 0.5) / 0.25


def _cells(centre: float, grid: int) -> range:
    """Cells along one axis whose span holds ``centre`` (relative), within CENTRE_MARGIN of a border."""
    lo = min(max(int(math.floor((centre - CENTRE_MARGIN) * grid)), 0), grid - 1)
    hi = min(max(int(math.floor((centre + CENTRE_MARGIN) * grid)), 0), grid - 1)
    return range(lo, hi + 1)


def cell_targets(scenes: Sequence[Scene], grid: int) -> np.ndarray:
    """(N, L, grid, grid) float32 multi-label targets: the attributes of the objects whose centre
    lies in each cell; ``empty`` where none does."""
    index = {name: i for i, name in enumerate(CELL_LABELS)}
    out = np.zeros((len(scenes), len(CELL_LABELS), grid, grid), np.float32)
    out[:, _EMPTY] = 1.0
    for n, scene in enumerate(scenes):
        for o in scene.objects:
            for r in _cells(o.y, grid):
                for c in _cells(o.x, grid):
                    out[n, [index[o.shape], index[o.colour], index[o.size]], r, c] = 1.0
                    out[n, _EMPTY, r, c] = 0.0
    return out


def global_targets(scenes: Sequence[Scene]) -> np.ndarray:
    """(N, 2) int64: background tone index, object count index."""
    return np.array(
        [(world.BACKGROUND_TONES.index(s.background.tone), COUNTS.index(len(s.objects))) for s in scenes],
        dtype=np.int64,
    ).reshape(len(scenes), 2)


def _loss(model: Backbone, x: Tensor, cells: Tensor, glob: Tensor) -> Tensor:
    cell_logits, global_logits = model(x)  # (B, L, g, g), (B, T + C)
    tones = len(world.BACKGROUND_TONES)
    # BCE summed over the labels (averaged over cells) and the global terms down-weighted: with a
    # plain mean, or the global terms at full weight, their gradient swamps the rare per-cell labels
    # (one colour in eight) and the trunk settles on tone, count and size, staying colour-blind for
    # hundreds of steps (measured: colour accuracy 0.36 vs 0.96 after 300 steps of 64 images).
    bce = nn.functional.binary_cross_entropy_with_logits(cell_logits, cells, reduction="none")  # (B, L, g, g)
    global_ce = nn.functional.cross_entropy(
        global_logits[:, :tones], glob[:, 0]
    ) + nn.functional.cross_entropy(global_logits[:, tones:], glob[:, 1])
    return bce.sum(dim=1).mean() + GLOBAL_WEIGHT * global_ce


def pretrain(
    images: np.ndarray,
    scenes: Sequence[Scene],
    cfg: BackboneConfig,
    *,
    epochs: int,
    seed: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    progress: bool = False,
) -> Backbone:
    """Train a :class:`Backbone` on ``images`` (N, H, W, 3) uint8 and their ``scenes``; returns it in
    eval mode with gradients off (frozen). Deterministic for a given seed and thread count."""
    if epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {epochs}")
    if len(images) < 2:
        raise ValueError(f"the train split needs at least 2 images to pretrain on, got {len(images)}")
    pixels = torch.from_numpy(np.ascontiguousarray(images))  # (N, H, W, 3) uint8: 4x less memory than float
    cells = torch.from_numpy(cell_targets(scenes, cfg.grid))  # (N, L, g, g)
    glob = torch.from_numpy(global_targets(scenes))  # (N, 2)
    torch.manual_seed(seed)
    model = Backbone(cfg)
    batch_size = min(batch_size, len(images))
    steps_per_epoch = len(images) // batch_size  # the last partial batch is dropped (BatchNorm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    total = epochs * steps_per_epoch
    warmup = max(1, total // 20)
    # Linear warm-up, then cosine decay to zero. (One-cycle with its 3x higher peak and momentum
    # cycling left the trunk colour-blind: it settled on tone, count and size first and never left.)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            (step + 1) / warmup
            if step < warmup
            else 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
        ),
    )
    rng = np.random.default_rng([seed, 0xBAC])
    model.train()
    bar = tqdm(
        total=epochs * steps_per_epoch, desc="pretraining backbone", unit="batch", disable=not progress
    )
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(images)))
        for k in range(steps_per_epoch):
            idx = order[k * batch_size : (k + 1) * batch_size]
            loss = _loss(model, to_input(pixels[idx]), cells[idx], glob[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    bar.close()
    return model.eval().requires_grad_(False)


@torch.no_grad()
def forward_batches(
    model: Backbone, images: np.ndarray, batch_size: int = 256
) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """Per batch of ``images`` (N, H, W, 3) uint8: (feature map (b, dim, g, g), cell logits
    (b, L, g, g), global logits (b, T + C)), in eval mode."""
    model.eval()
    for start in range(0, len(images), batch_size):
        fmap = model.feature_map(to_input(images[start : start + batch_size]))
        yield fmap, model.cell_head(fmap), model.global_head(fmap.mean(dim=(2, 3)))


def regions(fmap: Tensor) -> np.ndarray:
    """(B, dim, g, g) -> (B, g * g, dim) float32 numpy: one region per cell, row-major."""
    return fmap.permute(0, 2, 3, 1).reshape(fmap.shape[0], -1, fmap.shape[1]).float().numpy()


def featurise(model: Backbone, images: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """(N, H, W, 3) uint8 -> (N, grid * grid, dim) float32 frozen region features."""
    g, dim = model.cfg.grid, model.cfg.dim
    chunks = [regions(fmap) for fmap, _, _ in forward_batches(model, images, batch_size)]
    return np.concatenate(chunks) if chunks else np.zeros((0, g * g, dim), np.float32)


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """AP of ranking ``scores`` (M,) against binary ``labels`` (M,); NaN when there is no positive.

    The evaluation's own global AP (tie-aware, oracle-tested), on one row of M pairs.
    """
    relevant = np.asarray(labels, dtype=bool)[None, :]  # (1, M)
    if not relevant.any():
        return math.nan
    return pr_curve(
        np.asarray(scores, dtype=np.float32)[None, :], Relevance.matrix(relevant)
    ).average_precision()


def held_out_metrics(
    cell_logits: np.ndarray, global_logits: np.ndarray, scenes: Sequence[Scene], grid: int
) -> dict[str, Any]:
    """Attribute metrics of the heads on held-out images, next to what guessing scores.

    ``cell_logits`` (N, L, g, g), ``global_logits`` (N, T + C). Cell mean AP: the AP of each label
    over all held-out cells, averaged over the labels that occur (a constant guess scores each
    label's prevalence). Accuracies: argmax within a group on cells holding exactly one object,
    the empty flag at 0.5, tone and count argmax per image (guess: the most frequent class).
    """
    targets = cell_targets(scenes, grid)  # (N, L, g, g)
    scores = cell_logits.transpose(0, 2, 3, 1).reshape(-1, len(CELL_LABELS))  # (N*g*g, L)
    truth = targets.transpose(0, 2, 3, 1).reshape(-1, len(CELL_LABELS))
    aps = {label: average_precision(scores[:, j], truth[:, j]) for j, label in enumerate(CELL_LABELS)}
    present = [j for j, label in enumerate(CELL_LABELS) if not math.isnan(aps[label])]
    metrics: dict[str, Any] = {
        "images": len(scenes),
        "cells": int(truth.shape[0]),
        "cell_map": float(np.mean([aps[CELL_LABELS[j]] for j in present])),
        "cell_ap": {k: (None if math.isnan(v) else round(v, 4)) for k, v in aps.items()},
        "empty_accuracy": float(((scores[:, _EMPTY] > 0) == (truth[:, _EMPTY] > 0.5)).mean()),
    }
    chance: dict[str, float] = {
        "cell_map": float(np.mean([truth[:, j].mean() for j in present])),
        "empty_accuracy": float(max(truth[:, _EMPTY].mean(), 1 - truth[:, _EMPTY].mean())),
    }
    single = truth[:, _GROUPS["shape"]].sum(axis=1) == 1  # cells holding exactly one object
    for group, cols in _GROUPS.items():
        true_class = truth[single, cols].argmax(axis=1)
        metrics[f"{group}_accuracy"] = float((scores[single, cols].argmax(axis=1) == true_class).mean())
        chance[f"{group}_accuracy"] = float(np.bincount(true_class).max() / max(len(true_class), 1))
    glob = global_targets(scenes)  # (N, 2)
    tones = len(world.BACKGROUND_TONES)
    for name, logits, col in (
        ("tone", global_logits[:, :tones], 0),
        ("count", global_logits[:, tones:], 1),
    ):
        metrics[f"{name}_accuracy"] = float((logits.argmax(axis=1) == glob[:, col]).mean())
        chance[f"{name}_accuracy"] = float(np.bincount(glob[:, col]).max() / len(glob))
    metrics["single_object_cells"] = int(single.sum())
    metrics = {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}
    metrics["chance"] = {k: round(v, 4) for k, v in chance.items()}
    return metrics


def save_backbone(model: Backbone, path: str) -> None:
    """The frozen weights as safetensors (no pickle: loading runs no code)."""
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)


def load_backbone(path: str, cfg: BackboneConfig) -> Backbone:
    """The frozen backbone saved by :func:`save_backbone` with ``cfg`` (eval mode, no gradients)."""
    model = Backbone(cfg)
    model.load_state_dict(load_file(path))
    return model.eval().requires_grad_(False)
