"""`icr analyze ...`: analyses of trained checkpoints.

Heavy modules are imported inside the commands so `icr --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from icr.core.cli_support import fail_cleanly
from icr.training.analysis.variants import DEFAULT_VARIANTS
from icr.training.cli.cocos import cocos

analyze_app = typer.Typer(
    help="Analyse trained checkpoints: COCOS (how many candidates contribute to each query's gradient).",
    no_args_is_help=True,
)
analyze_app.command("cocos")(cocos)


def _seed_list(seeds: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> (0, 1, 2), or a ValueError naming --seeds."""
    try:
        return tuple(int(s) for s in seeds.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {seeds!r}") from None


def _invoked_command() -> str:
    """The ``icr analyze ...`` command line as typed, for the reports to quote."""
    import shlex
    import sys

    return "icr analyze " + " ".join(shlex.quote(a) for a in sys.argv[2:])


@analyze_app.command("compare")
@fail_cleanly
def compare_command(
    data: Annotated[
        Path, typer.Option("--data", "-d", help="Embedded benchmark folder (icr data synth / icr demo).")
    ] = Path("icr-demo/data"),
    variants: Annotated[
        str,
        typer.Option(
            help="Comma-separated OBJECTIVE, OBJECTIVE[param=value,...] or OBJECTIVE+ltd|itd:dual|constraint."
        ),
    ] = ",".join(DEFAULT_VARIANTS),
    seeds: Annotated[str, typer.Option(help="Comma-separated training seeds.")] = "0,1,2",
    epochs: Annotated[int, typer.Option(help="Epochs for every caption-level objective.")] = 2,
    batch_size: Annotated[int, typer.Option(help="Batch size for every objective (SmoothAP: images).")] = 128,
    smoothap_epoch_factor: Annotated[
        int, typer.Option(help="SmoothAP epochs = epochs x this (ECIR: captions per image).")
    ] = 5,
    config: Annotated[str, typer.Option(help="Base training config (name or TOML).")] = "synthetic-ntxent",
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override for every run, e.g. --set optim.lr=5e-4.")
    ] = None,
    distractors: Annotated[int, typer.Option(help="Generated distractors for t2i recall.")] = 10000,
    cocos_batches: Annotated[int, typer.Option(help="Training batches COCOS analyses per run.")] = 20,
    patience: Annotated[
        int,
        typer.Option(
            help="Stop a run after this many epochs without a better validation rsum "
            "(0: train every epoch; --epochs is then the cap)."
        ),
    ] = 0,
    runs: Annotated[Path, typer.Option(help="Folder for the runs (resumable).")] = Path(
        "runs/loss-comparison"
    ),
    report: Annotated[Path, typer.Option(help="Folder for report.md, report.json and plots.")] = Path(
        "docs/loss-comparison"
    ),
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> None:
    """Train objectives under one fixed regime; Table-1-style report with COCOS, PR-AUC and LTD.

    Interrupt and re-run the same command to continue: finished runs are reused.

    Examples:

      icr analyze compare

      icr analyze compare --variants ntxent,sampled_softmax,cross_example_softmax --seeds 0,1 --epochs 3

      icr analyze compare --variants ntxent,ntxent+ltd:dual,ntxent+ltd:constraint --report docs/ltd

      icr analyze compare --variants 'triplet_hardest,goal[triplet_weight=cir,pair_weight=sig_ms]'
      --patience 3
    """
    from icr.training.analysis.compare import Regime, compare
    from icr.training.analysis.variants import split_variants

    if epochs < 1 or batch_size < 1 or smoothap_epoch_factor < 1 or cocos_batches < 1:
        raise ValueError("--epochs, --batch-size, --smoothap-epoch-factor and --cocos-batches must be >= 1")
    if distractors < 0 or patience < 0:
        raise ValueError("--distractors and --patience must be >= 0")
    regime = Regime(
        data=str(data),
        base_config=config,
        epochs=epochs,
        batch_size=batch_size,
        smoothap_epoch_factor=smoothap_epoch_factor,
        overrides=tuple(set_ or ()),
        distractors=distractors,
        cocos_batches=cocos_batches,
        patience=patience,
    )
    result = compare(
        split_variants(variants),
        _seed_list(seeds),
        regime,
        runs,
        report,
        command=_invoked_command(),
        progress=not quiet,
        log=typer.echo,
    )
    typer.echo((report / "report.md").read_text().split("### COCOS")[0])
    typer.echo(f"wrote {report / 'report.md'}, report.json and {len(result['plots'])} plots")


@analyze_app.command("paper")
@fail_cleanly
def paper_command(
    features: Annotated[
        Path, typer.Option("--features", "-f", help="Precomp feature folder from `icr data features`.")
    ] = Path("icr-demo/features"),
    encoders: Annotated[str, typer.Option(help="Comma-separated: vsepp, gpo.")] = "vsepp,gpo",
    variants: Annotated[
        str, typer.Option(help="Run only these variants of each encoder's suite (default: all of them).")
    ] = "",
    seeds: Annotated[str, typer.Option(help="Comma-separated training seeds.")] = "0,1,2,3,4",
    epochs: Annotated[
        int,
        typer.Option(help="Cap on epochs per run (SmoothAP x5); 0: each config's own (vsepp 30, gpo 25)."),
    ] = 0,
    patience: Annotated[
        int, typer.Option(help="Stop a run after this many epochs without a better validation rsum.")
    ] = 5,
    hold: Annotated[
        int,
        typer.Option(help="Never stop a run before its learning-rate step + this many epochs (0: no hold)."),
    ] = 5,
    scale_smoothap_schedule: Annotated[
        bool,
        typer.Option(help="SmoothAP's learning-rate step times its epoch factor (ECIR: 75 of 150 epochs)."),
    ] = True,
    batch_size: Annotated[int, typer.Option(help="Batch size (the papers': 128).")] = 128,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override for every run, e.g. --set train.threads=1.")
    ] = None,
    quick: Annotated[
        bool, typer.Option(help="A few steps of two variants per encoder, one seed (a smoke test).")
    ] = False,
    runs: Annotated[Path, typer.Option(help="Folder for the runs (resumable).")] = Path("runs/paper-regime"),
    docs: Annotated[Path, typer.Option(help="Folder for each encoder's comparison report.")] = Path(
        "docs/paper-regime"
    ),
    out: Annotated[Path, typer.Option(help="The findings markdown (JSON beside it).")] = Path(
        "docs/paper-findings.md"
    ),
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
    report_only: Annotated[
        bool,
        typer.Option(
            help="Train nothing: report and judge the runs that have finished (variants may then "
            "have fewer seeds; each report says how many)."
        ),
    ] = False,
) -> None:
    """The papers' findings under the papers' regime: every objective on frozen pretrained features,
    trained until validation stops improving (never before the learning-rate step + --hold epochs),
    5 seeds; verdicts (t tests over seeds) side by side with the papers.

    Runs `icr analyze compare` once per encoder (VSE++-style precomp and VSE-infinity GPO) and writes
    docs/paper-findings.md + .json from every report present. Interrupt and re-run to continue; run
    one process per encoder to use two cores.

    Examples:

      icr data features --data icr-demo/data --out icr-demo/features

      icr analyze paper --features icr-demo/features

      icr analyze paper --encoders vsepp --set train.threads=1 &

      icr analyze paper --encoders gpo --set train.threads=1

      icr analyze paper --quick --runs /tmp/pq --docs /tmp/pq/docs --out /tmp/pq/findings.md

      icr analyze paper --report-only                 # findings from the runs finished so far

      icr analyze paper --report-only --runs docs/paper-regime/rerun/runs --docs docs/paper-regime/rerun
      --set train.threads=1 --features /work/exp/features   # docs/paper-findings.md, committed runs

      icr analyze paper --report-only --runs docs/paper-regime/runs --epochs 20 --patience 2
      --hold 0 --no-scale-smoothap-schedule --seeds 0,1,2 --set train.threads=1
      --features /work/exp/features --out /tmp/findings-2026-11-24.md   # the runs of 2026-11-24
    """
    from icr.training.analysis.paper_regime import PaperSuite, quick_suite, run_paper_suite
    from icr.training.analysis.variants import split_variants

    if epochs < 0 or batch_size < 1 or patience < 0 or hold < 0:
        raise ValueError("--batch-size must be >= 1; --epochs, --patience and --hold >= 0")
    seed_list, overrides, only = _seed_list(seeds), tuple(set_ or ()), tuple(split_variants(variants))
    suite = (
        quick_suite(features, overrides, batch_size, only)
        if quick
        else PaperSuite(
            features,
            seed_list,
            epochs,
            batch_size,
            patience,
            hold,
            scale_smoothap_schedule,
            overrides=overrides,
            only=only,
        )
    )
    findings = run_paper_suite(
        suite,
        [e.strip() for e in encoders.split(",") if e.strip()],
        runs,
        docs,
        out,
        command=_invoked_command(),
        progress=not quiet,
        log=typer.echo,
        finished_only=report_only,
    )
    counts = ", ".join(f"{n} {verdict}" for verdict, n in findings["summary"]["all"].items() if n)
    typer.echo(f"wrote {out} and {out.with_suffix('.json')}: {counts}")
