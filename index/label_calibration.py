"""``icr index calibrate INDEX --labels FILE``: relevance for a user's own collection, from their labels.

A labels file (jsonl, csv or parquet) holds one judged pair per row: ``query`` (the text a user
searched), ``image`` (the index's image id, or its path: absolute, relative to the gallery folder, or
a file name that is unique in the index) and ``relevant`` (true/false, 0/1, or a grade: relevant
from ``relevant_from`` up). Each query searches the index to the service's depth, as the service
does, and a labelled pair takes the score the service gave that hit; a pair the search does not
reach is counted and left out (the service never shows it, so no threshold acts on it).

The map (:mod:`icr.training.evaluation.metrics.label_bounds`) gives each score range a one-sided
Clopper-Pearson lower bound of the fraction relevant, and the labelled queries' words become the
calibration's evidence: a query unlike all of them gets no relevance from the service. The report
says, for min_relevance 0.5 / 0.8 / 0.9, where the threshold falls, what the labels above it show,
how many more labels would bring the bound there to +-0.05, and what the map delivers out of fold
(on pairs whose query and image it was not fitted on).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from icr.core.atomic import atomic_write_text
from icr.core.devices import resolve_device
from icr.index.calibration import (
    CALIBRATION_FILE,
    CALIBRATION_FORMAT,
    DEFAULT_DEPTH,
    TARGETS,
    search_hits,
    searchable_index,
)
from icr.index.live_index import LiveIndex
from icr.index.manifest import Manifest, check_compatible
from icr.index.metadata import METADATA_FILE, MetadataStore
from icr.index.photo_folder import read_rows
from icr.training.checkpoint import load_checkpoint
from icr.training.embedding import embed_captions
from icr.training.evaluation.metrics.label_bounds import (
    DEFAULT_CONFIDENCE,
    DEFAULT_MIN_BLOCK,
    HALF_WIDTH,
    Block,
    fit_label_map,
    labels_for_half_width,
    out_of_fold,
)
from icr.training.evaluation.metrics.query_evidence import QueryEvidence

LABEL_COLUMNS = ("query", "image", "relevant")
USER_LABELS = "user"


@dataclass(frozen=True)
class Label:
    """One judged (query, image) pair as the labels file gives it."""

    query: str
    image: int | str  # an index id, or a path / file name
    relevant: bool
    row: int  # 1-based, for messages


def read_labels(path: str | os.PathLike[str], relevant_from: float = 1.0) -> list[Label]:
    """The labels of a jsonl, csv or parquet file; ValueError naming the file, the row and the fix."""
    path = Path(path)
    rows = read_rows(path, "labels")
    if not rows:
        raise ValueError(
            f"{path}: no labels; one row per judged pair with columns {', '.join(LABEL_COLUMNS)}"
        )
    labels = []
    for n, row in enumerate(rows, 1):
        where = f"{path}: row {n}"
        missing = [c for c in LABEL_COLUMNS if row.get(c) is None]
        if missing:
            raise ValueError(f"{where}: no {', '.join(missing)}; every row needs {', '.join(LABEL_COLUMNS)}")
        query, image, value = row["query"], row["image"], row["relevant"]
        if not isinstance(query, str) or not query.strip():
            raise ValueError(f"{where}: query must be non-empty text, got {query!r}")
        if isinstance(image, bool) or not isinstance(image, int | str) or image == "":
            raise ValueError(f"{where}: image must be an index id or an image path, got {image!r}")
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            value = value.strip().lower() == "true"
        if not isinstance(value, bool | int | float) or isinstance(value, float) and not np.isfinite(value):
            raise ValueError(f"{where}: relevant must be true/false, 0/1 or a grade, got {value!r}")
        labels.append(Label(query.strip(), image, float(value) >= relevant_from, n))
    return labels


def resolve_images(
    labels: list[Label], metadata: MetadataStore, gallery: Path | None, ids_end: int | None = None
) -> np.ndarray:
    """(n,) index id of each label's image; ValueError listing images the index does not hold.
    ``ids_end``: ids below it name images (a living index's, added ones included; default: the
    build's)."""
    by_source: dict[str, int] = {}
    by_name: dict[str, list[tuple[str, int]]] = {}  # file name -> (source, id) of every file so named
    for image_id, source in metadata.gallery_sources():
        by_source[source] = image_id
        by_name.setdefault(Path(source).name, []).append((source, image_id))
    # An id names any image the index holds, distractors included: a distractor the search page
    # showed and someone judged is as much evidence as a gallery hit. Paths and names resolve among
    # the gallery's own files only (a distractor has no file of the user's).
    known = range(metadata.count() if ids_end is None else ids_end)
    out, unknown = np.empty(len(labels), np.int64), []
    for k, label in enumerate(labels):
        found = _image_id(label.image, known, by_source, by_name, gallery)
        if found is None:
            unknown.append(f"row {label.row}: {label.image!r}")
        else:
            out[k] = found
    if unknown:
        raise ValueError(
            f"{len(unknown)} labelled image(s) are not in this index ({'; '.join(unknown[:5])}); name an "
            "image by its id (as search results give it), its absolute path, its path relative to the "
            "gallery folder, or its file name when that is unique in the index"
        )
    return out


def _image_id(
    image: int | str,
    known: range,
    by_source: dict[str, int],
    by_name: dict[str, list[tuple[str, int]]],
    gallery: Path | None,
) -> int | None:
    if isinstance(image, int) or image.isdigit():
        return int(image) if int(image) in known else None
    for candidate in (image, str(Path(image).expanduser().resolve())):
        if candidate in by_source:
            return by_source[candidate]
    if gallery is not None and str(gallery / image) in by_source:
        return by_source[str(gallery / image)]
    # a file name, or a path relative to the photo folder (wherever that folder is): the one file
    # whose source ends with it
    relative = Path(image).as_posix().removeprefix("./")
    matches = [i for source, i in by_name.get(Path(image).name, []) if f"/{source}".endswith(f"/{relative}")]
    return matches[0] if len(matches) == 1 else None


def calibrate_from_labels(
    index_dir: str | os.PathLike[str],
    labels_file: str | os.PathLike[str] | Sequence[Label],
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    depth: int = DEFAULT_DEPTH,
    confidence: float = DEFAULT_CONFIDENCE,
    min_block: int = DEFAULT_MIN_BLOCK,
    relevant_from: float = 1.0,
    device: str = "auto",
    progress: bool = True,
    live: LiveIndex | None = None,
) -> dict[str, Any]:
    """Fit the lower-bound map on the labels (a labels file, or :class:`Label` rows such as the
    search page's feedback), judge it out of fold, write ``calibration.json`` (replacing the one
    there, atomically); returns its content. ``live``: the served living index over ``index_dir``
    (the service's refit), searched as it is now, so that labels on images added since the build
    count; without it the folder's index as built."""
    if depth < 1:
        raise ValueError(f"--depth must be >= 1, got {depth}")
    index_dir = Path(index_dir)
    if isinstance(labels_file, str | os.PathLike):
        labels, source = read_labels(labels_file, relevant_from), Path(labels_file).name
    else:
        labels, source = list(labels_file), "feedback"
        if not labels:
            raise ValueError(f"no labels for {index_dir} yet: mark hits relevant or not on the search page")
    manifest = Manifest.read(index_dir)
    if manifest.modality != "image":
        raise ValueError(f"{index_dir} holds {manifest.modality} vectors; labels calibrate an image index")
    checkpoint = Path(checkpoint or manifest.checkpoint_path)
    device = resolve_device(device)
    model, config = load_checkpoint(checkpoint, device)
    check_compatible(manifest, config, index_dir=index_dir, checkpoint_path=checkpoint)
    if live is None:
        index = searchable_index(index_dir, manifest)  # its files checked against the manifest first
    with MetadataStore.open(index_dir / METADATA_FILE) as metadata:
        gallery = manifest.data.get("path")
        ids_end = None if live is None else live.state.ids_end
        image_ids = resolve_images(labels, metadata, Path(gallery) if gallery else None, ids_end)

    queries = sorted({label.query for label in labels})
    emb = embed_captions(model, queries, device=device, progress=progress)  # (Q, D)
    if live is None:
        hits = list(zip(*search_hits(index, emb, depth), strict=True))  # Q x ((depth,), (depth,))
    else:
        state = live.refresh()
        hits = [live.search(emb[q : q + 1], depth, state) for q in range(len(queries))]
    served = {  # (query, image id) -> the score the service gives that hit
        (queries[q], int(i)): float(s)
        for q, (scores, ids) in enumerate(hits)
        for s, i in zip(scores, ids, strict=True)
    }
    keep = [k for k, label in enumerate(labels) if (label.query, int(image_ids[k])) in served]
    if not keep:
        raise ValueError(
            f"none of the {len(labels)} labelled pairs is among its query's top {depth} hits in "
            f"{index_dir}: label hits the service returns (or search deeper with --depth)"
        )
    pair_scores = np.array([served[(labels[k].query, int(image_ids[k]))] for k in keep])
    relevant = np.array([labels[k].relevant for k in keep])
    if not relevant.any():
        raise ValueError(f"no labelled hit is relevant: {len(keep)} pairs, all judged not relevant")
    relevance_map, blocks = fit_label_map(pair_scores, relevant, confidence, min_block)
    report = {
        "file": source,
        "labels": len(labels),
        "used": len(keep),
        "beyond_depth": len(labels) - len(keep),
        "relevant": int(relevant.sum()),
        "queries": len({labels[k].query for k in keep}),
        "images": len({int(image_ids[k]) for k in keep}),
        "confidence": confidence,
        "blocks": [b.to_dict() for b in blocks],
        "thresholds": _thresholds(blocks, len(keep), confidence),
        "out_of_fold": out_of_fold(
            [labels[k].query for k in keep],
            [int(image_ids[k]) for k in keep],
            pair_scores,
            relevant,
            TARGETS,
            confidence,
            min_block,
        ),
    }
    note = (
        f"fitted on {len(keep)} of your labels ({report['queries']} queries): each value is a one-sided "
        f"{confidence:.0%} Clopper-Pearson lower bound of the fraction relevant among labelled hits of "
        "that score, valid for hits like the labelled ones (label hits the service returned)"
    )
    out = {
        "format_version": CALIBRATION_FORMAT,
        "checkpoint_sha256": manifest.checkpoint_sha256,
        "method": "global",
        "labels": USER_LABELS,
        "labels_note": note,
        "global": relevance_map.to_dict(),
        "per_query": None,
        "evidence": QueryEvidence.fit([labels[k].query for k in keep]).to_dict(),
        "fit": relevance_map.fit,
        "score_for_relevance": {str(t): relevance_map.score_for(t) for t in TARGETS},
        "label_report": report,
    }
    atomic_write_text(index_dir / CALIBRATION_FILE, json.dumps(out, indent=2) + "\n")
    return out


def _thresholds(blocks: list[Block], used: int, confidence: float) -> dict[str, Any]:
    """Per target: the first block whose bound reaches it, what its labels show, and how many labels
    it (and, at its share of all labels, the whole file) would need for a bound within +-0.05."""
    out: dict[str, Any] = {}
    for t in TARGETS:
        reached = [b for b in blocks if b.bound >= t]
        if not reached:
            best = max(blocks, key=lambda b: b.bound)
            out[str(t)] = {"reached": False, "best_bound": round(best.bound, 4)}
            continue
        block = reached[0]
        above = [b for b in blocks if b.low >= block.low]
        n_above = sum(b.n for b in above)
        needed = labels_for_half_width(block.relevant / block.n, HALF_WIDTH, confidence)
        out[str(t)] = {
            "reached": True,
            "score": round(block.low, 6),
            "labels_above": n_above,
            "precision_above": round(sum(b.relevant for b in above) / n_above, 4),
            "block_labels": block.n,
            "block_bound": round(block.bound, 4),
            "labels_for_half_width": needed,
            # the block holds this share of the labels: new labels land in it at the same rate
            "more_labels": max(0, int(np.ceil((needed - block.n) * used / block.n))),
        }
    return out
