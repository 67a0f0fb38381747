"""Evaluate a checkpoint on a dataset split: every metric of :mod:`icr.training.evaluation.metrics`,
as one report.

Steps: embed the split; rank metrics under the protocol and global PR / threshold / score
distribution metrics against the annotations; on the embedded benchmark the same again against the
generator's ground truth (every image a caption is true of is relevant, not only the one it was
written for); a calibration fitted on another split (validation by default) and its ECE on this
one; optionally t2i recall with N distractor images streamed into the gallery; and optionally the
rank metrics against Crisscrossed Captions (CxC) relevance for COCO val/test (section ``cxc``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from icr.core.devices import resolve_device
from icr.core.top_k import padded_queries
from icr.training.checkpoint import checkpoint_sha256, load_checkpoint
from icr.training.data.cxc import PRECOMP_TO_KARPATHY, cxc_relevance, intramodal_pairs, load_cxc, split_ids
from icr.training.data.karpathy import load_karpathy
from icr.training.data.precomp import available_precomp_splits, is_precomp
from icr.training.data.synthetic.features import load_featurizer
from icr.training.data.synthetic.generate import DistractorStream, render_workers, split_scene_table
from icr.training.data.synthetic.ground_truth import relevance_matrix
from icr.training.data.synthetic.parse import parse_caption
from icr.training.data.synthetic.scene import SceneTable
from icr.training.data.training_data import SplitData, open_split, synthetic_source
from icr.training.embedding import (
    embed_captions,
    embed_image_batch,
    embed_images,
    open_embeddings,
    threads_beside_workers,
)
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
from icr.training.evaluation.metrics.calibration import Calibration, fit_calibration, score_histogram
from icr.training.evaluation.metrics.distractors import DistractorRecall
from icr.training.evaluation.metrics.intramodal import intramodal_metrics
from icr.training.evaluation.metrics.protocols import fold_metrics
from icr.training.evaluation.metrics.relevant_pairs import Relevance
from icr.training.evaluation.metrics.report import full_metrics, json_ready
from icr.training.evaluation.ood_queries import read_ood_file
from icr.training.evaluation.plots import (
    plot_pr_curves,
    plot_reliability,
    plot_reliability_by_kind,
    plot_score_distribution,
)
from icr.training.models import DualEncoder

REPORT_FORMAT = "icr-evaluation"
REPORT_VERSION = 1


@dataclass(frozen=True)
class EvalOptions:
    split: str = "test"
    protocol: str = "full"
    distractors: int = 0  # embedded benchmark: images from its distractor stream
    distractor_embeddings: Path | None = None  # any dataset: (N, D) float32 .npy, L2-normalised
    calibration_split: str | None = "auto"  # auto: val / dev if present; None: no calibration
    calibration_method: str = "isotonic"
    thresholds: tuple[float, ...] = ()
    batch_size: int = 256
    captions_per_image: int = 5  # evaluate_checkpoint: as the checkpoint was trained
    device: str = "auto"  # auto (CUDA when visible) | cpu | cuda
    progress: bool = True
    plots_dir: Path | None = None  # PR curve, score distributions, reliability diagram (PNG)
    cxc: Path | None = None  # folder of CxC sits/sts/sis_{val,test}.csv: adds the "cxc" section
    cxc_threshold: float = 3.0  # CxC pairs with agg_score >= this are positives
    cxc_karpathy: Path | None = None  # Karpathy JSON naming precomp images/captions (default: found)
    cxc_intramodal: bool = True  # also t2t / i2i against STS / SIS
    # Threshold honesty (section "relevance"): held-out captions searched to this depth, as the
    # service searches (0: skip the section).
    relevance_depth: int = 1000
    # Out-of-domain queries for the per-query honesty figures, one per line, in place of the built-in
    # nonsense and other-domain groups (which only make sense beside the embedded benchmark).
    ood_queries: Path | None = None
    # Called as (stage, fraction of the work done) when each stage starts; the service's benchmark
    # jobs report it as progress.
    on_stage: Callable[[str, float], None] | None = None

    def stage(self, name: str, fraction: float) -> None:
        if self.on_stage is not None:
            self.on_stage(name, fraction)


@dataclass
class EmbeddedSplit:
    data: SplitData
    img_emb: np.ndarray  # (N_img, D)
    cap_emb: np.ndarray  # (N_cap, D)
    annotations: Relevance
    ground_truth: Relevance | None  # embedded benchmark only: annotations + generator truth

    @cached_property
    def sim(self) -> np.ndarray:
        """(N_img, N_cap) scores, computed once (calibration and metrics both read them)."""
        sim: np.ndarray = self.img_emb @ self.cap_emb.T
        return sim

    def labels(self) -> tuple[str, Relevance]:
        """The best relevance available: ground truth when the dataset has it, else annotations."""
        if self.ground_truth is not None:
            return "ground_truth", self.ground_truth
        return "annotations", self.annotations


def ground_truth_relevance(data: SplitData) -> Relevance | None:
    """(N_img, N_cap) generator truth united with the annotations; None off the embedded benchmark.

    Also for precomp features extracted from it (``icr data features``): their manifest names the
    source dataset and split (precomp ``dev`` is its ``val``).
    """
    source = synthetic_source(data)
    if source is None:
        return None

    directory, split = source
    truth = relevance_matrix(data.captions, split_scene_table(directory, split))  # (N_cap, N_img)
    annotations = Relevance.annotations(data.img_of_cap, data.num_images)
    return Relevance.matrix(np.ascontiguousarray(truth.T)).union(annotations)


def embed_split(model: DualEncoder, data_path: Path, split: str, options: EvalOptions) -> EmbeddedSplit:
    data = open_split(
        data_path, split, captions_per_image=options.captions_per_image, progress=options.progress
    )
    img = embed_images(
        model, data, batch_size=options.batch_size, device=options.device, progress=options.progress
    )
    cap = embed_captions(model, data.captions, device=options.device, progress=options.progress)
    return EmbeddedSplit(
        data, img, cap, Relevance.annotations(data.img_of_cap, data.num_images), ground_truth_relevance(data)
    )


def fit_split_calibration(split: EmbeddedSplit, method: str) -> Calibration:
    """Score -> relevance fitted on every pair of ``split`` (ground-truth labels when available)."""
    labels, relevance = split.labels()
    calibration = fit_calibration(score_histogram(split.sim, relevance), method)
    calibration.fit.update(split=split.data.name, labels=labels, images=split.data.num_images)
    return calibration


def _synthetic_distractors(
    model: DualEncoder,
    directory: Path,
    n: int,
    options: EvalOptions,
    featurise: Callable[[np.ndarray], np.ndarray] | None = None,
) -> Iterator[tuple[np.ndarray, Any]]:
    """Embedded-benchmark distractors: (embeddings (b, D), their scenes as a SceneTable) per batch.

    ``featurise`` ((b, H, W, 3) uint8 -> (b, R, F) features): for a model trained on precomp
    features extracted from the benchmark, the frozen backbone that extracted them.
    """
    stream = DistractorStream.for_dataset(directory, n)
    workers = render_workers()
    bar = tqdm(total=n, desc="distractors", unit="img", disable=not options.progress, leave=False)
    with threads_beside_workers(workers, options.device):
        for _, images, scenes in stream.batches(options.batch_size, workers=workers):
            # (b, S, S, 3) pixels, or (b, R, F) features
            inputs = images if featurise is None else list(featurise(images))
            emb = embed_image_batch(model, inputs, device=options.device)  # (b, D)
            bar.update(len(images))
            yield emb, SceneTable.from_scenes(scenes)
    bar.close()


def _file_distractors(path: Path, dim: int, options: EvalOptions) -> Iterator[tuple[np.ndarray, None]]:
    """(embeddings (b, D), None) batches of an (N, D) .npy, read in 16 x batch-size rows."""
    emb = open_embeddings(path, dim)  # (N, D) memory-mapped
    step = options.batch_size * 16
    for start in tqdm(
        range(0, emb.shape[0], step),
        desc="distractors",
        unit="batch",
        disable=not options.progress,
        leave=False,
    ):
        # a copy: torch cannot wrap a read-only memory map
        yield np.array(emb[start : start + step], dtype=np.float32), None


def calibration_split_for(data_path: Path, requested: str | None) -> str | None:
    """``auto``: the validation split (``val``, precomp ``dev``) if the dataset has one, else None."""
    if requested != "auto":
        return requested

    if is_precomp(data_path):
        return "dev" if "dev" in available_precomp_splits(data_path) else None

    return "val" if "val" in load_karpathy(data_path).splits else None


def evaluate_model(
    model: DualEncoder, data_path: str | Path, options: EvalOptions = EvalOptions()
) -> dict[str, Any]:
    """The full report (JSON-ready) for an already loaded model."""
    data_path = Path(data_path)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    options.stage(f"embedding {options.split}", 0.0)
    cxc = None
    if options.cxc is not None:  # fail on missing or broken CxC files before the minutes of embedding
        cxc = load_cxc(options.cxc, PRECOMP_TO_KARPATHY.get(options.split, options.split))
    test = embed_split(model, data_path, options.split, options)
    timings["embed_s"] = time.perf_counter() - t0
    if options.distractors and options.distractor_embeddings is None and synthetic_source(test.data) is None:
        # fail before the minutes of metrics, not after
        raise ValueError(
            "--distractors N draws images from the embedded benchmark's generator; for Flickr30k/COCO "
            "embed your distractor images first and pass --distractor-embeddings FILE.npy"
        )

    calibration = None
    calibration_split = calibration_split_for(data_path, options.calibration_split)
    if calibration_split:
        t0 = time.perf_counter()
        options.stage(f"calibrating on {calibration_split}", 0.3)
        held_out = embed_split(model, data_path, calibration_split, options)
        calibration = fit_split_calibration(held_out, options.calibration_method)
        timings["calibration_fit_s"] = time.perf_counter() - t0

    options.stage("metrics", 0.5)
    sim = test.sim
    label_kind, _ = test.labels()
    sections = {
        "annotations": full_metrics(
            sim,
            test.annotations,
            test.data.img_of_cap,
            protocol=options.protocol,
            calibration=calibration if label_kind == "annotations" else None,
            thresholds=options.thresholds,
        )
    }
    if test.ground_truth is not None:
        options.stage("metrics against the ground truth", 0.65)
        sections["ground_truth"] = full_metrics(
            sim,
            test.ground_truth,
            test.data.img_of_cap,
            protocol=options.protocol,
            calibration=calibration,
            thresholds=options.thresholds,
        )
    report: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "format_version": REPORT_VERSION,
        "data": {
            "path": str(data_path),
            "split": options.split,
            "kind": test.data.kind,
            "images": test.data.num_images,
            "captions": len(test.data.captions),
            "ground_truth": test.ground_truth is not None,
        },
        **{label: json_ready(section) for label, section in sections.items()},
    }
    if options.plots_dir is not None:
        report["plots"] = [str(p) for p in write_plots(sections, Path(options.plots_dir))]
    # Held-out captions as the service sees them (section "relevance"): test and validation
    # captions each over their split's images, then the same distractors, in one pass.
    sides = {}
    if options.relevance_depth > 0 and calibration_split:
        sides = {
            name: QuerySide.start(
                s.data.captions, s.cap_emb, s.data.img_of_cap, s.img_emb, options.relevance_depth
            )
            for name, s in (("test", test), ("fit", held_out))
        }
        ood = _ood_side(model, test, held_out, options)
        if ood is not None:
            sides["ood"] = ood
    distractor_scenes: list[Any] = []
    if options.distractors or options.distractor_embeddings:
        t0 = time.perf_counter()
        options.stage("distractors", 0.75)
        report["distractors"] = _distractor_section(model, test, options, sides, distractor_scenes)
        timings["distractors_s"] = time.perf_counter() - t0
    if sides:
        t0 = time.perf_counter()
        options.stage("threshold honesty", 0.85)
        report["relevance"], relevance_plots = _relevance_section(
            model, test, held_out, sides, distractor_scenes, calibration, options
        )
        if options.plots_dir is not None:
            report.setdefault("plots", []).extend(str(p) for p in relevance_plots)
        timings["relevance_s"] = time.perf_counter() - t0
    if cxc is not None:
        t0 = time.perf_counter()
        options.stage("CxC metrics", 0.9)
        report["cxc"] = cxc_section(test, cxc, options)
        timings["cxc_s"] = time.perf_counter() - t0
    report["calibration_labels"] = label_kind if calibration else None
    report["timings"] = timings
    return report


FILE_DISTRACTORS_NOTE = (
    "distractors read from a file have no ground truth, so thresholds are judged on the split's own "
    "images only; use --distractors N for generated distractors the generator can judge"
)


def _distractor_section(
    model: DualEncoder, test: EmbeddedSplit, options: EvalOptions, sides: dict[str, Any], scenes: list[Any]
) -> dict[str, Any]:
    """t2i recall with the distractors in the gallery; every batch also goes to the ``sides``'
    top-depth lists, and on the embedded benchmark its scenes are appended to ``scenes``.

    One matrix multiply per batch scores it against the test captions, for the recall and the test
    side alike (the validation captions of the "fit" side take a second)."""
    n_cap = len(test.cap_emb)
    queries = torch.from_numpy(padded_queries(test.cap_emb))  # (Q8, D)
    own_images = test.annotations.image_rows(0, test.data.num_images)  # (N_img, N_cap)
    recall = {"annotations": DistractorRecall(n_cap)}
    recall["annotations"].add(test.sim, own_images, distractor=False)
    parsed = None
    if options.distractor_embeddings is None:
        source = synthetic_source(test.data)
        assert source is not None  # checked in evaluate_model
        # embed_split gives every split of the embedded benchmark (directory above) its ground truth
        assert test.ground_truth is not None
        featurise = None
        if test.data.kind == "precomp":  # features from `icr data features`: its backbone featurises
            featurise = load_featurizer(test.data.source, options.batch_size)
        parsed = [parse_caption(c) for c in test.data.captions]
        # With the annotations every distractor is a negative; with the ground truth one that
        # satisfies the caption is a hit.
        recall["ground_truth"] = DistractorRecall(n_cap)
        recall["ground_truth"].add(
            test.sim, test.ground_truth.image_rows(0, test.data.num_images), distractor=False
        )
        batches: Iterator[tuple[np.ndarray, Any]] = _synthetic_distractors(
            model, source[0], options.distractors, options, featurise
        )
    else:
        batches = _file_distractors(Path(options.distractor_embeddings), test.img_emb.shape[1], options)
        if test.ground_truth is not None:
            # threshold honesty judges hits with the generator's truth, which a file's vectors lack
            sides = {}
    with torch.inference_mode():
        for emb, table in batches:
            block = torch.mm(torch.from_numpy(emb), queries.T)  # (b, Q8)
            recall["annotations"].add(block)
            if parsed is not None:
                recall["ground_truth"].add(block, relevance_matrix(parsed, table).T)  # (b, N_cap)
                scenes.append(table)
            for name, side in sides.items():
                if name == "test":  # the same captions: the same scores
                    side.top.offer(block)
                else:
                    side.top.add(emb)
    if parsed is None:
        return {"source": str(options.distractor_embeddings), **recall["annotations"].metrics()}
    return {
        "source": "synthetic generator",
        "count": options.distractors,
        **{labels: acc.metrics() for labels, acc in recall.items()},
    }


def _ood_side(model: DualEncoder, test: EmbeddedSplit, held_out: EmbeddedSplit, options: EvalOptions) -> Any:
    """Out-of-domain queries (:func:`icr.training.evaluation.calibration_check.ood_groups`) searched over the
    test gallery; None where there are none to ask (no ground truth and no --ood-queries file)."""
    if options.ood_queries is None and test.ground_truth is None:
        return None
    given = read_ood_file(options.ood_queries) if options.ood_queries is not None else None
    groups = ood_groups(held_out.data.captions, given)
    texts = [t for group in groups.values() for t in group]
    emb = embed_captions(model, texts, device=options.device, progress=False)  # (Q, D)
    side = QuerySide.start(texts, emb, np.full(len(texts), -1), test.img_emb, options.relevance_depth)
    side.groups = {name: len(group) for name, group in groups.items()}
    return side


def _relevance_section(
    model: DualEncoder,
    test: EmbeddedSplit,
    held_out: EmbeddedSplit,
    sides: dict[str, Any],
    distractor_scenes: list[Any],
    all_pairs: Calibration | None,
    options: EvalOptions,
) -> tuple[dict[str, Any], list[Path]]:
    """Threshold honesty of the served maps (:mod:`icr.training.evaluation.calibration_check`), plots."""
    synthetic = test.ground_truth is not None and held_out.ground_truth is not None
    hits = {}
    for name, split in (("test", test), ("fit", held_out)):
        side = sides[name]  # the "ood" side has no labels: only its relevance is read
        if synthetic:
            source = synthetic_source(split.data)
            assert source is not None  # ground truth (synthetic) exists only where the scenes do
            table = SceneTable.concat([split_scene_table(*source), *distractor_scenes])
            # the test captions are judged on the distractors (when there are any), the fit on
            # every image but the caption's own
            hits[name] = synthetic_hits(
                side.captions,
                side.top.scores,
                side.top.ids,
                table,
                split.data.num_images,
                own_image=side.own_image,
                judge_distractors=name == "test" and bool(distractor_scenes),
            )
        else:
            hits[name] = annotation_hits(side)
    fit = hits["fit"]
    if not fit.relevant[fit.judged].any():
        # Five annotated captions per image and nothing else (Flickr30k/COCO without CxC): once each
        # caption's own image is left out, no judged hit is relevant, so there is nothing to fit on.
        return {
            "depth": options.relevance_depth,
            "labels": "annotations",
            "skipped": "no held-out caption has a relevant image other than its own among its hits, "
            "so the served maps cannot be fitted on images the captions were not written for; "
            "this needs labels beyond the one annotated image per caption (the embedded benchmark's "
            "ground truth, or a dataset whose captions are annotated on several images)",
        }, []
    served = fit_served_maps(fit, held_out.cap_emb, held_out.data.captions)
    maps = {
        "per_query": served.per_query,
        "isotonic_served": served.global_map,
        "isotonic_all_pairs": all_pairs,
    }
    test_unknown = [model.unknown_words(t) for t in test.data.captions]
    section: dict[str, Any] = {
        "depth": options.relevance_depth,
        "labels": "ground_truth" if synthetic else "annotations",
        "note": ANNOTATION_NOTE
        if not synthetic
        else FILE_DISTRACTORS_NOTE
        if options.distractor_embeddings
        else None,
        "gallery": {
            "images": test.data.num_images,
            "distractors": sides["test"].top.ntotal - test.data.num_images,
            "judged": "generated distractors"
            if synthetic and distractor_scenes
            else "every image but the caption's own",
        },
        "fit": {
            "split": held_out.data.name,
            "queries": len(hits["fit"]),
            "per_query": served.per_query.fit,
            "isotonic_served": served.global_map.fit,
            "evidence": {"queries": len(held_out.data.captions), "alpha": served.evidence.alpha},
        },
        "maps": honesty_report(
            hits["test"], test.cap_emb, test.data.captions, maps, served.evidence, test_unknown
        ),
    }
    if "ood" in sides:
        ood, relevance, start = sides["ood"], {}, 0
        for group, n in ood.groups.items():
            rows = slice(start, start + n)
            texts = ood.captions[rows]
            unknown = [model.unknown_words(t) for t in texts]
            relevance[group] = mapped(
                served.per_query, ood.top.scores[rows], ood.embeddings[rows], texts, served.evidence, unknown
            )
            start += n
        if hits["test"].kinds is not None:
            relevance["held_out_kind"] = held_out_kind_relevance(
                fit,
                held_out.cap_emb,
                held_out.data.captions,
                hits["test"],
                test.cap_emb,
                test.data.captions,
                unknown=test_unknown,
            )
        section["out_of_domain"] = ood_report(relevance)
    plots: list[Path] = []
    if options.plots_dir is not None:
        for name, figures in section["maps"].items():
            plots.append(
                plot_reliability_by_kind(
                    figures,
                    Path(options.plots_dir) / f"reliability-kinds-{name}.png",
                    f"{name}: held-out {test.data.name} captions, depth {options.relevance_depth}",
                )
            )
    return section, plots


def cxc_section(test: EmbeddedSplit, cxc: Any, options: EvalOptions) -> dict[str, Any]:
    """Rank metrics with CxC relevance (original pairs OR SITS >= threshold), plus t2t / i2i."""
    data = test.data
    ids = split_ids(
        data.kind,
        data.source,
        data.name,
        data.captions,
        data.img_of_cap,
        data.num_images,
        options.cxc_karpathy,
    )
    if ids.karpathy_split != cxc.split:
        raise ValueError(f"CxC {cxc.split} tables loaded for Karpathy split {ids.karpathy_split!r}")
    relevance, stats = cxc_relevance(cxc, ids.filenames, ids.sentids, data.img_of_cap, options.cxc_threshold)
    folds = fold_metrics(test.sim, relevance, data.img_of_cap, options.protocol)
    section: dict[str, Any] = {
        "directory": str(cxc.directory),
        "split": cxc.split,
        "karpathy_json": str(ids.karpathy_json),
        "karpathy_split": ids.karpathy_split,
        "threshold": float(options.cxc_threshold),
        "protocol": {"name": folds["protocol"], "folds": folds["folds"]},
        "retrieval": folds["metrics"],
        "retrieval_std": folds["std"],
        "retrieval_per_fold": folds["per_fold"],
        "stats": stats,
    }
    if options.cxc_intramodal:
        # Intramodal queries always run over the whole split (no 1K folds).
        sts, sts_stats = intramodal_pairs(cxc.sts, ids.sentids, options.cxc_threshold, groups=data.img_of_cap)
        sis, sis_stats = intramodal_pairs(cxc.sis, ids.filenames, options.cxc_threshold)
        section["intramodal"] = {
            "t2t": intramodal_metrics(test.cap_emb, sts, "t2t", groups=data.img_of_cap),
            "i2i": intramodal_metrics(test.img_emb, sis, "i2i"),
            "sts": sts_stats,
            "sis": sis_stats,
        }
    return section


def write_plots(sections: dict[str, dict[str, Any]], directory: Path) -> list[Path]:
    """PNG plots of :func:`full_metrics` sections (raw, before :func:`json_ready`)."""
    paths = [
        plot_pr_curves(
            {
                f"{label} (AP {s['global']['pr_auc']:.3f})": s["curve"].points()
                for label, s in sections.items()
            },
            directory / "pr-curve.png",
            "global precision-recall over all pairs",
        )
    ]
    for label, section in sections.items():
        paths.append(
            plot_score_distribution(section["score_distribution"], directory / f"scores-{label}.png", label)
        )
        if "calibration" in section:
            c = section["calibration"]
            paths.append(
                plot_reliability(
                    c["bins"], directory / f"reliability-{label}.png", f"{label}: ECE {c['ece']:.4f}"
                )
            )
    return paths


def evaluate_checkpoint(
    checkpoint: str | Path, data_path: str | Path, options: EvalOptions = EvalOptions()
) -> dict[str, Any]:
    """Load ``checkpoint`` and :func:`evaluate_model` it; the report names the checkpoint."""
    options = replace(options, device=resolve_device(options.device))  # auto -> cuda or cpu
    model, config = load_checkpoint(checkpoint, options.device)
    options = replace(options, captions_per_image=config.captions_per_image)
    report = evaluate_model(model, data_path, options)
    report["checkpoint"] = {
        "path": str(checkpoint),
        "sha256": checkpoint_sha256(checkpoint),
        "objective": config.objective,
        "decoding": config.decoding,
        "step": config.step,
    }
    return report
