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

Protocols built on these ranks (COCO 1K folds, mAP@k, R-precision) only need
:func:`retrieval_ranks` on a sub-matrix and :func:`direction_metrics` / :func:`recall_metrics`.
"""

from __future__ import annotations

import numpy as np
import torch

RECALL_AT: tuple[int, ...] = (1, 5, 10)  # the K of R@K; rsum is the sum of these over both directions
DIRECTIONS: tuple[str, ...] = ("i2t", "t2i")

# Elements of the similarity matrix processed per block: bounds the boolean temporaries to a few MB
# whatever the matrix size (COCO 5K is 5,000 x 25,000 = 125 M scores).
_BLOCK_ELEMENTS = 1 << 22

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
    return img @ cap.T  # (N_img, N_cap) float32


def _check_layout(img_of_cap: np.ndarray | torch.Tensor, n_img: int, n_cap: int) -> np.ndarray:
    """``img_of_cap`` as an int64 array after checking it describes a valid caption->image map."""
    if isinstance(img_of_cap, torch.Tensor):
        img_of_cap = img_of_cap.detach().cpu().numpy()
    layout = np.asarray(img_of_cap)
    if layout.shape != (n_cap,):
        raise ValueError(
            f"img_of_cap must be 1-D with one entry per caption (similarity column), expected shape "
            f"({n_cap},), got {layout.shape}"
        )
    if n_cap and not np.issubdtype(layout.dtype, np.integer):
        raise ValueError(f"img_of_cap must hold integer image rows, got dtype {layout.dtype}")
    layout = layout.astype(np.int64, copy=False)
    if n_cap and (layout.min() < 0 or layout.max() >= n_img):
        raise ValueError(
            f"img_of_cap values must be image rows in [0, {n_img}), got range "
            f"[{layout.min()}, {layout.max()}]"
        )
    captions_per_image = np.bincount(layout, minlength=n_img)  # (N_img,)
    if n_img == 0 or (captions_per_image == 0).any():
        missing = np.flatnonzero(captions_per_image == 0)[:5].tolist()
        raise ValueError(
            f"every image needs at least one caption for i2t ranks; images {missing} (first 5 shown) "
            f"have none (got {n_img} images, {n_cap} captions) - drop images without captions"
        )
    return layout


def retrieval_ranks(
    sim: np.ndarray, img_of_cap: np.ndarray | torch.Tensor, *, block_rows: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """1-based ranks of the ground truth: ``(i2t_ranks (N_img,), t2i_ranks (N_cap,))``, int64.

    ``sim``: (N_img, N_cap) scores, rows images, columns captions. ``img_of_cap``: (N_cap,) image
    row of each caption; every image needs at least one caption. Ties and NaN are pessimistic (see
    the module docstring). ``block_rows`` image rows are compared at a time (default: about 4 M
    scores per block), so memory stays bounded and there is no Python loop per query.
    """
    if isinstance(sim, torch.Tensor):
        sim = sim.detach().cpu().numpy()
    sim = np.asarray(sim)
    if sim.ndim != 2:
        raise ValueError(f"sim must be a 2-D (N_img, N_cap) score matrix, got shape {sim.shape}")
    if np.issubdtype(sim.dtype, np.integer):
        sim = sim.astype(np.float64)
    elif not np.issubdtype(sim.dtype, np.floating):
        raise ValueError(f"sim must hold real scores, got dtype {sim.dtype}")
    n_img, n_cap = sim.shape
    layout = _check_layout(img_of_cap, n_img, n_cap)  # (N_cap,)
    if block_rows is None:
        block_rows = max(1, _BLOCK_ELEMENTS // max(n_cap, 1))
    if block_rows < 1:
        raise ValueError(f"block_rows must be a positive number of rows, got {block_rows}")

    pos_score = sim[layout, np.arange(n_cap)]  # (N_cap,) score of each caption with its own image
    # i2t threshold: the best ground-truth caption's score. np.maximum propagates NaN, so a NaN
    # positive makes the threshold NaN and, below, nothing is "strictly below" it: worst rank.
    best = np.full(n_img, -np.inf, dtype=sim.dtype)  # (N_img,)
    with np.errstate(invalid="ignore"):  # NaN is handled on purpose, not an accident to warn about
        np.maximum.at(best, layout, pos_score)
    # Every count below is "candidates NOT strictly below the threshold" (>=, or NaN on either
    # side). The full-row count includes the image's own captions that reach its threshold; they
    # are the positives themselves, not competitors, so they are subtracted again.
    own_not_below = np.bincount(layout[~(pos_score < best[layout])], minlength=n_img)  # (N_img,)

    i2t_not_below = np.empty(n_img, dtype=np.int64)  # (N_img,)
    t2i_below = np.zeros(n_cap, dtype=np.int64)  # (N_cap,) images strictly below each caption's GT
    for start in range(0, n_img, block_rows):
        stop = min(start + block_rows, n_img)
        block = sim[start:stop]  # (b, N_cap)
        i2t_not_below[start:stop] = n_cap - np.count_nonzero(block < best[start:stop, None], axis=1)
        t2i_below += np.count_nonzero(block < pos_score[None, :], axis=0)

    i2t_ranks = i2t_not_below - own_not_below + 1  # (N_img,)
    # The GT image itself is never strictly below its own score, so the images not below the GT are
    # the competitors plus the GT: that count is already competitors + 1.
    t2i_ranks = n_img - t2i_below  # (N_cap,)
    return i2t_ranks, t2i_ranks


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
