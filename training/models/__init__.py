"""Inference-safe model code: the dual encoder, its towers, image preprocessing and the config.

Nothing here imports the losses, the trainer, ``index/`` or ``service/``; transformers is imported
only by the towers that need it, and torchvision only inside a try when a ``.pth`` backbone is used.
"""

from icr.training.models.config import normalize_model_config
from icr.training.models.dual_encoder import DualEncoder, build_model
from icr.training.models.glove import load_glove

__all__ = ["DualEncoder", "build_model", "load_glove", "normalize_model_config"]
