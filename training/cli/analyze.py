"""`icr analyze ...`: analyses of trained checkpoints.

Heavy modules are imported inside the commands so `icr --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from icr.training.analysis.compare import DEFAULT_VARIANTS
from icr.training.cli.cocos import cocos
from icr.training.cli.support import fail_cleanly

analyze_app = typer.Typer(
    help="Analyse trained checkpoints: COCOS (how many candidates contribute to each query's gradient).",
    no_args_is_help=True,
)
analyze_app.command("cocos")(cocos)


@analyze_app.command("compare")
@fail_cleanly
def compare_command(
    data: Annotated[
        Path, typer.Option("--data", "-d", help="Embedded benchmark folder (icr data synth / icr demo).")
    ] = Path("icr-demo/data"),
    variants: Annotated[
        str, typer.Option(help="Comma-separated OBJECTIVE or OBJECTIVE+ltd:dual|constraint.")
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
    """
    import shlex
    import sys

    from icr.training.analysis.compare import Regime, compare

    if epochs < 1 or batch_size < 1 or smoothap_epoch_factor < 1 or cocos_batches < 1 or distractors < 0:
        raise ValueError(
            "--epochs, --batch-size, --smoothap-epoch-factor and --cocos-batches must be >= 1, "
            "--distractors >= 0"
        )
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {seeds!r}") from None
    regime = Regime(
        data=str(data),
        base_config=config,
        epochs=epochs,
        batch_size=batch_size,
        smoothap_epoch_factor=smoothap_epoch_factor,
        overrides=tuple(set_ or ()),
        distractors=distractors,
        cocos_batches=cocos_batches,
    )
    command = "icr analyze " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    result = compare(
        [v for v in variants.split(",") if v.strip()],
        seed_list,
        regime,
        runs,
        report,
        command=command,
        progress=not quiet,
        log=typer.echo,
    )
    typer.echo((report / "report.md").read_text().split("### COCOS")[0])
    typer.echo(f"wrote {report / 'report.md'}, report.json and {len(result['plots'])} plots")
