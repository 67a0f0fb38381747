"""Regime differences: where our runs differ from each paper's regime, read from the runs themselves.

Each row names a paper, a setting, the paper's value (from ``shared/reference/seed-code-notes.md`` and
the papers), ours as the comparison reports record it (regime, the objectives' resolved parameters,
per-seed convergence) or as the variants' configs resolve, and what the difference may change. The
rows are rebuilt with ``docs/paper-findings.md``, so a changed regime changes its section.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icr.training.analysis.compare import Regime, Variant, run_config
from icr.training.config import TrainConfig


@dataclass(frozen=True)
class Difference:
    paper: str  # a key of paper_numbers.PAPERS, or "all"
    setting: str
    theirs: str
    ours: str
    may_change: str


def _regime(report: Mapping[str, Any]) -> Regime:
    fields = dict(report["regime"])
    fields["overrides"] = tuple(fields.get("overrides") or ())
    return Regime(**fields)


def _config(report: Mapping[str, Any], variant: str) -> TrainConfig:
    return run_config(_regime(report), Variant.parse(variant), 0, Path("unused"))


def _per_seed(entry: Mapping[str, Any], key: str) -> list[Any]:
    return list(((entry.get("per_seed") or {}).get("convergence") or {}).get(key) or [])


def early_stops(report: Mapping[str, Any]) -> tuple[int, int, dict[str, str]]:
    """(runs stopped by patience before their learning-rate step + 5 epochs, runs, per variant
    "k/n stopped at epochs ..." for the variants with such a run)."""
    stopped = total = 0
    per_variant: dict[str, str] = {}
    for name, entry in report["variants"].items():
        config = _config(report, name)
        due = min(config.optim.lr_update + 5, config.train.epochs)
        epochs = _per_seed(entry, "epochs_completed")
        by_patience = _per_seed(entry, "stopped_by_patience")
        early = [int(e) for e, p in zip(epochs, by_patience, strict=False) if p and e is not None and e < due]
        stopped, total = stopped + len(early), total + len(epochs)
        if early:
            per_variant[name] = f"{len(early)}/{len(epochs)} at epochs {', '.join(map(str, sorted(early)))}"
    return stopped, total, per_variant


def _steps(entry: Mapping[str, Any]) -> float | None:
    """Mean optimizer steps a run of this variant took (best step / best epoch x epochs run)."""
    rows = zip(
        _per_seed(entry, "best_step"),
        _per_seed(entry, "best_epoch"),
        _per_seed(entry, "epochs_completed"),
        strict=False,
    )
    steps = [s / b * e for s, b, e in rows if s and b and e]
    return statistics.fmean(steps) if steps else None


def differences(reports: Mapping[str, Mapping[str, Any]]) -> list[Difference]:
    """The rows for the reports present ({"vsepp": report, "gpo": report}); a row whose evidence is
    absent (its encoder or variants not run) is left out."""
    rows: list[Difference] = []
    # a report whose regime names no data and base config (one written by hand) has no configs to read
    present = {
        enc: r
        for enc, r in reports.items()
        if isinstance(r, Mapping)
        and r.get("variants")
        and {"data", "base_config"} <= set(r.get("regime") or {})
    }
    for enc, report in present.items():
        regime = _regime(report)
        stopped, total, which = early_stops(report)
        runs = sorted({int(e.get("runs") or 0) for e in report["variants"].values()})
        rows.append(
            Difference(
                "all",
                f"stopping ({enc})",
                "a fixed number of epochs (ECIR 30, SmoothAP 150; VSE-infinity / GOAL 25; LTD 60), "
                "keeping the best validation checkpoint",
                f"a cap of {regime.epochs_for(Variant('ntxent'))} epochs (SmoothAP "
                f"x{regime.smoothap_epoch_factor}) and a stop after {regime.patience} epochs without a "
                "better validation rsum"
                + (f", never before the learning-rate step + {regime.hold}" if regime.hold else "")
                + f": {stopped} of {total} runs stopped before their learning-rate step + 5 epochs"
                + (f" ({'; '.join(f'`{v}` {t}' for v, t in which.items())})" if which else ""),
                "a run stopped before its learning-rate decay scores lower; two variants stopped at "
                "different points compare stopping, not losses",
            )
        )
        rows.append(
            Difference(
                "all",
                f"seeds ({enc})",
                "ECIR 5 per configuration; GOAL 3; Cross-Example Softmax 5",
                f"{'-'.join(map(str, (runs[0], runs[-1]))) if len(runs) > 1 else runs[0]} per variant",
                "fewer than 5 seeds decide a verdict only when the effect exceeds every seed's spread",
            )
        )
        masked = [
            v
            for v, e in report["variants"].items()
            if ((e.get("objective") or {}).get("params") or {}).get("mask_duplicates")
        ]
        if masked:
            rows.append(
                Difference(
                    "all",
                    f"false negatives ({enc})",
                    "no seed loss masks the other captions of a batch's image (seed-code notes, "
                    "conventions); Flickr30k/COCO captions rarely repeat across images",
                    f"`mask_duplicates` on in {len(masked)} of {len(report['variants'])} variants; the "
                    "generated captions repeat across images, and a caption true of several images in a "
                    "batch still counts those images as negatives",
                    "false negatives hurt hardest-negative mining most (its one negative is often a true "
                    "match), so SH and mining objectives are penalised more than softmax ones",
                )
            )
        rows.append(
            Difference(
                "ecir",
                f"COCOS ({enc})",
                "counts over the training batches of the converged checkpoint",
                f"{regime.cocos_batches} training batches of {regime.batch_size} at the best checkpoint",
                "batch-to-batch spread is larger with few batches; seed means are what the tests use",
            )
        )
        smoothap = report["variants"].get("smoothap")
        if smoothap is not None:
            config = _config(report, "smoothap")
            rows.append(
                Difference(
                    "ecir",
                    f"SmoothAP schedule ({enc})",
                    "150 epochs with `lr_update` 75 (VSE++, VSRN COCO) or 50: the step scaled with its "
                    "5x shorter epochs",
                    f"a cap of {config.train.epochs} epochs with `lr_update` {config.optim.lr_update}: "
                    + (
                        "scaled"
                        if config.optim.lr_update
                        >= regime.smoothap_epoch_factor * _config(report, "ntxent").optim.lr_update
                        else f"not scaled, so its learning rate drops after about "
                        f"{config.optim.lr_update / regime.smoothap_epoch_factor:g} caption-level epochs' "
                        "worth of steps"
                    ),
                    "an early decay slows SmoothAP's later epochs; its scores may be understated",
                )
            )
        if enc == "gpo":
            config = _config(report, next(iter(report["variants"])))
            rows.append(
                Difference(
                    "ecir",
                    "VSRN's stand-in",
                    "VSRN (GCN reasoning over 36 BUTD regions, GRU), Adam lr 2e-4, `lr_update` 15 (COCO) / "
                    "10 (F30k), 30 epochs",
                    f"the GPO encoder (VSE-infinity) on 16 grid regions, {config.optim.optimizer} lr "
                    f"{config.optim.lr:g}, `lr_update` {config.optim.lr_update}, cap {config.train.epochs}",
                    "ECIR's VSRN findings are tested on another architecture and optimiser",
                )
            )
        for name in (v for v in report["variants"] if Variant.parse(v).decoder == "ltd"):
            entry, config = report["variants"][name], _config(report, name)
            params = (entry.get("objective") or {}).get("params") or {}
            text = config.model.get("text", {})
            rows.append(
                Difference(
                    "ltd",
                    f"`{name}`",
                    "InfoNCE τ 0.05; bi-GRU (512 per direction) with a 2-layer head; SWA every epoch; "
                    "AdamP 2e-4 with a 30 + 30 epoch cosine schedule and fine-tuning from epoch 30; 60 "
                    "epochs",
                    f"τ {params.get('temperature', '?')}; "
                    f"{'bi' if text.get('bidirectional') else 'uni'}-GRU ({text.get('hidden', '?')}) with a "
                    f"linear head; SWA {'on' if config.train.swa else 'off'}; {config.optim.optimizer} "
                    f"{config.optim.lr:g}, {config.optim.schedule} schedule (step at "
                    f"{config.optim.lr_update}); frozen features; cap {config.train.epochs}",
                    "a higher temperature weights hard negatives less; without SWA and the long schedule "
                    "the contrastive baseline and LTD may converge to different points than in the paper",
                )
            )
        for name in (v for v in report["variants"] if v.startswith("cross_example")):
            steps = _steps(report["variants"][name])
            rows.append(
                Difference(
                    "ces",
                    f"`{name}`",
                    "batch 512, 25k steps, BERT-base and an image tower fine-tuned (AdamW / SGD)",
                    f"batch {regime.batch_size}, "
                    + (f"about {steps / 1000:.1f}k steps" if steps else "steps not recorded")
                    + ", frozen features with a GRU text tower",
                    "4x fewer cross-example negatives per batch; calibration gains that need many "
                    "negatives may shrink",
                )
            )
    return rows


def markdown(rows: list[Difference], papers: Mapping[str, Any]) -> list[str]:
    """The "Regime differences" section's table (papers: paper_numbers.PAPERS, for short names)."""
    md = [
        "## Regime differences",
        "",
        "Read from the runs (their reports' regime, resolved objective parameters and per-seed "
        "convergence) and the variants' configs; the papers' side from the seed-code notes.",
        "",
        "| paper | setting | the paper | ours | what it may change |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        paper = "all" if r.paper == "all" else papers[r.paper].short
        cells = (paper, r.setting, r.theirs, r.ours, r.may_change)
        md.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return md + [""]


__all__ = ["Difference", "differences", "early_stops", "markdown"]
