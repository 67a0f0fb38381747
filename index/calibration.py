"""``icr index calibrate``: fit score -> probability of relevance for an index, store ``calibration.json``.

The map is fitted on every (image, caption) pair of a held-out split (validation by default) of
the index's dataset, embedded with the index's own checkpoint: labels are the annotations, or on
the embedded benchmark the generator's ground truth (so a caption's other true images count as
relevant, not as errors). It is the same cosine score for text->image and image->text, so one
calibration serves both index modalities.

``calibration.json`` holds the fitted map (:class:`training.metrics.calibration.Calibration`), the
checkpoint sha256 it belongs to, its ECE on the fit split and on a second split (test by default),
and the raw-score thresholds that reach global precision 0.5 / 0.8 / 0.9 on the fit split (with the
recall they keep), next to the score at which the calibrated relevance reaches those values.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from index.manifest import Manifest, check_compatible
from training.atomic import atomic_write_text

CALIBRATION_FILE = "calibration.json"
TARGETS: tuple[float, ...] = (0.5, 0.8, 0.9)


def calibrate_index(
    index_dir: str | os.PathLike[str],
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    data: str | os.PathLike[str] | None = None,
    split: str = "auto",
    eval_split: str | None = "test",
    method: str = "isotonic",
    device: str = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """Fit, evaluate and write ``calibration.json`` into ``index_dir``; returns its content.

    ``checkpoint`` / ``data`` default to those recorded in the index manifest; the checkpoint must
    be the one the index was built from. ``split``: ``auto`` = val (precomp: dev).
    """
    from training.checkpoint import load_checkpoint
    from training.evaluate_checkpoint import (
        EvalOptions,
        calibration_split_for,
        embed_split,
        fit_split_calibration,
    )
    from training.metrics.calibration import CALIBRATION_METHODS, calibration_error
    from training.metrics.global_pr import pr_curve

    if method not in CALIBRATION_METHODS:
        raise ValueError(f"--method must be one of {', '.join(CALIBRATION_METHODS)}, got {method!r}")
    index_dir = Path(index_dir)
    manifest = Manifest.read(index_dir)
    checkpoint = Path(checkpoint or manifest.checkpoint_path)
    data = Path(data or manifest.data["path"])
    model, config = load_checkpoint(checkpoint, device)
    check_compatible(manifest, config, index_dir=index_dir, checkpoint_path=checkpoint)
    fit_split = calibration_split_for(data, split)
    if fit_split is None:
        raise ValueError(f"{data}: no validation split to calibrate on; pass --split NAME")
    options = EvalOptions(device=device, progress=progress)
    held_out = embed_split(model, data, fit_split, options)
    calibration = fit_split_calibration(held_out, method)
    labels, relevance = held_out.labels()
    sim = held_out.sim  # (N_img, N_cap)
    curve = pr_curve(sim, relevance)
    ece = {fit_split: calibration_error(sim, relevance, calibration)["ece"]}
    if eval_split and eval_split != fit_split:
        test = embed_split(model, data, eval_split, options)
        ece[eval_split] = calibration_error(test.sim, test.labels()[1], calibration)["ece"]
    out = {
        **calibration.to_dict(),
        "checkpoint_sha256": manifest.checkpoint_sha256,
        "labels": labels,
        "ece": ece,
        "score_thresholds_for_precision": {str(t): curve.threshold_for_precision(t) for t in TARGETS},
        "score_for_relevance": {str(t): calibration.score_for(t) for t in TARGETS},
    }
    atomic_write_text(index_dir / CALIBRATION_FILE, json.dumps(out, indent=2) + "\n")
    return out
