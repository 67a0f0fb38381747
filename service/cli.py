"""The `icr` command. The CLI sits at the top of the import chain (service -> index -> training),
so it may reach every stage; each command imports what it needs when it runs."""

from __future__ import annotations

import typer

from bench.cli import bench_command
from index.cli import index_app
from service.demo import demo_command
from service.serve_cli import serve_command
from training.analysis.cli import analyze_app
from training.cli import data_app
from training.evaluate_cli import evaluate_command
from training.train_cli import train_command

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
app.add_typer(index_app, name="index")
app.command("serve")(serve_command)
app.command("demo")(demo_command)
app.command("bench")(bench_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
