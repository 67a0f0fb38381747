"""Which captions are relevant to which images, served in blocks of rows for the metric engines.

Two sources, one interface:

* **annotations** (Flickr30k/COCO): each caption was written for exactly one image,
  ``img_of_cap[c]``; that is the only relevant pair of the caption.
* **ground truth** (the embedded benchmark, CxC-style extra positives): a dense boolean matrix
  ``(N_img, N_cap)``; a caption may be relevant to many images, and an image to many captions.

Metrics never materialise more than a block of the (N_img, N_cap) relevance matrix for the
annotation layout (COCO 5K is 125 M pairs), so both orientations are produced per block:
``image_rows`` for image queries (i2t) and ``caption_rows`` for caption queries (t2i).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Relevance:
    """Relevance of every (image, caption) pair; build with :meth:`annotations` or :meth:`matrix`."""

    n_img: int
    n_cap: int
    img_of_cap: np.ndarray | None = None  # (N_cap,) int64: annotation layout
    dense: np.ndarray | None = None  # (N_img, N_cap) bool: ground-truth layout

    @classmethod
    def annotations(cls, img_of_cap: np.ndarray | torch.Tensor, n_img: int | None = None) -> Relevance:
        """One relevant image per caption: ``img_of_cap[c]`` (image rows ``0 .. n_img-1``)."""
        if isinstance(img_of_cap, torch.Tensor):
            img_of_cap = img_of_cap.detach().cpu().numpy()
        layout = np.asarray(img_of_cap)
        if layout.ndim != 1:
            raise ValueError(f"img_of_cap must be 1-D (one image row per caption), got shape {layout.shape}")
        if layout.size and not np.issubdtype(layout.dtype, np.integer):
            raise ValueError(f"img_of_cap must hold integer image rows, got dtype {layout.dtype}")
        layout = layout.astype(np.int64, copy=False)
        if n_img is None:
            n_img = int(layout.max()) + 1 if layout.size else 0
        if layout.size and (layout.min() < 0 or layout.max() >= n_img):
            raise ValueError(
                f"img_of_cap values must be image rows in [0, {n_img}), got range "
                f"[{layout.min()}, {layout.max()}]"
            )
        return cls(n_img=int(n_img), n_cap=int(layout.size), img_of_cap=layout)

    @classmethod
    def matrix(cls, relevant: np.ndarray) -> Relevance:
        """Ground truth as a dense ``(N_img, N_cap)`` boolean matrix."""
        relevant = np.asarray(relevant)
        if relevant.ndim != 2 or relevant.dtype != np.bool_:
            raise ValueError(
                f"relevance matrix must be a 2-D boolean (N_img, N_cap) array, got shape "
                f"{relevant.shape} dtype {relevant.dtype}"
            )
        return cls(n_img=relevant.shape[0], n_cap=relevant.shape[1], dense=relevant)

    def union(self, other: Relevance) -> Relevance:
        """Pairs relevant in either (e.g. the annotations plus the ground truth), as a dense matrix."""
        if (self.n_img, self.n_cap) != (other.n_img, other.n_cap):
            raise ValueError(
                f"cannot combine relevance of shape {(self.n_img, self.n_cap)} with "
                f"{(other.n_img, other.n_cap)}"
            )
        return Relevance.matrix(self.image_rows(0, self.n_img) | other.image_rows(0, other.n_img))

    def check_shape(self, sim_shape: tuple[int, ...]) -> None:
        if tuple(sim_shape) != (self.n_img, self.n_cap):
            raise ValueError(
                f"similarity matrix has shape {tuple(sim_shape)} but the relevance describes "
                f"{self.n_img} images x {self.n_cap} captions (rows must be images, columns captions)"
            )

    def image_rows(self, start: int, stop: int) -> np.ndarray:
        """(stop - start, N_cap) bool: captions relevant to images ``start .. stop-1``."""
        if self.dense is not None:
            return self.dense[start:stop]
        return self.image_rows_at(np.arange(start, stop, dtype=np.int64))

    def _layout(self) -> np.ndarray:
        """``img_of_cap`` where there is no dense matrix: every constructor sets one of the two."""
        assert self.img_of_cap is not None  # annotations() and subset() set it whenever dense is None
        return self.img_of_cap

    def caption_rows(self, start: int, stop: int) -> np.ndarray:
        """(stop - start, N_img) bool: images relevant to captions ``start .. stop-1``."""
        return self.caption_rows_at(np.arange(start, stop, dtype=np.int64))

    def image_rows_at(self, images: np.ndarray) -> np.ndarray:
        """(len(images), N_cap) bool: captions relevant to the given image rows."""
        rows: np.ndarray  # numpy types fancy indexing and broadcast == of untyped arrays as Any
        if self.dense is not None:
            rows = self.dense[images]
        else:
            rows = self._layout()[None, :] == np.asarray(images, dtype=np.int64)[:, None]
        return rows

    def caption_rows_at(self, captions: np.ndarray) -> np.ndarray:
        """(len(captions), N_img) bool: images relevant to the given caption columns."""
        rows: np.ndarray  # as in image_rows_at: numpy gives these expressions no array type
        if self.dense is not None:
            rows = np.ascontiguousarray(self.dense[:, captions].T)
        else:
            rows = np.arange(self.n_img, dtype=np.int64)[None, :] == self._layout()[captions, None]
        return rows

    def num_pairs(self) -> int:
        """Number of relevant (image, caption) pairs."""
        return int(self.dense.sum()) if self.dense is not None else self.n_cap

    def positive_scores(self, sim: np.ndarray) -> np.ndarray:
        """(num_pairs,) scores of the relevant pairs, in no particular order."""
        scores: np.ndarray  # numpy types fancy indexing of an untyped array as Any
        if self.dense is None:
            scores = np.asarray(sim[self.img_of_cap, np.arange(self.n_cap)])
        else:
            scores = np.asarray(sim)[self.dense]
        return scores

    def subset(self, images: np.ndarray, captions: np.ndarray) -> Relevance:
        """The relevance between a subset of image rows and caption columns (rows renumbered)."""
        images = np.asarray(images, dtype=np.int64)
        captions = np.asarray(captions, dtype=np.int64)
        if self.dense is not None:
            return Relevance.matrix(self.dense[np.ix_(images, captions)])
        new_row = np.full(self.n_img, -1, dtype=np.int64)
        new_row[images] = np.arange(images.size)
        layout = new_row[self._layout()[captions]]
        if (layout < 0).any():
            raise ValueError("the caption subset holds captions whose image is not in the image subset")
        return Relevance(n_img=int(images.size), n_cap=int(captions.size), img_of_cap=layout)
