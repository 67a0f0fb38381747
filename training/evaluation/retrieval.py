"""Image-caption retrieval metrics (VSE++ protocol) used to validate and select checkpoints.

Layout: ``img_emb`` has one row per *distinct* image, ``cap_emb`` one row per caption, and
``img_of_cap[c]`` is the image row that caption ``c`` describes. The seeds' layout (5N image rows,
each image repeated once per caption, captions ``5i .. 5i+4`` of image ``i``) maps to
``img_emb[::5]`` with ``img_of_cap = np.arange(5 * N) // 5``; any number of captions per image and
any caption order work.

* i2t ("image annotation"): query = image ``i``, candidates = all captions; the rank is that of its
  *best-ranked* ground-truth caption.
* t2i ("image search"): query = caption ``c``, candidates = all images; the rank is that of
  ``img_of_cap[c]``.

Ranks are 1-based (rank 1 = retrieved first).

Ties are resolved *pessimistically*: the rank of a positive is 1 + the number of non-positive
candidates whose score is >= the positive's. The seeds rank with ``np.argsort``, whose order among
equal scores depends on memory layout, so a collapsed model (all scores equal) can score R@1 = 100
there and win model selection; here it gets the worst possible rank. For the same reason a NaN
score counts against the query: a NaN candidate ranks above the positive, and a NaN positive (for
i2t: any NaN ground-truth caption score) ranks last.

This module is the small API the trainer validates with; the engine and the full metric set
(mAP@k, R-precision, COCO 1K folds, PR-AUC, calibration) live in :mod:`icr.training.evaluation.metrics`.
"""

from __future__ import annotations

import numpy as np
import torch

from icr.training.evaluation.metrics.ranking import (
    DIRECTIONS,
    RECALL_AT,
    as_score_matrix,
    first_relevant_ranks,
)
from icr.training.evaluation.metrics.relevant_pairs import Relevance

ArrayOrTensor = np.ndarray | torch.Tensor


