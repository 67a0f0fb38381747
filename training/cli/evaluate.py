"""`icr evaluate`: every retrieval, calibration and distractor metric of a checkpoint on a split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from icr.core.cli_support import fail_cleanly
from icr.core.devices import Device


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_retrieval_table(section: dict[str, Any], title: str) -> str:
    """R@K / medr / mAP / R-precision per direction, +- std over folds when there are several."""
    m, std, folds = section["retrieval"], section["retrieval_std"], section["protocol"]["folds"]
    cols = [
        ("R@1", "r1", 1),
        ("R@5", "r5", 1),
        ("R@10", "r10", 1),
        ("medr", "medr", 1),
        ("mAP@5", "map5", 3),
        ("mAP@5 ecir", "map5_ecir", 3),
        ("R-prec", "rprec", 3),
        ("mAP", "map", 3),
    ]
    pm = folds > 1
    lines = [f"{title} (protocol {section['protocol']['name']}, {folds} fold{'s' * (folds > 1)})"]
    lines.append("       " + "".join(f"{c:>{16 if pm else 11}}" for c, _, _ in cols))
    for d in ("i2t", "t2i"):
        cells = []
        for _, key, digits in cols:
            v = m[f"{d}_{key}"]
            cell = f"{v:.{digits}f}" + (f"±{std[f'{d}_{key}']:.{digits}f}" if pm else "")
            cells.append(f"{cell:>{16 if pm else 11}}")
        lines.append(f"  {d}  " + "".join(cells))
    lines.append(f"  rsum {m['rsum']:.1f}" + (f" ± {std['rsum']:.1f}" if pm else ""))
    return "\n".join(lines)


def format_global_table(section: dict[str, Any]) -> str:
    g = section["global"]
    lines = [
        f"  PR-AUC {g['pr_auc']:.4f} (average precision; trapezoid {g['pr_auc_trapezoid']:.4f}; "
        f"random {g['pr_auc_random']:.5f}) over {int(g['pairs']):,} pairs, "
        f"{int(g['relevant_pairs']):,} relevant",
        f"  {'threshold':>10} {'precision':>10} {'recall':>8} {'F1':>7} {'empty i2t':>10} {'empty t2i':>10}",
    ]
    for row in section["thresholds"]:
        lines.append(
            f"  {row['threshold']:>10.4f} {_fmt(row['precision'], 3):>10} {row['recall']:>8.3f} "
            f"{row['f1']:>7.3f} "
            f"{row['empty_i2t']:>10.3f} {row['empty_t2i']:>10.3f}"
        )
    if "calibration" in section:
        c = section["calibration"]
        lines.append(f"  calibration ({c['method']}, fitted on {c['fit'].get('split')}): ECE {c['ece']:.5f}")
    return "\n".join(lines)


def format_cxc_table(section: dict[str, Any]) -> str:
    """The CxC rows of the LTD paper's Table 1: i2t R@1 R@5 R@10 R-P | t2i R@1 R@5 R@10 R-P."""
    m, s = section["retrieval"], section["stats"]
    folds = section["protocol"]["folds"]
    lines = [
        f"CxC {section['split']} ({s['rule']}; protocol {section['protocol']['name']}, "
        f"{folds} fold{'s' * (folds > 1)})",
        f"  {'i2t R@1':>8} {'R@5':>6} {'R@10':>6} {'R-P':>6} | "
        f"{'t2i R@1':>8} {'R@5':>6} {'R@10':>6} {'R-P':>6} | {'rsum':>6}",
        "  "
        + " ".join(f"{m[f'i2t_{k}']:>{w}.1f}" for k, w in (("r1", 8), ("r5", 6), ("r10", 6)))
        + f" {m['i2t_rprec']:>6.3f} | "
        + " ".join(f"{m[f't2i_{k}']:>{w}.1f}" for k, w in (("r1", 8), ("r5", 6), ("r10", 6)))
        + f" {m['t2i_rprec']:>6.3f} | {m['rsum']:>6.1f}",
        f"  SITS rows {s['sits_rows']:,}: {s['sits_rows_in_split']:,} in the split, "
        f"{s['sits_rows_skipped']:,} skipped (image not in split {s['sits_skipped_image_not_in_split']:,}, "
        f"caption {s['sits_skipped_caption_not_in_split']:,}, both {s['sits_skipped_both_not_in_split']:,}); "
        f"{s['sits_rows_at_or_above_threshold']:,} at or above the threshold",
        f"  positives: {s['annotated_pairs']:,} annotated + {s['positives_added']:,} added = "
        f"{s['positive_pairs']:,}; per i2t query {s['i2t_positives_per_query']['min']}-"
        f"{s['i2t_positives_per_query']['max']} (mean {s['i2t_positives_per_query']['mean']:.2f}), "
        f"per t2i query {s['t2i_positives_per_query']['min']}-{s['t2i_positives_per_query']['max']} "
        f"(mean {s['t2i_positives_per_query']['mean']:.2f})",
    ]
    for d, table in (("t2t", "sts"), ("i2i", "sis")):
        intra = section.get("intramodal", {})
        if d in intra:
            v = intra[d]
            with_pos = int(v[f"{d}_queries"] - v[f"{d}_queries_without_relevant"])
            if with_pos:
                lines.append(
                    f"  {d} ({table.upper()} >= {section['threshold']:g}, {with_pos:,} queries with "
                    f"positives): R@1 {v[f'{d}_r1']:.1f} R@5 {v[f'{d}_r5']:.1f} R@10 {v[f'{d}_r10']:.1f} "
                    f"R-P {v[f'{d}_rprec']:.3f}"
                )
            else:
                lines.append(f"  {d}: no query has a positive")
    return "\n".join(lines)


