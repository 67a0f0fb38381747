"""Embed a dataset split with a trained dual encoder (validation, evaluation, indexing)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from icr.training.data.training_data import SplitData

if TYPE_CHECKING:  # annotations only: importing this module loads no model code
    from icr.training.models import DualEncoder


@contextmanager
def threads_beside_workers(workers: int, device: str | torch.device) -> Iterator[None]:
    """Torch's CPU threads while ``workers`` processes (e.g. distractor renderers) share this
    machine's cores: the cores they leave, at least one; restored on exit.

    OpenMP threads that lose their core to another process stall every barrier they reach: on
    2 cores with 2 render processes, embedding ran at 3,440 images/s with 2 torch threads and at
    4,551 with 1. FAISS shares torch's OpenMP runtime, so it gets the same count meanwhile.
    """
    if torch.device(device).type != "cpu" or workers < 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(before, len(os.sched_getaffinity(0)) - workers)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def embed_images(
    model: DualEncoder,
    data: SplitData,
    indices: np.ndarray | None = None,
    *,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> np.ndarray:
    """(N, D) float32 embeddings of ``data``'s images (all, or ``indices``), eval preprocessing."""
    indices = np.arange(data.num_images) if indices is None else np.asarray(indices)
    out = []
    starts = range(0, len(indices), batch_size)
    for start in tqdm(starts, desc="embedding images", unit="batch", disable=not progress, leave=False):
        chunk = indices[start : start + batch_size]
        out.append(embed_image_batch(model, [data.get_image(int(i)) for i in chunk], device=device))
    return np.concatenate(out) if out else np.zeros((0, model.embed_dim), np.float32)


@torch.no_grad()
def embed_image_batch(
    model: DualEncoder, images: Sequence[Any] | np.ndarray, *, device: str | torch.device = "cpu"
) -> np.ndarray:
    """(b, D) float32 embeddings of one batch of images (PIL, (H, W, 3) uint8, or precomp features);
    a rendered (b, S, S, 3) uint8 array is normalised in one operation."""
    transform = model.image_transform(train=False)
    was_training = model.training
    model.eval()
    try:
        # eval transforms are deterministic; the generator argument is never called
        x = transform.stack(images, lambda _j: np.random.default_rng(0)).to(device)  # (b, ...)
        return model.encode_image(x).float().cpu().numpy()  # (b, D)
    finally:
        model.train(was_training)


@torch.no_grad()
def embed_captions(
    model: DualEncoder,
    captions: list[str],
    *,
    batch_size: int = 512,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> np.ndarray:
    """(N, D) float32 embeddings of ``captions``."""
    was_training = model.training
    model.eval()
    out = []
    starts = range(0, len(captions), batch_size)
    for start in tqdm(starts, desc="embedding captions", unit="batch", disable=not progress, leave=False):
        batch = {k: v.to(device) for k, v in model.tokenize(captions[start : start + batch_size]).items()}
        out.append(model.encode_text(batch).float().cpu().numpy())  # (b, D)
    model.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, model.embed_dim), np.float32)


def open_embeddings(path: str | Path, dim: int) -> np.ndarray:
    """A memory-mapped (N, ``dim``) float .npy of precomputed embeddings (e.g. distractors), checked."""
    try:
        emb: np.ndarray = np.load(path, mmap_mode="r")  # a .npy file: one memmap array
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read embeddings ({err}); expected an (N, D) float32 .npy") from None
    if emb.ndim != 2 or emb.shape[1] != dim or not np.issubdtype(emb.dtype, np.floating):
        raise ValueError(
            f"{path}: embeddings must be a float (N, {dim}) array to match the checkpoint, got "
            f"{emb.dtype} {emb.shape}"
        )
    return emb
