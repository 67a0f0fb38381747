"""Loss comparison: train several objectives under one fixed regime, evaluate, analyse, report.

Every variant is trained from the same base config with the same epochs, batch size and seeds;
each run is then evaluated on the test split (annotations and, on the embedded benchmark, ground
truth; PR-AUC; calibration fitted on val; t2i with distractors) and analysed with COCOS on the
training split. The report is a Table-1-style Markdown file (mean +- std over seeds) plus JSON and
PNG plots.

Runs are resumable: a finished run keeps its ``result.json`` and is not redone; an interrupted one
resumes from its ``train_state.pt``. Changing the regime (epochs, batch size, base config,
overrides) of an existing run folder is refused rather than mixed into one table.

Variants are ``OBJECTIVE`` or ``OBJECTIVE+DECODER:MODE`` (e.g. ``ntxent+ltd:constraint``). SmoothAP
trains on image-level batches (B images x all their captions, 5x fewer steps per epoch); as in the
ECIR paper its epochs are multiplied by the captions per image (``smoothap_epoch_factor``) so it
takes as many optimizer steps as the caption-level objectives.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from icr.core.atomic import atomic_write_text
from icr.training.analysis.cocos import run_cocos
from icr.training.config import TrainConfig, load_config
from icr.training.evaluation.full_report import EvalOptions, evaluate_checkpoint
from icr.training.evaluation.plots import plot_grouped_bars, plot_pr_curves
from icr.training.losses import load_all
from icr.training.run_state import STATE_FILE
from icr.training.train import train

RESULT_FILE = "result.json"


@dataclass(frozen=True)
class Variant:
    """``OBJECTIVE[key=value,...]+DECODER:MODE``; the bracket and the decoder are optional."""

    objective: str
    decoder: str | None = None  # ltd | itd
    mode: str | None = None  # dual | constraint
    params: tuple[tuple[str, str], ...] = ()  # the objective's [loss.<objective>] parameters

    @classmethod
    def parse(cls, spec: str) -> Variant:
        head, _, decoding = spec.strip().partition("+")
        objective, bracket, rest = head.partition("[")
        params: list[tuple[str, str]] = []
        if bracket:
            if not rest.endswith("]") or "[" in rest[:-1] or "]" in rest[:-1]:
                raise ValueError(f"variant {spec!r}: write OBJECTIVE[key=value,key=value]")
            for item in filter(None, (p.strip() for p in rest[:-1].split(","))):
                key, eq, value = item.partition("=")
                if not eq or not key.strip() or not value.strip():
                    raise ValueError(f"variant {spec!r}: parameter {item!r} is not key=value")
                params.append((key.strip(), value.strip()))
        if objective not in load_all():
            raise ValueError(
                f"unknown objective {objective!r} in variant {spec!r}; see `icr train --list-losses`"
            )
        if not decoding:
            return cls(objective, params=tuple(params))
        decoder, _, mode = decoding.partition(":")
        if decoder not in ("ltd", "itd") or mode not in ("dual", "constraint"):
            raise ValueError(
                f"variant {spec!r}: write OBJECTIVE+ltd:dual, +ltd:constraint, +itd:dual or +itd:constraint"
            )
        return cls(objective, decoder, mode, tuple(params))

    @property
    def name(self) -> str:
        head = self.objective
        if self.params:
            head += "[" + ",".join(f"{k}={v}" for k, v in self.params) + "]"
        return head if self.decoder is None else f"{head}+{self.decoder}:{self.mode}"

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() or c in "_." else "-" for c in self.name).strip("-")

    def overrides(self) -> list[str]:
        out = [f'loss.name="{self.objective}"']
        out += [f"loss.{self.objective}.{k}={v}" for k, v in self.params]
        if self.decoder is not None:
            out += [f'decoding.kind="{self.decoder}"', f'decoding.mode="{self.mode}"']
        return out


@dataclass(frozen=True)
class Regime:
    """What every run shares; its hash guards run folders against mixing regimes."""

    data: str
    base_config: str = "synthetic-ntxent"
    epochs: int = 2
    batch_size: int = 128
    smoothap_epoch_factor: int = 5
    overrides: tuple[str, ...] = ()
    distractors: int = 10000
    cocos_batches: int = 20
    # Stop a run once validation rsum has not improved for this many epochs (0: train all epochs,
    # which then are a fixed budget rather than an upper bound).
    patience: int = 0
    # Patience cannot end a run before its learning-rate step + ``hold`` epochs (0: from the start).
    hold: int = 0
    # SmoothAP's lr_update times its epoch factor, as ECIR's 150-epoch runs step at 75 / 50.
    scale_schedule: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        # fields joined later are left out at their old behaviour, so older run folders stay valid
        later = {("patience", 0), ("hold", 0), ("scale_schedule", False)}
        fields = {k: v for k, v in self.__dict__.items() if k != "extra" and (k, v) not in later}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    def _factor(self, variant: Variant) -> int:
        return self.smoothap_epoch_factor if variant.objective == "smoothap" else 1

    def epochs_for(self, variant: Variant) -> int:
        """``epochs`` (0: the base config's own) times SmoothAP's factor."""
        epochs = self.epochs or load_config(self.base_config, [f'data.path="{self.data}"']).train.epochs
        return epochs * self._factor(variant)

    def patience_for(self, variant: Variant) -> int:
        """SmoothAP's epochs are 1/factor as long, so its patience is as many steps, not epochs."""
        return self.patience * self._factor(variant)


def run_config(regime: Regime, variant: Variant, seed: int, out: Path) -> TrainConfig:
    overrides = [
        f'data.path="{regime.data}"',
        f'train.out="{out}"',
        f"train.epochs={regime.epochs_for(variant)}",
        f"train.patience={regime.patience_for(variant)}",
        f"train.batch_size={regime.batch_size}",
        f"train.seed={seed}",
    ]
    if regime.scale_schedule and regime._factor(variant) > 1:
        base = load_config(regime.base_config, overrides[:1])
        overrides.append(f"optim.lr_update={base.optim.lr_update * regime._factor(variant)}")
    config = load_config(regime.base_config, [*overrides, *regime.overrides, *variant.overrides()])
    if regime.hold:  # after every override, so a --set optim.lr_update moves the hold with it
        held = min(config.optim.lr_update + regime.hold * regime._factor(variant), config.train.epochs)
        config = config.model_copy(update={"train": config.train.model_copy(update={"min_epochs": held})})
    return config


def _summary_of_eval(report: dict[str, Any]) -> dict[str, Any]:
    """The parts of an evaluation report the comparison tables and plots use."""
    out: dict[str, Any] = {}
    for label in ("annotations", "ground_truth"):
        if label in report:
            section = report[label]
            points = section["pr_curve_points"]
            keep = np.unique(
                np.linspace(0, len(points["recall"]) - 1, min(200, len(points["recall"]))).astype(int)
            )
            out[label] = {
                "retrieval": section["retrieval"],
                "global": section["global"],
                "thresholds": section["thresholds"],
                "calibration": {k: section["calibration"][k] for k in ("ece", "method")}
                if "calibration" in section
                else None,
                "pr_curve_points": {k: [v[i] for i in keep] for k, v in points.items()},
            }
    if "distractors" in report:
        out["distractors"] = report["distractors"]
    return out


def _run_dir(runs_dir: Path, variant: Variant, seed: int) -> Path:
    return runs_dir / variant.slug / f"seed{seed}"


def run_one(
    regime: Regime, variant: Variant, seed: int, runs_dir: Path, *, progress: bool = True
) -> dict[str, Any]:
    """Train (or resume), evaluate and analyse one (variant, seed); cached in ``result.json``."""
    run_dir = _run_dir(runs_dir, variant, seed)
    result_path = run_dir / RESULT_FILE
    if result_path.is_file():
        result: dict[str, Any] = json.loads(result_path.read_text())
        if result.get("regime_key") != regime.key():
            raise ValueError(
                f"{run_dir} was trained under another regime (epochs, batch size, config or overrides "
                f"differ); use a new --runs folder or delete that run"
            )
        return result
    config = run_config(regime, variant, seed, run_dir)
    # wall seconds depend on what else shares the cores; this process's CPU seconds do not (the
    # paper suite trains with train.threads=1, so they are single-core seconds). A resumed run counts
    # only what ran after its resume, in both.
    t0, c0 = time.perf_counter(), time.process_time()
    summary = train(config, resume=(run_dir / STATE_FILE).is_file(), progress=progress)
    assert summary is not None  # one process: rank 0
    train_s, train_cpu = time.perf_counter() - t0, time.process_time() - c0
    # best/ exists once a validation ran (every epoch end); a run cut short by train.max_steps
    # inside its first epoch only has last/.
    best = run_dir / "best" if (run_dir / "best").is_dir() else run_dir / "last"
    t0, c0 = time.perf_counter(), time.process_time()
    report = evaluate_checkpoint(
        # relevance_depth 0: the tables read no threshold-honesty section, and it costs a search
        best,
        regime.data,
        EvalOptions(distractors=regime.distractors, progress=progress, relevance_depth=0),
    )
    eval_s, eval_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    cocos = run_cocos(
        best, regime.data, batch_size=regime.batch_size, max_batches=regime.cocos_batches, progress=progress
    )
    result = {
        "variant": variant.name,
        "seed": seed,
        "regime_key": regime.key(),
        "epochs": regime.epochs_for(variant),
        "epochs_completed": summary["epochs_completed"],
        "epochs_this_run": summary["epochs_this_call"],  # what "seconds" cover when resumed
        "best_epoch": summary["best_epoch"],
        "stopped_by_patience": summary["stopped_by_patience"],
        "checkpoint": report["checkpoint"],
        "eval": _summary_of_eval(report),
        "cocos": {
            k: cocos[k] for k in ("counter", "epsilon", "batches", "batch_size", "sampling", "metrics")
        },
        "seconds": {"train": train_s, "evaluate": eval_s, "cocos": time.perf_counter() - t0},
        "cpu_seconds": {"train": train_cpu, "evaluate": eval_cpu, "cocos": time.process_time() - c0},
    }
    atomic_write_text(result_path, json.dumps(result, indent=2) + "\n")
    return result


# --- aggregation ------------------------------------------------------------------------------
def _mean_std(values: Sequence[float | None]) -> tuple[float, float] | None:
    v = np.array([x for x in values if x is not None], dtype=np.float64)
    return (float(v.mean()), float(v.std())) if v.size else None


def _pooled(metrics: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    """Mean and std over all batches of all seeds, from per-seed batch means and stds."""
    rows = [m for m in metrics if m.get("mean") is not None]
    if not rows:
        return None
    means = np.array([m["mean"] for m in rows])
    stds = np.array([m["std"] or 0.0 for m in rows])
    mean = float(means.mean())
    return mean, float(np.sqrt(max(np.mean(stds**2 + means**2) - mean**2, 0.0)))


def _cell(ms: tuple[float, float] | None, digits: int) -> str:
    return "-" if ms is None else f"{ms[0]:.{digits}f} ± {ms[1]:.{digits}f}"


def _get(result: dict[str, Any], path: str) -> float | None:
    node: Any = result
    for part in path.split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, int | float) else None


def _table(
    title: str, columns: list[tuple[str, str, int]], groups: dict[str, list[dict[str, Any]]]
) -> list[str]:
    lines = [f"### {title}", "", "| variant | " + " | ".join(c for c, _, _ in columns) + " |"]
    lines.append("|---|" + "---:|" * len(columns))
    for name, results in groups.items():
        cells = [_cell(_mean_std([_get(r, path) for r in results]), digits) for _, path, digits in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


ANN = "eval/annotations/retrieval"
GT = "eval/ground_truth/retrieval"
MAIN_COLUMNS = [
    ("i2t R@1", f"{ANN}/i2t_r1", 1),
    ("i2t R@5", f"{ANN}/i2t_r5", 1),
    ("i2t R@10", f"{ANN}/i2t_r10", 1),
    ("i2t ar", f"{ANN}/i2t_ar", 1),
    ("i2t mAP@5 (ECIR)", f"{ANN}/i2t_map5_ecir", 2),
    ("t2i R@1", f"{ANN}/t2i_r1", 1),
    ("t2i R@5", f"{ANN}/t2i_r5", 1),
    ("t2i R@10", f"{ANN}/t2i_r10", 1),
    ("t2i ar", f"{ANN}/t2i_ar", 1),
    ("rsum", f"{ANN}/rsum", 1),
]
TRUTH_COLUMNS = [
    ("rsum", f"{GT}/rsum", 1),
    ("i2t R-prec", f"{GT}/i2t_rprec", 3),
    ("t2i R-prec", f"{GT}/t2i_rprec", 3),
    ("i2t mAP", f"{GT}/i2t_map", 3),
    ("t2i mAP", f"{GT}/t2i_map", 3),
]
CALIBRATION_COLUMNS = [
    ("PR-AUC (annotations)", "eval/annotations/global/pr_auc", 4),
    ("PR-AUC (ground truth)", "eval/ground_truth/global/pr_auc", 4),
    ("best F1 (ground truth)", "eval/ground_truth/global/best_f1", 3),
    ("ECE (ground truth, isotonic on val)", "eval/ground_truth/calibration/ece", 4),
    ("t2i R@1 +distractors (annot.)", "eval/distractors/annotations/t2i_r1", 2),
    ("t2i R@5 +distractors (annot.)", "eval/distractors/annotations/t2i_r5", 2),
    ("t2i R@10 +distractors (annot.)", "eval/distractors/annotations/t2i_r10", 2),
    ("t2i R@100 +distractors (annot.)", "eval/distractors/annotations/t2i_r100", 2),
    ("t2i R@10 +distractors (truth)", "eval/distractors/ground_truth/t2i_r10", 2),
]

SECTIONS = (
    ("annotations", MAIN_COLUMNS),
    ("ground_truth", TRUTH_COLUMNS),
    ("calibration", CALIBRATION_COLUMNS),
)


def _by_variant(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Runs grouped by variant (in the order variants were given), each group by ascending seed."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(results, key=lambda r: r["seed"]):  # stable: variant order survives
        groups.setdefault(r["variant"], []).append(r)
    return groups


def _cocos_lines(groups: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = ["### COCOS at the best checkpoint (training split, mean ± std over batches of all seeds)", ""]
    lines += ["| variant | counter | i2t | t2i |", "|---|---|---|---|"]
    for name, results in groups.items():
        metrics = [r["cocos"]["metrics"] for r in results]
        keys = sorted({k[4:] for m in metrics for k in m})
        per_dir = {
            d: ", ".join(
                f"{metrics[0][f'{d}_{k}'].get('symbol', k)} "
                f"{_cell(_pooled([m[f'{d}_{k}'] for m in metrics]), 2)}"
                for k in keys
                if f"{d}_{k}" in metrics[0]
            )
            for d in ("i2t", "t2i")
        }
        lines.append(f"| {name} | {results[0]['cocos']['counter']} | {per_dir['i2t']} | {per_dir['t2i']} |")
    return lines + [""]


def build_report(results: list[dict[str, Any]], regime: Regime, command: str) -> tuple[dict[str, Any], str]:
    groups = _by_variant(results)
    seeds = sorted({r["seed"] for r in results})
    md = [
        "# Loss comparison on the embedded benchmark",
        "",
        f"Produced by `{command}`.",
        "",
        f"Regime: base config `{regime.base_config}`, {regime.epochs_for(Variant('ntxent'))} epochs "
        f"(SmoothAP x{regime.smoothap_epoch_factor}: "
        f"image-level batches, same number of steps), batch {regime.batch_size}, seeds {seeds}, "
        f"overrides {list(regime.overrides) or 'none'}"
        + (f", early stopping after {regime.patience} epochs without improvement" if regime.patience else "")
        + (f", never before the learning-rate step + {regime.hold} epochs" if regime.hold else "")
        + (", SmoothAP's learning-rate step scaled with its epochs" if regime.scale_schedule else "")
        + f". Test split of `{regime.data}`; "
        "mean ± std over seeds. "
        "Recall in percent, AP-type metrics on a 0-1 scale. "
        f"COCOS on {regime.cocos_batches} training batches "
        f"of {regime.batch_size}; t2i with {regime.distractors:,} generated distractors.",
        "",
    ]
    md += _table(
        "Retrieval against the annotations (5 captions per image; the papers' Table 1)", MAIN_COLUMNS, groups
    )
    md += _table(
        "Retrieval against the ground truth (every image a caption is true of is relevant)",
        TRUTH_COLUMNS,
        groups,
    )
    md += _table("Global calibration (all caption-image pairs) and distractors", CALIBRATION_COLUMNS, groups)
    md += _cocos_lines(groups)
    md += [
        "### Convergence and training time per run (2-core CPU)",
        "",
        "Best epoch: where validation rsum peaked (the checkpoint evaluated above); epochs run: "
        + (
            f"until {regime.patience} epochs without improvement (SmoothAP x{regime.smoothap_epoch_factor}) "
            f"or the cap of {regime.epochs_for(Variant('ntxent'))}."
            if regime.patience
            else "all of them (no early stopping)."
        ),
        "",
        "| variant | best epoch | epochs run | stopped early | train s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, rs in groups.items():
        early = sum(bool(r.get("stopped_by_patience")) for r in rs)
        md.append(
            f"| {name} | {_cell(_mean_std([r.get('best_epoch') for r in rs]), 1)} "
            f"| {_cell(_mean_std([r.get('epochs_completed') for r in rs]), 1)} | {early}/{len(rs)} "
            f"| {_cell(_mean_std([r['seconds']['train'] for r in rs]), 0)} |"
        )
    md.append("")
    report = {
        "regime": {k: v for k, v in regime.__dict__.items() if k != "extra"},
        "regime_key": regime.key(),
        "command": command,
        "seeds": seeds,
        "variants": {
            name: {
                "runs": len(rs),
                # the unit of the findings' tests: one value per seed (COCOS: that seed's batch mean)
                "seeds": [r["seed"] for r in rs],
                "per_seed": {
                    **{label: {c: [_get(r, p) for r in rs] for c, p, _ in cols} for label, cols in SECTIONS},
                    "cocos": {
                        k: [r["cocos"]["metrics"][k].get("mean") for r in rs]
                        for k in rs[0]["cocos"]["metrics"]
                    },
                    "convergence": {
                        **{k: [r.get(k) for r in rs] for k in ("best_epoch", "epochs_completed")},
                        "stopped_by_patience": [bool(r.get("stopped_by_patience")) for r in rs],
                        "best_step": [r["checkpoint"].get("step") for r in rs],
                    },
                },
                # the objective's resolved parameters and the decoding, as the runs trained them
                "objective": rs[0]["checkpoint"].get("objective"),
                "decoding": rs[0]["checkpoint"].get("decoding"),
                **{
                    label: {c: _mean_std([_get(r, p) for r in rs]) for c, p, _ in cols}
                    for label, cols in SECTIONS
                },
                "cocos": {
                    k: _pooled([r["cocos"]["metrics"][k] for r in rs]) for k in rs[0]["cocos"]["metrics"]
                },
                "best_epoch": _mean_std([r.get("best_epoch") for r in rs]),
                "epochs_completed": _mean_std([r.get("epochs_completed") for r in rs]),
                "train_seconds": _mean_std([r["seconds"]["train"] for r in rs]),
            }
            for name, rs in groups.items()
        },
    }
    return report, "\n".join(md)


def write_plots(results: list[dict[str, Any]], directory: Path) -> list[Path]:
    groups = _by_variant(results)
    paths = []
    for label in ("annotations", "ground_truth"):
        curves = {
            f"{name} (AP {rs[0]['eval'][label]['global']['pr_auc']:.3f})": rs[0]["eval"][label][
                "pr_curve_points"
            ]
            for name, rs in groups.items()
            if label in rs[0]["eval"]
        }
        if curves:
            paths.append(
                plot_pr_curves(
                    curves,
                    directory / f"pr-curves-{label}.png",
                    f"PR over all pairs ({label}), seed {results[0]['seed']}",
                )
            )
    rsum = {
        name: {
            label: _mean_std([_get(r, f"eval/{label}/retrieval/rsum") for r in rs]) or (np.nan, 0.0)
            for label in ("annotations", "ground_truth")
        }
        for name, rs in groups.items()
    }
    paths.append(
        plot_grouped_bars(
            rsum, directory / "rsum.png", "rsum on the test split (mean ± std over seeds)", "rsum"
        )
    )
    cocos = {
        name: {
            k: v
            for k, v in (
                (k, _pooled([r["cocos"]["metrics"][k] for r in rs]))
                for k in rs[0]["cocos"]["metrics"]
                if k.endswith(("_Cq", "_Cqv_neg"))
            )
            if v is not None
        }
        for name, rs in groups.items()
    }
    paths.append(
        plot_grouped_bars(cocos, directory / "cocos.png", "COCOS: contributing negatives per query", "count")
    )
    return paths


def compare(
    variants: Sequence[str],
    seeds: Sequence[int],
    regime: Regime,
    runs_dir: Path,
    report_dir: Path,
    *,
    command: str,
    progress: bool = True,
    log: Callable[[str], None] = print,
    finished_only: bool = False,
) -> dict[str, Any]:
    """Run every (variant, seed) (resumably), then write report.md, report.json and PNGs.

    ``finished_only``: train nothing; report the runs that have finished (a variant may then have
    fewer seeds than others, which its ``runs`` count and the convergence table show).
    """
    parsed = [Variant.parse(v) for v in variants]
    if len({v.name for v in parsed}) != len(parsed):
        raise ValueError(f"duplicate variants in {list(variants)}")
    if not seeds:
        raise ValueError("give at least one seed")
    results = []
    total = len(parsed) * len(seeds)
    for k, (variant, seed) in enumerate(((v, s) for v in parsed for s in seeds), start=1):
        if finished_only and not (_run_dir(runs_dir, variant, seed) / RESULT_FILE).is_file():
            log(f"[{k}/{total}] {variant.name} seed {seed}: not run, left out of the report")
            continue
        log(f"[{k}/{total}] {variant.name} seed {seed}")
        results.append(run_one(regime, variant, seed, runs_dir, progress=progress))
    if not results:
        raise ValueError(f"no finished runs in {runs_dir} for {list(variants)}; run them first")
    report, markdown = build_report(results, regime, command)
    report_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = [p.name for p in write_plots(results, report_dir)]
    atomic_write_text(report_dir / "report.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(
        report_dir / "report.md", markdown + "\n" + "".join(f"\n![{p}]({p})\n" for p in report["plots"])
    )
    return report