def format_relevance_table(section: dict[str, Any]) -> str:
    """Threshold honesty per map and query kind: what min_relevance 0.5 / 0.8 deliver."""
    if "skipped" in section:
        return f"threshold honesty: skipped ({section['skipped']})"
    g = section["gallery"]
    lines = [
        f"threshold honesty: held-out captions, top {section['depth']} of {g['images']:,} images + "
        f"{g['distractors']:,} distractors, judged on {g['judged']} ({section['labels']})"
    ]
    if section.get("note"):
        lines.append(f"  note: {section['note']}")
    for name, figures in section["maps"].items():
        targets = list(figures["pooled"]["thresholds"])[:2]
        head = "".join(f"{'prec@' + t:>9} {'pass':>8} {'recall':>7} {'<p-0.1':>7}" for t in targets)
        lines.append(f"  map {name}")
        lines.append(f"    {'queries':<16} {'n':>5} {'P@10':>6} {'R-prec':>7} {'ECE':>7}{head}")
        for kind, group in [("pooled", figures["pooled"]), *sorted(figures["by_kind"].items())]:
            cells = "".join(
                f"{_fmt(t['precision'], 3):>9} {t['passing']:>8,} {_fmt(t['recall'], 3):>7} "
                f"{_fmt(t['share_below'], 2):>7}"
                for t in (group["thresholds"][x] for x in targets)
            )
            lines.append(
                f"    {kind:<16} {group['queries']:>5} {_fmt(group['p_at_10'], 3):>6} "
                f"{_fmt(group['r_precision'], 3):>7} {group['ece']:>7.4f}{cells}"
            )
    from icr.training.evaluation.metrics.query_honesty import format_out_of_domain, format_query_honesty

    per_query = section["maps"].get("per_query", {}).get("queries")
    if per_query:
        lines.append(format_query_honesty(per_query))
    if section.get("out_of_domain"):
        lines.append(format_out_of_domain(section["out_of_domain"]))
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    parts = []
    for label, title in (("annotations", "annotated pairs"), ("ground_truth", "ground-truth relevance")):
        if label in report:
            parts.append(format_retrieval_table(report[label], title))
            parts.append(format_global_table(report[label]))
    if "distractors" in report:
        d = report["distractors"]
        for label in ("annotations", "ground_truth"):
            section = d.get(label, d if label == "annotations" else None)
            if section:
                recalls = "  ".join(
                    f"{k[4:].upper()} {v:.2f}" for k, v in section.items() if k.startswith("t2i_r")
                )
                parts.append(
                    f"t2i with distractors ({label}, gallery {int(section['gallery_size']):,}): {recalls}"
                )
    if "relevance" in report:
        parts.append(format_relevance_table(report["relevance"]))
    if "cxc" in report:
        parts.append(format_cxc_table(report["cxc"]))
    return "\n".join(parts)


