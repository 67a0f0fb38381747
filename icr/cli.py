"""The `icr` command. The CLI sits above the stages (service -> index -> training) and orchestrates
them; each command imports what it needs when it runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

import icr
from icr.demo import demo_command
from icr.index.cli import embed_command, index_app
from icr.service.cli import serve_command
from icr.training.cli.analyze import analyze_app
from icr.training.cli.data import data_app
from icr.training.cli.evaluate import evaluate_command
from icr.training.cli.model import model_app
from icr.training.cli.train import train_command

app = typer.Typer(
    name="icr",
    help="Image-caption retrieval: datasets, training, FAISS indices and an HTTP search service.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
app.add_typer(data_app, name="data")
app.command("train")(train_command)
app.command("evaluate")(evaluate_command)
app.add_typer(analyze_app, name="analyze")
app.add_typer(model_app, name="model")
app.command("embed")(embed_command)
app.add_typer(index_app, name="index")
app.command("serve")(serve_command)
app.command("demo")(demo_command)


def _register_bench() -> None:
    """``icr bench`` lives in the repository's bench/ (not installed): found when run from a clone;
    elsewhere the command says so, whatever options it is given."""
    root = Path.cwd()
    if (root / "bench" / "cli.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))  # the console script's sys.path starts at its own bin/ folder
    try:
        from bench.cli import bench_command
    except ModuleNotFoundError:
        pass
    else:
        app.command("bench")(bench_command)
        return

    @app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def bench_elsewhere() -> None:
        """The performance suite (run it from the root of a clone of the repository)."""
        typer.echo(
            "error: icr bench runs from the root of a clone of the icr repository (bench/ is "
            "not installed with the package)",
            err=True,
        )
        raise typer.Exit(2)


_register_bench()


def _version(show: bool) -> None:
    if show:
        typer.echo(f"icr {icr.__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Image-caption retrieval: datasets, training, FAISS indices and an HTTP search service."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