def _embeddings_as_numpy(x: ArrayOrTensor, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to(device="cpu", dtype=torch.float32).numpy()
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D (N, D) array of embeddings, got shape {x.shape}")
    return x


def similarity(img_emb: ArrayOrTensor, cap_emb: ArrayOrTensor) -> np.ndarray:
    """Score matrix ``img_emb @ cap_emb.T`` as float32 numpy, shape (N_img, N_cap).

    Cosine similarity when both are L2-normalised (the models' encoders do it). Two tensors are
    multiplied on their device (a GPU does COCO 5K in milliseconds), then copied to the CPU.
    """
    if isinstance(img_emb, torch.Tensor) and isinstance(cap_emb, torch.Tensor):
        if img_emb.dim() != 2 or cap_emb.dim() != 2 or img_emb.shape[1] != cap_emb.shape[1]:
            raise ValueError(
                f"expected (N_img, D) and (N_cap, D) embeddings with the same D, got "
                f"{tuple(img_emb.shape)} and {tuple(cap_emb.shape)}"
            )
        with torch.no_grad():
            sim = img_emb.float() @ cap_emb.to(img_emb.device).float().T  # (N_img, N_cap)
        return sim.cpu().numpy()
    img = _embeddings_as_numpy(img_emb, "img_emb")  # (N_img, D)
    cap = _embeddings_as_numpy(cap_emb, "cap_emb")  # (N_cap, D)
    if img.shape[1] != cap.shape[1]:
        raise ValueError(
            f"img_emb and cap_emb must have the same embedding size, got {img.shape[1]} and {cap.shape[1]}"
        )
    sim_np: np.ndarray = img @ cap.T  # (N_img, N_cap) float32
    return sim_np


def _check_layout(img_of_cap: np.ndarray | torch.Tensor, n_img: int, n_cap: int) -> Relevance:
    """The annotation relevance after checking ``img_of_cap`` describes a valid caption->image map."""
    if isinstance(img_of_cap, torch.Tensor):
        img_of_cap = img_of_cap.detach().cpu().numpy()
    layout = np.asarray(img_of_cap)
    if layout.shape != (n_cap,):
        raise ValueError(
            f"img_of_cap must be 1-D with one entry per caption (similarity column), expected shape "
            f"({n_cap},), got {layout.shape}"
        )
    relevance = Relevance.annotations(layout, n_img)
    assert relevance.img_of_cap is not None  # annotations() builds the annotation layout
    captions_per_image = np.bincount(relevance.img_of_cap, minlength=n_img)  # (N_img,)
    if n_img == 0 or (captions_per_image == 0).any():
        missing = np.flatnonzero(captions_per_image == 0)[:5].tolist()
        raise ValueError(
            f"every image needs at least one caption for i2t ranks; images {missing} (first 5 shown) "
            f"have none (got {n_img} images, {n_cap} captions) - drop images without captions"
        )
    return relevance


def retrieval_ranks(
    sim: np.ndarray, img_of_cap: np.ndarray | torch.Tensor, *, block_rows: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """1-based ranks of the ground truth: ``(i2t_ranks (N_img,), t2i_ranks (N_cap,))``, int64.

    ``sim``: (N_img, N_cap) scores, rows images, columns captions. ``img_of_cap``: (N_cap,) image
    row of each caption; every image needs at least one caption. Ties and NaN are pessimistic (see
    the module docstring). ``block_rows`` queries are ranked at a time (default: about 4 M scores
    per block), so memory stays bounded and there is no Python loop per query.
    """
    sim = as_score_matrix(sim)
    relevance = _check_layout(img_of_cap, *sim.shape)
    if block_rows is not None and block_rows < 1:
        raise ValueError(f"block_rows must be a positive number of rows, got {block_rows}")
    i2t, t2i = (first_relevant_ranks(sim, relevance, d, block_rows=block_rows) for d in DIRECTIONS)
    return i2t, t2i


def direction_metrics(ranks: np.ndarray, prefix: str) -> dict[str, float]:
    """``{prefix}_r1/_r5/_r10`` (percent), ``{prefix}_medr`` and ``{prefix}_meanr`` of 1-based ranks.

    medr = floor(median rank), which equals the seeds' ``floor(median(0-based ranks)) + 1``.
    """
    ranks = np.asarray(ranks)
    if ranks.ndim != 1 or ranks.size == 0:
        raise ValueError(f"{prefix} ranks must be a non-empty 1-D array, got shape {ranks.shape}")
    if not np.issubdtype(ranks.dtype, np.integer) or ranks.min() < 1:
        raise ValueError(f"{prefix} ranks must be 1-based integers (>= 1); use retrieval_ranks() to get them")
    metrics = {f"{prefix}_r{k}": float(100.0 * np.mean(ranks <= k)) for k in RECALL_AT}
    metrics[f"{prefix}_medr"] = float(np.floor(np.median(ranks)))
    metrics[f"{prefix}_meanr"] = float(np.mean(ranks))
    return metrics


def recall_metrics(i2t_ranks: np.ndarray, t2i_ranks: np.ndarray) -> dict[str, float]:
    """R@1/5/10, medr, meanr for both directions, and ``rsum`` (sum of the six recalls, max 600)."""
    metrics = {**direction_metrics(i2t_ranks, "i2t"), **direction_metrics(t2i_ranks, "t2i")}
    metrics["rsum"] = float(sum(metrics[f"{d}_r{k}"] for d in DIRECTIONS for k in RECALL_AT))
    return metrics


def evaluate_embeddings(
    img_emb: ArrayOrTensor,
    cap_emb: ArrayOrTensor,
    img_of_cap: np.ndarray | torch.Tensor,
    *,
    block_rows: int | None = None,
) -> dict[str, float]:
    """:func:`recall_metrics` of ``similarity(img_emb, cap_emb)`` (one row per distinct image)."""
    sim = similarity(img_emb, cap_emb)  # (N_img, N_cap)
    return recall_metrics(*retrieval_ranks(sim, img_of_cap, block_rows=block_rows))