@fail_cleanly
def evaluate_command(
    checkpoint: Annotated[
        Path, typer.Option("--checkpoint", "-m", help="Checkpoint folder (e.g. runs/x/best).")
    ],
    data: Annotated[
        Path,
        typer.Option(
            "--data", "-d", help="Dataset: Karpathy JSON/folder, precomp folder, or icr data synth output."
        ),
    ],
    split: Annotated[str, typer.Option(help="Split to evaluate (precomp COCO 5K: testall).")] = "test",
    protocol: Annotated[
        Literal["full", "1k", "5k"],
        typer.Option(help="full (all images), 1k (5 folds of 1,000 images, averaged) or 5k."),
    ] = "full",
    distractors: Annotated[
        int, typer.Option(help="Embedded benchmark: add N generated distractor images to the t2i gallery.")
    ] = 0,
    distractor_embeddings: Annotated[
        Path | None, typer.Option(help="(N, D) float32 .npy of distractor image embeddings.")
    ] = None,
    calibration_split: Annotated[
        str,
        typer.Option(
            help="Split to fit score->relevance on: auto (val, or precomp dev), a split name, or none."
        ),
    ] = "auto",
    calibration_method: Annotated[str, typer.Option(help="isotonic or platt.")] = "isotonic",
    threshold: Annotated[
        list[float] | None, typer.Option(help="Extra global score threshold to report (repeatable).")
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the full report here (atomic).")
    ] = None,
    plots: Annotated[Path | None, typer.Option(help="Folder for PNG plots (default: beside --json).")] = None,
    cxc: Annotated[
        Path | None,
        typer.Option(
            help="Folder with the Crisscrossed Captions sits/sts/sis_{val,test}.csv: adds CxC metrics "
            "(COCO val/test only)."
        ),
    ] = None,
    cxc_threshold: Annotated[
        float, typer.Option(help="CxC positives: original pairs OR agg_score >= this (0-5 scale).")
    ] = 3.0,
    cxc_karpathy: Annotated[
        Path | None,
        typer.Option(
            help="dataset_coco.json naming a precomp split's images/captions (default: found beside it)."
        ),
    ] = None,
    cxc_intramodal: Annotated[bool, typer.Option(help="With --cxc: also t2t (STS) and i2i (SIS).")] = True,
    relevance_depth: Annotated[
        int,
        typer.Option(
            help="Threshold honesty: search held-out captions this deep, as the service does (0: skip)."
        ),
    ] = 1000,
    ood_queries: Annotated[
        Path | None,
        typer.Option(
            help="Out-of-domain queries, one per line, for the per-query honesty figures (default on the "
            "embedded benchmark: built-in nonsense and other-domain captions)."
        ),
    ] = None,
    device: Annotated[Device, typer.Option(help="auto (CUDA if present), cpu or cuda.")] = "auto",
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> None:
    """Evaluate a checkpoint: R@K, medr, mAP@k, R-precision, PR-AUC, thresholds, ECE, distractors.

    Examples:

      icr evaluate --checkpoint icr-demo/model/best --data icr-demo/data --json eval.json

      icr evaluate -m runs/coco/best -d ~/data/coco_precomp --split testall --protocol 1k

      icr evaluate -m runs/x/best -d icr-demo/data --distractors 100000 --threshold 0.5

      # does min_relevance keep its promise per kind of query, and per query? Is anything promised
      # to nonsense or other domains? (section "relevance", plots per kind)
      icr evaluate -m icr-demo/model/best -d icr-demo/data --distractors 100000 --json eval.json

      icr evaluate -m runs/coco/best -d ~/data/coco_precomp --split testall --cxc ~/data/cxc/data
    """
    from icr.core.atomic import atomic_write_text
    from icr.training.evaluation.full_report import EvalOptions, evaluate_checkpoint
    from icr.training.evaluation.metrics.calibration import CALIBRATION_METHODS

    if calibration_method not in CALIBRATION_METHODS:
        raise ValueError(f"--calibration-method must be one of {', '.join(CALIBRATION_METHODS)}")
    if distractors < 0:
        raise ValueError(f"--distractors must be >= 0, got {distractors}")
    if not 0.0 <= cxc_threshold <= 5.0:
        raise ValueError(f"--cxc-threshold must lie in [0, 5] (CxC agg_score scale), got {cxc_threshold}")
    if plots is None and json_out is not None:
        plots = json_out.with_name(json_out.stem + "-plots")
    options = EvalOptions(
        split=split,
        protocol=protocol,
        distractors=distractors,
        distractor_embeddings=distractor_embeddings,
        calibration_split=None if calibration_split.lower() == "none" else calibration_split,
        calibration_method=calibration_method,
        thresholds=tuple(threshold or ()),
        device=device,
        progress=not quiet,
        plots_dir=plots,
        cxc=cxc,
        cxc_threshold=cxc_threshold,
        cxc_karpathy=cxc_karpathy,
        cxc_intramodal=cxc_intramodal,
        relevance_depth=relevance_depth,
        ood_queries=ood_queries,
    )
    if relevance_depth < 0:
        raise ValueError(f"--relevance-depth must be >= 0, got {relevance_depth}")
    report = evaluate_checkpoint(checkpoint, data, options)
    typer.echo(format_report(report))
    if json_out is not None:
        atomic_write_text(json_out, json.dumps(report, indent=2) + "\n")
        typer.echo(f"wrote {json_out}")
    if report.get("plots"):
        typer.echo(f"plots: {', '.join(report['plots'])}")
