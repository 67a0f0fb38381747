"""``icr index calibrate NEW --transfer-from INDEX``: a new collection served with a calibration fitted
elsewhere, said so in every answer.

A fresh index of a user's photos has no labels yet, and an empty ``min_relevance`` is no answer.
The checkpoint's own calibration (fitted by ``icr index calibrate`` on an index built from the same
checkpoint, e.g. its validation or benchmark index) is the best prior there is, so it is copied:
the maps, the fitting queries' evidence (the applicability check: a query unlike every fitted one
still gets no relevance) and the per-kind table. It is marked ``labels: "transferred"``, and its
``labels_note``, which the service repeats in every answer's warnings, says that it was not fitted
on this collection and how to fit one that is (``--labels``). The source's held-out evaluation is
not copied: it measured another gallery.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from icr.core.atomic import atomic_write_text
from icr.index.calibration import CALIBRATION_FILE, ServedCalibration
from icr.index.manifest import Manifest

TRANSFERRED = "transferred"
# What a transferred file keeps of its source: what the service applies and shows.
KEPT = ("format_version", "method", "global", "per_query", "evidence", "kinds", "fit", "score_for_relevance")


def transfer_calibration(index_dir: str | os.PathLike[str], source: str | os.PathLike[str]) -> dict[str, Any]:
    """Copy the calibration of ``source`` (an index folder or a ``calibration.json``) into
    ``index_dir``, marked as transferred; ValueError when it belongs to another checkpoint."""
    index_dir = Path(index_dir)
    manifest = Manifest.read(index_dir)
    source = Path(source)
    path = source / CALIBRATION_FILE if source.is_dir() else source
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no calibration to transfer; calibrate that index first (`icr index calibrate {source}`)"
        )
    served = ServedCalibration.read(path)  # checked as the service checks it
    info = served.info
    if info.get("checkpoint_sha256") != manifest.checkpoint_sha256:
        raise ValueError(
            f"{path} belongs to checkpoint {str(info.get('checkpoint_sha256'))[:12]}..., {index_dir} was "
            f"built from {manifest.checkpoint_sha256[:12]}...: a calibration only transfers between "
            "indices of the same checkpoint"
        )
    if info.get("format_version") not in (2, 3):
        raise ValueError(
            f"{path} is an old calibration format; recalibrate it with `icr index calibrate {source}`"
        )
    origin: dict[str, Any] = info.get("transferred_from") or {  # a transfer of a transfer keeps the origin
        "index": path.resolve().parent.name,
        "labels": info.get("labels"),
        "labels_note": served.labels_note,
    }
    out = {key: info[key] for key in KEPT if key in info}
    out |= {
        "checkpoint_sha256": manifest.checkpoint_sha256,
        "labels": TRANSFERRED,
        "labels_note": (
            f"transferred: fitted on another collection (index {origin['index']}, "
            f"{origin['labels']} labels), not on this one, so its relevance is a prior here, "
            "not a measurement; fit this collection's own with `icr index calibrate INDEX --labels FILE`"
        ),
        "transferred_from": origin,
    }
    atomic_write_text(index_dir / CALIBRATION_FILE, json.dumps(out, indent=2) + "\n")
    return out
