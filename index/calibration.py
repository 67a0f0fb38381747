"""``icr index calibrate``: fit score -> probability of relevance for an index, store ``calibration.json``.

``min_relevance = p`` promises "each hit is relevant with probability at least p, whatever the
query". The maps are therefore fitted where the promise is kept or broken: on held-out captions
(validation by default) searched *in this index*, to the service's depth, against images they were
not written for, and judged with the best labels there are.

* **Embedded benchmark** (the index's gallery is a synthetic split, its distractors generated):
  validation captions search the index (the test images and distractors: nothing was written for
  them); every hit is labelled by the generator's ground truth. The test split's captions are then
  searched the same way and judged on the distractor hits: the ``evaluation`` block reports the
  precision each target delivers, pooled and per query kind (see
  :mod:`icr.training.evaluation.metrics.threshold_honesty`).
* **Flickr30k / COCO / other galleries**: nothing labels the index's images for held-out captions,
  so the maps are fitted on the validation split itself (its captions against its images, the
  annotations as labels). That *underestimates* relevance (an unannotated relevant image counts as a
  negative); ``labels_note`` says so and the service repeats it.

On the embedded benchmark the fit also holds generated queries (:mod:`icr.training.data.synthetic.queries`:
scenes the index does not hold, bare counts, queries no scene satisfies), and the evaluation adds
per-query honesty (top 20 promised vs delivered) and out-of-domain queries
(:func:`icr.training.evaluation.calibration_check.ood_groups`, and one kind held out of a refit).

Two maps are written: ``per_query`` (:mod:`icr.training.evaluation.metrics.query_calibration`:
the score and what
the query's own results and embedding show; what the service applies) and ``global`` (one isotonic
score -> relevance map, the baseline, kept for clients that want a raw-score equivalent).
``calibration.json`` also keeps the checkpoint sha256 it belongs to, the global map's score
thresholds for precision 0.5 / 0.8 / 0.9, and the fitting queries' evidence
(:mod:`icr.training.evaluation.metrics.query_evidence`): outside it the service gives no relevance.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from icr.core.atomic import atomic_write_text
from icr.core.contracts import validated
from icr.core.devices import resolve_device
from icr.index.index_folder import load_index_dir
from icr.index.manifest import Manifest, check_compatible
from icr.index.vector_index import nprobe_of, search, set_nprobe
from icr.training.checkpoint import load_checkpoint
from icr.training.data.synthetic.generate import SCENES_NAME, DistractorStream, load_scenes, split_scene_table
from icr.training.data.synthetic.queries import EVAL_OFFSET, generated_queries
from icr.training.data.synthetic.scene import SceneTable
from icr.training.data.training_data import open_split
from icr.training.embedding import embed_captions
from icr.training.evaluation.calibration_check import (
    ANNOTATION_NOTE,
    QuerySide,
    annotation_hits,
    fit_served_maps,
    held_out_kind_relevance,
    honesty_report,
    mapped,
    ood_groups,
    ood_report,
    synthetic_hits,
)
from icr.training.evaluation.full_report import (
    EvalOptions,
    calibration_split_for,
    embed_split,
    fit_split_calibration,
)
from icr.training.evaluation.metrics.calibration import CALIBRATION_METHODS, Calibration, calibration_error
from icr.training.evaluation.metrics.query_calibration import QueryCalibration
from icr.training.evaluation.metrics.query_evidence import QueryEvidence
from icr.training.evaluation.metrics.query_honesty import query_honesty
from icr.training.evaluation.metrics.threshold_honesty import HitLists

CALIBRATION_FILE = "calibration.json"
CALIBRATION_FORMAT = 3  # 3: with the fitting queries' evidence (2: without it, served without the check)
TARGETS: tuple[float, ...] = (0.5, 0.8, 0.9)
DEFAULT_DEPTH = 1000  # the service's ICR_SEARCH_DEPTH
# What a query kind must reach on held-out captions for the service to call it well handled.
KIND_P10_WARNING = 0.6
# Generated queries (scenes in no split, bare counts, impossible ones) added to the embedded
# benchmark's fit, and as many others judged beside the evaluation.
GENERATED_QUERIES = 2000


def calibrate_index(
    index_dir: str | os.PathLike[str],
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    data: str | os.PathLike[str] | None = None,
    split: str = "auto",
    eval_split: str | None = "test",
    method: str = "isotonic",
    depth: int = DEFAULT_DEPTH,
    device: str = "auto",
    progress: bool = True,
    generated: int = GENERATED_QUERIES,
) -> dict[str, Any]:
    """Fit, evaluate and write ``calibration.json`` into ``index_dir``; returns its content.

    ``checkpoint`` / ``data`` default to those recorded in the index manifest; the checkpoint must
    be the one the index was built from. ``split``: ``auto`` = val (precomp: dev). ``method``: the
    global map's form (isotonic or platt); ``depth``: how deep held-out captions search, as the
    service does (``ICR_SEARCH_DEPTH``); ``generated``: on the embedded benchmark, generated queries
    added to the fit (and as many others evaluated), :mod:`icr.training.data.synthetic.queries`.
    """
    if method not in CALIBRATION_METHODS:
        raise ValueError(f"--method must be one of {', '.join(CALIBRATION_METHODS)}, got {method!r}")
    if depth < 1:
        raise ValueError(f"--depth must be >= 1, got {depth}")
    if generated < 0:
        raise ValueError(f"--generated-queries must be >= 0, got {generated}")
    index_dir = Path(index_dir)
    manifest = Manifest.read(index_dir)
    checkpoint = Path(checkpoint or manifest.checkpoint_path)
    data = Path(data or manifest.data["path"])
    device = resolve_device(device)
    model, config = load_checkpoint(checkpoint, device)
    check_compatible(manifest, config, index_dir=index_dir, checkpoint_path=checkpoint)
    fit_split = calibration_split_for(data, split)
    if fit_split is None:
        raise ValueError(f"{data}: no validation split to calibrate on; pass --split NAME")
    per_image = config.captions_per_image
    if _searchable_with_truth(manifest, data):
        out = _calibrate_in_index(
            index_dir,
            manifest,
            model,
            data,
            fit_split,
            eval_split,
            method,
            depth,
            device,
            progress,
            per_image,
            generated,
        )
    else:
        out = _calibrate_on_split(
            model, data, fit_split, eval_split, method, depth, device, progress, per_image
        )
    out = {"format_version": CALIBRATION_FORMAT, "checkpoint_sha256": manifest.checkpoint_sha256, **out}
    atomic_write_text(index_dir / CALIBRATION_FILE, json.dumps(out, indent=2) + "\n")
    return out


def _searchable_with_truth(manifest: Manifest, data: Path) -> bool:
    """An image index over an embedded-benchmark split whose distractors (if any) are generated."""
    return (
        manifest.modality == "image"
        and (data / SCENES_NAME).is_file()
        and manifest.data.get("distractor_source") in (None, "generator")
    )


def _maps_block(maps: Any, fit: dict[str, Any]) -> dict[str, Any]:
    return {
        "method": "per_query",
        "per_query": maps.per_query.to_dict(),
        "global": maps.global_map.to_dict(),
        "evidence": maps.evidence.to_dict(),
        "fit": fit,
        "score_for_relevance": {str(t): maps.global_map.score_for(t) for t in TARGETS},
    }


def searchable_index(index_dir: Path, manifest: Manifest) -> Any:
    """The index folder's FAISS index, set to the nprobe the service searches it with."""
    index, _, metadata = load_index_dir(index_dir)
    metadata.close()
    nprobe = manifest.recall_check.get("nprobe")
    if nprobe and nprobe_of(index) is not None:
        set_nprobe(index, int(nprobe))
    return index


