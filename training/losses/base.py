"""Base class and registry of the training objectives.

Every objective is a function of the similarity matrix ``S = img @ cap.T`` (rows images, columns
captions, cosine because both towers L2-normalise) and of which pairs are positive. The base class
does the shape checks and builds ``S`` and the positive mask once; a subclass implements the single
hook :meth:`ContrastiveLoss.terms` and returns named terms (for logging and analysis).

Batch layouts (``sampling``):

* ``"caption"`` (every objective but SmoothAP): ``N`` captions and the ``N`` images they describe,
  row ``i`` of ``img`` pairs with row ``i`` of ``cap``; the positive of query ``i`` is ``S[i, i]``.
  Caption-level sampling can put two captions of one image in a batch: with ``mask_duplicates``
  (default) such pairs are positives, not negatives (the seed code counts them as negatives).
* ``"image"`` (SmoothAP): ``B`` distinct images and their ``k`` captions each; ``pos[i, j]`` is true
  when caption ``j`` describes image ``i``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn

LOSSES: dict[str, type[ContrastiveLoss]] = {}

# The class a decorator receives and returns unchanged, so the decorated class keeps its own type.
_LossClass = TypeVar("_LossClass", bound="type[ContrastiveLoss]")


def register(name: str) -> Callable[[_LossClass], _LossClass]:
    """Class decorator: make a loss selectable by ``name`` (the user-facing vocabulary)."""

    def decorate(cls: _LossClass) -> _LossClass:
        if name in LOSSES:
            raise RuntimeError(f"loss {name!r} registered twice: {LOSSES[name].__name__}, {cls.__name__}")
        cls.name = name
        LOSSES[name] = cls
        return cls

    return decorate


class ContrastiveLoss(nn.Module):
    """A training objective over one batch of image and caption embeddings."""

    name: ClassVar[str] = ""
    # "caption" or "image", see the module docstring; an instance may choose its own (ntxent_multi)
    sampling: str = "caption"
    # Objectives whose logits are the similarities times one constant name the parameter that sets it:
    # "temperature" (logits = S / temperature) or "scale" (logits = scale * S). They compute their
    # logits with :meth:`scaled`, so a model's learned logit scale can replace the constant.
    logit_scale_param: ClassVar[str | None] = None

    def __init__(self, mask_duplicates: bool = True) -> None:
        super().__init__()
        self.mask_duplicates = mask_duplicates
        self.epoch = 0
        self._learned_scale: Tensor | None = None  # set by forward for the duration of one call

    # --- the hook ---------------------------------------------------------------------------
    def terms(self, sim: Tensor, pos: Tensor) -> dict[str, Tensor]:
        """Named scalar terms whose sum is the loss. ``sim``: (Ni, Nc) float, ``pos``: (Ni, Nc) bool."""
        raise NotImplementedError

    # --- shared machinery -------------------------------------------------------------------
    def forward(
        self,
        img: Tensor,
        cap: Tensor,
        img_ids: Tensor,
        cap_img_ids: Tensor,
        relevant: Tensor | None = None,
        logit_scale: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """``img``: (Ni, D), ``cap``: (Nc, D), ``img_ids``: (Ni,), ``cap_img_ids``: (Nc,) dataset image ids;
        ``relevant`` (Ni, Nc) bool: pairs known to be relevant beyond the annotations (e.g. the embedded
        benchmark's ground truth), positives like a caption's own image; ``logit_scale`` () : a learned
        factor that replaces the objective's 1 / temperature or scale (only for objectives with one).

        Returns the named terms plus ``"loss"``, their sum (the value to back-propagate).
        """
        if logit_scale is not None and self.logit_scale_param is None:
            raise ValueError(f"{self.name} has no temperature or logit scale for a learned one to replace")
        sim, pos = self.batch_similarity(img, cap, img_ids, cap_img_ids, relevant)
        self._learned_scale = logit_scale
        try:
            out = self.terms(sim, pos)
        finally:
            self._learned_scale = None
        out["loss"] = torch.stack(list(out.values())).sum()
        return out

    def scaled(self, sim: Tensor) -> Tensor:
        """``sim`` as logits: times the learned logit scale given to :meth:`forward`, else divided by the
        objective's ``temperature`` or times its ``scale`` (see ``logit_scale_param``)."""
        if self._learned_scale is not None:
            return sim * self._learned_scale.to(sim.dtype)
        if self.logit_scale_param == "temperature":
            temperature: float = getattr(self, "temperature")  # noqa: B009 - set by the subclass
            return sim / temperature
        if self.logit_scale_param == "scale":
            scale: float = getattr(self, "scale")  # noqa: B009 - set by the subclass
            return scale * sim
        raise ValueError(f"{self.name} has no temperature or logit scale")

    def fixed_logit_scale(self) -> float | None:
        """The objective's own factor of the similarities (1 / temperature or scale); None without one."""
        if self.logit_scale_param is None:
            return None
        value = float(getattr(self, self.logit_scale_param))
        return 1.0 / value if self.logit_scale_param == "temperature" else value

    def batch_similarity(
        self, img: Tensor, cap: Tensor, img_ids: Tensor, cap_img_ids: Tensor, relevant: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(sim, pos)``, (Ni, Nc) each, as :meth:`terms` receives them (checked layout, masks applied)."""
        if img.dim() != 2 or cap.dim() != 2 or img.shape[1] != cap.shape[1]:
            raise ValueError(
                f"{self.name}: expected (Ni, D) and (Nc, D) embeddings, got {tuple(img.shape)} "
                f"and {tuple(cap.shape)}"
            )
        if img_ids.shape != (img.shape[0],) or cap_img_ids.shape != (cap.shape[0],):
            raise ValueError(f"{self.name}: ids must be 1-D and match the embeddings' first dimension")
        # fp32 even under autocast (softmax/sigmoid need it); fp64 inputs stay fp64 (oracle tests)
        dtype = torch.promote_types(torch.promote_types(img.dtype, cap.dtype), torch.float32)
        sim = img.to(dtype) @ cap.to(dtype).T  # (Ni, Nc)
        pos = img_ids[:, None] == cap_img_ids[None, :]  # (Ni, Nc)
        if self.sampling == "caption":
            if img.shape[0] != cap.shape[0]:
                raise ValueError(
                    f"{self.name} needs caption-level batches (one image row per caption), "
                    f"got {img.shape[0]} images and {cap.shape[0]} captions"
                )
            if not bool(pos.diagonal().all()):
                raise ValueError(f"{self.name}: row i of the images must be the image of caption i")
            if not self.mask_duplicates:
                pos = torch.eye(len(img_ids), dtype=torch.bool, device=sim.device)
        elif not bool(pos.any(dim=0).all()):
            raise ValueError(f"{self.name}: every caption's image must be in the batch")
        if relevant is not None:
            if relevant.shape != pos.shape or relevant.dtype != torch.bool:
                raise ValueError(
                    f"{self.name}: relevant must be a bool tensor of shape {tuple(pos.shape)}, "
                    f"got {relevant.dtype} {tuple(relevant.shape)}"
                )
            pos = pos | relevant
        return sim, pos

    def on_epoch_start(self, epoch: int) -> None:
        """Called by the trainer before each epoch (0-based); schedules such as warm-ups use it."""
        self.epoch = epoch

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Constructor parameters and their defaults (for the README, configs and checkpoints)."""
        params: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            if issubclass(klass, ContrastiveLoss):
                for p in list(inspect.signature(klass.__init__).parameters.values())[1:]:
                    if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
                        params[p.name] = p.default
        return params

    def params(self) -> dict[str, Any]:
        """This instance's parameters (same keys as :meth:`defaults`)."""
        return {key: getattr(self, key) for key in self.defaults()}
