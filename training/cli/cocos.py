"""`icr analyze cocos`: how many candidates contribute to each query's gradient at a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from icr.core.cli_support import fail_cleanly
from icr.core.devices import Device

COUNTER_CHOICES = ("auto", "generic")


@fail_cleanly
def cocos(
    checkpoint: Annotated[
        Path, typer.Option(help="Checkpoint directory written by `icr train` (e.g. runs/x/best).")
    ],
    data: Annotated[Path, typer.Option(help="Dataset: Karpathy JSON (file or folder) or a precomp folder.")],
    split: Annotated[str, typer.Option(help="Split to iterate (the paper: the training set).")] = "train",
    objective: Annotated[
        str | None,
        typer.Option(help="Objective to analyse (default: the checkpoint's; see `icr train --list-losses`)."),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="One objective parameter, e.g. --set margin=0.1 (repeatable; TOML values)."
        ),
    ] = None,
    counter: Annotated[
        str,
        typer.Option(
            help="auto: the objective's own COCOS definition (triplet, triplet_hardest, ntxent, smoothap; "
            "others: generic); generic: entries whose loss gradient exceeds epsilon x the largest "
            "negative gradient of the batch."
        ),
    ] = "auto",
    epsilon: Annotated[
        float,
        typer.Option(
            help="Threshold: softmax weight (ntxent), sim(D)/R^2 (smoothap), relative gradient (generic)."
        ),
    ] = 0.01,
    batch_size: Annotated[
        int,
        typer.Option(
            help="Captions per batch (images per batch for image-level objectives such as smoothap)."
        ),
    ] = 128,
    max_batches: Annotated[
        int | None, typer.Option(help="Stop after this many batches (default: all).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the batch order.")] = 0,
    device: Annotated[Device, typer.Option(help="auto (CUDA if present), cpu or cuda.")] = "auto",
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the result as JSON here (atomically).")
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Count contributing samples (COCOS, Bleeker & de Rijke ECIR 2022) of a trained checkpoint.

    Embeds the batches of one epoch with eval preprocessing and, per batch, counts the candidates
    that contribute to each query's gradient; prints mean +- std over batches for i2t (image
    queries) and t2i (caption queries).

    Examples:

      icr analyze cocos --checkpoint runs/vsepp/best --data data/synth

      icr analyze cocos --checkpoint runs/vsepp/best --data ~/data/coco --max-batches 200 --json cocos.json

      icr analyze cocos --checkpoint runs/ntx/best --data data/synth --objective triplet --set margin=0.1

      icr analyze cocos --checkpoint runs/goal/best --data data/synth --counter generic --epsilon 0.05
    """
    import torch

    from icr.core.atomic import atomic_write_text
    from icr.core.devices import resolve_device
    from icr.training.analysis.cocos import run_cocos
    from icr.training.config import parse_override

    if counter not in COUNTER_CHOICES:
        raise ValueError(f"--counter must be one of {', '.join(COUNTER_CHOICES)}, got {counter!r}")
    params: dict[str, Any] = {}
    for item in set_ or []:
        keys, value = parse_override(item)
        if len(keys) != 1:
            raise ValueError(
                f"--set {item!r}: takes one objective parameter (e.g. margin=0.1), not a dotted key"
            )
        params[keys[0]] = value
    result = run_cocos(
        checkpoint,
        data,
        split=split,
        objective=objective,
        params=params,
        counter=counter,
        batch_size=batch_size,
        epsilon=epsilon,
        max_batches=max_batches,
        seed=seed,
        device=torch.device(resolve_device(device, "--device")),
        progress=not quiet,
    )
    print_table(result)
    if json_out is not None:
        atomic_write_text(json_out, json.dumps(result, indent=2, allow_nan=False) + "\n")
        typer.echo(f"wrote {json_out}")


def _cell(metric: dict[str, Any] | None) -> str:
    if metric is None or metric["mean"] is None:
        return "n/a"
    return f"{metric['mean']:.3f} +- {metric['std']:.3f}"


def print_table(result: dict[str, Any]) -> None:
    """One row per COCOS symbol, i2t and t2i columns (mean +- std over batches)."""
    params = ", ".join(f"{k}={v}" for k, v in result["params"].items())
    typer.echo(
        f"COCOS {result['checkpoint']} [{result['split']}]: {result['objective']}({params}), "
        f"counter {result['counter']}, epsilon {result['epsilon']}, "
        f"{result['batches']} batches of {result['batch_size']} ({result['sampling']}-level)"
    )
    metrics = result["metrics"]
    keys = list(dict.fromkeys(name.split("_", 1)[1] for name in metrics))  # in counter order
    rows = [
        (
            metrics[f"i2t_{k}"]["symbol"] if f"i2t_{k}" in metrics else k,
            _cell(metrics.get(f"i2t_{k}")),
            _cell(metrics.get(f"t2i_{k}")),
        )
        for k in keys
    ]
    widths = [max(len(r[i]) for r in [("symbol", "i2t", "t2i"), *rows]) for i in range(3)]
    for row in [("symbol", "i2t", "t2i"), *rows]:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