def search_hits(index: Any, queries: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) (Q, depth) from the FAISS index; short rows padded with their last score, id -1."""
    scores, ids = search(index, queries, depth)
    width = max(1, max(len(r) for r in scores))
    out_s = np.empty((len(queries), width), np.float32)
    out_i = np.full((len(queries), width), -1, np.int64)
    for q, (s, i) in enumerate(zip(scores, ids, strict=True)):
        if len(s) == 0:
            out_s[q] = -1.0
            continue
        out_s[q, : len(s)], out_s[q, len(s) :] = s, s[-1]
        out_i[q, : len(i)] = i
    return out_s, out_i


def _calibrate_in_index(
    index_dir: Path,
    manifest: Manifest,
    model: Any,
    data: Path,
    fit_split: str,
    eval_split: str | None,
    method: str,
    depth: int,
    device: str,
    progress: bool,
    per_image: int,  # captions per image, as the checkpoint was trained
    n_generated: int,
) -> dict[str, Any]:
    index = searchable_index(index_dir, manifest)
    gallery_split = manifest.data["split"]
    tables = [split_scene_table(data, gallery_split)]
    if manifest.distractor_count:
        tables.append(DistractorStream.for_dataset(data, manifest.distractor_count).scene_table())
    table = SceneTable.concat(tables)
    g = manifest.gallery_count

    def hits_of(split: str, judge_distractors: bool) -> tuple[HitLists, np.ndarray, list[str]]:
        split_data = open_split(data, split, captions_per_image=per_image)
        captions = split_data.captions
        emb = embed_captions(model, captions, device=device, progress=progress)  # (Q, D)
        scores, ids = search_hits(index, emb, depth)
        # a caption's own image (when it is in this gallery) is not a hit on an unseen image
        own = split_data.img_of_cap if split == gallery_split else None
        hits = synthetic_hits(
            captions, scores, ids, table, g, judge_distractors=judge_distractors, own_image=own
        )
        return hits, emb, captions

    def generated(start: int, n: int) -> tuple[HitLists, np.ndarray, list[str], list[str]]:
        """Generated queries (:mod:`icr.training.data.synthetic.queries`): every hit judged."""
        queries = generated_queries(load_scenes(data).seed, start, n)
        texts = [q.text for q in queries]
        emb = embed_captions(model, texts, device=device, progress=False)  # (n, D)
        scores, ids = search_hits(index, emb, depth)
        hits = synthetic_hits(texts, scores, ids, table, g, judge_distractors=False)
        return hits, emb, texts, [q.style for q in queries]

    fit_hits, fit_emb, fit_texts = hits_of(fit_split, judge_distractors=False)
    # with queries users ask that no caption was written for: some with no answer at all
    extra_texts: list[str] = []
    if n_generated:
        extra_hits, extra_emb, extra_texts, _ = generated(0, n_generated)
        fit_hits = HitLists.concat([fit_hits, extra_hits])
        fit_emb, fit_texts = np.concatenate([fit_emb, extra_emb]), [*fit_texts, *extra_texts]
    maps = fit_served_maps(fit_hits, fit_emb, fit_texts, method)
    fit = {
        "split": fit_split,
        "queries": len(fit_hits),
        "generated_queries": len(extra_texts),
        "no_answer": int((fit_hits.n_relevant == 0).sum()),
        "depth": depth,
        "gallery": "this index",
        "labels": "ground_truth",
    }
    out: dict[str, Any] = {
        "labels": "ground_truth",
        "labels_note": None,
        **_maps_block(maps, fit),
    }
    if eval_split:
        test_hits, test_emb, test_texts = hits_of(eval_split, judge_distractors=manifest.distractor_count > 0)
        unknown = [model.unknown_words(t) for t in test_texts]
        served = {"per_query": maps.per_query, "global": maps.global_map}
        report = honesty_report(test_hits, test_emb, test_texts, served, maps.evidence, unknown)
        # queries no calibration query resembles, searched and served the same way
        ood = {}
        for group, texts in ood_groups(fit_texts).items():
            emb = embed_captions(model, texts, device=device, progress=False)  # (Q, D)
            scores, _ = search_hits(index, emb, depth)
            words = [model.unknown_words(t) for t in texts]
            ood[group] = mapped(maps.per_query, scores, emb, texts, maps.evidence, words)
        ood["held_out_kind"] = held_out_kind_relevance(
            fit_hits, fit_emb, fit_texts, test_hits, test_emb, test_texts, unknown=unknown
        )
        out["evaluation"] = {
            "split": eval_split,
            "queries": len(test_hits),
            "depth": depth,
            "judged": "generated distractors"
            if manifest.distractor_count
            else "every image but the caption's own",
            "maps": {name: _compact(r) for name, r in report.items()},
            "out_of_domain": ood_report(ood),
        }
        if n_generated:
            gen_hits, gen_emb, gen_texts, styles = generated(EVAL_OFFSET, n_generated)
            words = [model.unknown_words(t) for t in gen_texts]
            gen = mapped(maps.per_query, gen_hits.scores, gen_emb, gen_texts, maps.evidence, words)
            out["evaluation"]["generated"] = {
                "queries": len(gen_texts),
                "no_answer": int((gen_hits.n_relevant == 0).sum()),
                "honesty": query_honesty(gen_hits.relevant, gen, styles),
            }
        out["kinds"] = _kind_table(report["per_query"])
    return out


def _calibrate_on_split(
    model: Any,
    data: Path,
    fit_split: str,
    eval_split: str | None,
    method: str,
    depth: int,
    device: str,
    progress: bool,
    per_image: int,  # captions per image, as the checkpoint was trained
) -> dict[str, Any]:
    options = EvalOptions(device=device, progress=progress, captions_per_image=per_image)
    held_out = embed_split(model, data, fit_split, options)
    labels, relevance = held_out.labels()
    side = QuerySide.start(
        held_out.data.captions, held_out.cap_emb, held_out.data.img_of_cap, held_out.img_emb, depth
    )
    hits = annotation_hits(side)
    # Only the annotations label these pairs, and they name one image per caption: the own image
    # stays in the fit (without it nothing would be relevant), and the note says what that means.
    hits = type(hits)(
        hits.scores, hits.relevant, np.ones_like(hits.judged), hits.n_relevant, hits.n_relevant, None
    )
    maps = fit_served_maps(hits, held_out.cap_emb, held_out.data.captions)
    maps = replace(maps, global_map=fit_split_calibration(held_out, method))
    fit = {
        "split": fit_split,
        "queries": len(hits),
        "depth": depth,
        "gallery": f"the {fit_split} split's images",
        "labels": labels,
    }
    out: dict[str, Any] = {
        "labels": labels,
        "labels_note": ANNOTATION_NOTE if labels == "annotations" else None,
        **_maps_block(maps, fit),
    }
    ece = {fit_split: calibration_error(held_out.sim, relevance, maps.global_map)["ece"]}
    if eval_split and eval_split != fit_split:
        test = embed_split(model, data, eval_split, options)
        ece[eval_split] = calibration_error(test.sim, test.labels()[1], maps.global_map)["ece"]
    out["global_ece_all_pairs"] = ece
    return out


def _compact(report: dict[str, Any]) -> dict[str, Any]:
    """A threshold- and query-honesty report without the reliability bins (they go to plots, not the
    service)."""

    def strip(group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k != "reliability"}

    return {
        "pooled": strip(report["pooled"]),
        "by_kind": {k: strip(v) for k, v in report["by_kind"].items()},
        "queries": report["queries"],
    }


def _kind_table(report: dict[str, Any]) -> dict[str, Any]:
    """Per query kind, what the service tells a user about queries of that kind."""
    out = {}
    for kind, group in report["by_kind"].items():
        t = group["thresholds"]
        out[kind] = {
            "queries": group["queries"],
            "p_at_10": group["p_at_10"],
            "precision_at_0.5": t["0.5"]["precision"],
            "recall_at_0.5": t["0.5"]["recall"],
            "handled_well": group["p_at_10"] is not None and group["p_at_10"] >= KIND_P10_WARNING,
        }
    return out


class CalibrationFile(BaseModel):
    """What a format-2 ``calibration.json`` must hold to be served (checked on read). The maps are
    checked by their own readers (``Calibration.from_dict``, ``QueryCalibration.from_dict``)."""

    model_config = ConfigDict(strict=True, extra="allow")
    format_version: Literal[2, 3]
    checkpoint_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    method: Literal["per_query", "global"]  # global: one map for every query (a user's labels)
    labels: str
    labels_note: str | None = None
    global_: dict[str, Any] = Field(alias="global")
    per_query: dict[str, Any] | None
    evidence: dict[str, Any] | None = None  # format 3 on
    kinds: dict[str, Any] = Field(default_factory=dict)


class ServedCalibration:
    """A ``calibration.json`` as the service applies it (format 3 or 2, or format 1's single map).

    :meth:`relevance` maps one query's retrieved scores (best first) to probabilities: the
    per-query map when the file has one, else the global map. ``evidence`` says whether the fit has
    evidence for a text query (:meth:`QueryEvidence.assess`; None in format 2 and 1 files).
    ``kinds`` is the per-kind table of the held-out evaluation (embedded benchmark),
    ``labels_note`` what the labels mean.
    """

    def __init__(self, info: dict[str, Any]) -> None:
        if not isinstance(info, dict):
            raise ValueError(f"a calibration is a JSON object, got {type(info).__name__}")
        self.info = info
        self.evidence: QueryEvidence | None = None
        if info.get("format_version") in (2, CALIBRATION_FORMAT):
            self.global_map = Calibration.from_dict(info["global"])
            self.per_query = QueryCalibration.from_dict(info["per_query"]) if info.get("per_query") else None
            if info["format_version"] == CALIBRATION_FORMAT:
                self.evidence = QueryEvidence.from_dict(info.get("evidence"))
        else:  # format 1: the global isotonic / Platt map at the top level
            self.global_map = Calibration.from_dict(info)
            self.per_query = None
        self.kinds: dict[str, Any] = info.get("kinds") or {}
        self.labels_note: str | None = info.get("labels_note")

    @property
    def method(self) -> str:
        return "per_query" if self.per_query is not None else "global"

    def relevance(self, scores: np.ndarray, query: np.ndarray | None, text: str | None = None) -> np.ndarray:
        """(n,) probabilities for one query's (n,) scores, best first; ``query`` its (1, D) embedding,
        ``text`` its words (a text query; without them, e.g. for an image query, the global map)."""
        scores = np.asarray(scores, dtype=np.float64)
        if self.per_query is None or len(scores) == 0 or text is None:
            return self.global_map(scores)
        mapped: np.ndarray = self.per_query(scores[None, :], query, [text])[0]  # (n,)
        return mapped

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ServedCalibration:
        """ValueError naming the file when it does not parse."""
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ValueError(f"{path}: unreadable calibration ({err})") from None
        return cls.from_text(text, str(path))

    @classmethod
    def from_text(cls, text: str, path: str) -> ServedCalibration:
        """A calibration file's content (``path``: its name in errors), as :meth:`read` parses it."""
        try:
            info = json.loads(text)
        except ValueError as err:
            raise ValueError(f"{path}: unreadable calibration ({err})") from None
        if isinstance(info, dict) and info.get("format_version") in (2, CALIBRATION_FORMAT):
            validated(CalibrationFile, info, str(path), "calibration file", "")
        try:
            return cls(info)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: unreadable calibration ({err})") from None
