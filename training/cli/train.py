"""`icr train`: train a dual encoder with a named objective from a TOML config."""

from __future__ import annotations

from typing import Annotated

import typer

from icr.core.cli_support import fail_cleanly, print_summary


@fail_cleanly
def train_command(
    config: Annotated[
        str | None,
        typer.Option(
            "--config", "-c", help="A TOML file, or the name of a shipped config (see --list-configs)."
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override one key, e.g. --set train.epochs=3 (repeatable; TOML values)."),
    ] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in train.out from train_state.pt.")] = False,
    list_configs: Annotated[bool, typer.Option(help="List the shipped configs and exit.")] = False,
    list_losses: Annotated[bool, typer.Option(help="List the objectives and their parameters.")] = False,
    show_config: Annotated[bool, typer.Option(help="Print the resolved config and exit.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Train a dual encoder; writes best/ and last/ checkpoints, train_state.pt and metrics.jsonl.

    Examples:

      icr train --config synthetic-ntxent

      icr train --config synthetic-ntxent --set loss.name=triplet_hardest --set train.out=runs/vsepp

      icr train --config synthetic-ntxent --resume

      icr train --config coco-vsepp-resnet50 --set data.path=~/data/coco --set model.image.path=~/resnet-50

      torchrun --standalone --nproc-per-node 2 -m icr.training.cli.train --config synthetic-ntxent
    """
    from icr.training.config import load_config, shipped_configs

    if list_configs:
        for name in shipped_configs():
            typer.echo(name)
        return
    if list_losses:
        from icr.training.losses import load_all

        for name, cls in sorted(load_all().items()):
            params = ", ".join(f"{k}={v!r}" for k, v in cls.defaults().items())
            typer.echo(f"{name:22s} {params}")
        return
    if config is None:
        raise ValueError("pass --config FILE or a shipped config name (icr train --list-configs)")
    cfg = load_config(config, set_ or [])
    if show_config:
        print_summary(cfg.as_dict())
        return
    from icr.training.train import train

    summary = train(cfg, resume=resume, progress=not quiet)
    if summary is not None:
        print_summary(summary)


def main() -> None:
    """``python -m icr.training.cli.train`` / ``torchrun -m icr.training.cli.train``: the training entry
    point alone, without the rest of the CLI (and without importing the server)."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(train_command)
    app()


if __name__ == "__main__":
    main()
