"""The `icr` command. The CLI sits at the top of the import chain (service -> index -> training),
so it may reach every stage; each command imports what it needs when it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from training.cli import data_app, dataset_statistics
from training.cli_support import fail_cleanly, print_summary
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

# The embedded default's sizes: big enough for a meaningful 1K test protocol, ~30 s to generate.
DEMO_COUNTS = {"train": 10000, "val": 1000, "test": 1000}


@app.command()
@fail_cleanly
def demo(
    workdir: Annotated[
        Path, typer.Option(help="Where the demo keeps its artifacts (reused on the next run).")
    ] = Path("icr-demo"),
    seed: Annotated[int, typer.Option(help="Seed of the synthetic benchmark.")] = 0,
    force: Annotated[bool, typer.Option(help="Regenerate artifacts even if cached ones match.")] = False,
) -> None:
    """Run the embedded default end to end on a machine with no data and no network.

    Today: generates the synthetic benchmark (or reuses a matching cached one) and prints its
    statistics. Training, indexing and serving join this command as they land.

    Examples:

      icr demo

      icr demo --workdir /tmp/icr-demo --seed 3
    """
    from training.data.synthetic.generate import GENERATOR_VERSION, load_scenes, write_dataset

    data = workdir / "data"
    cached = None
    if (data / "scenes.json").is_file() and not force:
        try:
            cached = load_scenes(data).generator
        except ValueError:
            cached = None  # unreadable cache: regenerate below
    wanted = {"version": GENERATOR_VERSION, "seed": seed, "image_size": 64, "counts": DEMO_COUNTS}
    if cached is not None and all(cached.get(k) == v for k, v in wanted.items()):
        typer.echo(f"[1/1] synthetic benchmark: cached in {data}")
    else:
        typer.echo(f"[1/1] synthetic benchmark: generating {sum(DEMO_COUNTS.values())} images into {data}")
        summary = write_dataset(data, **DEMO_COUNTS, image_size=64, seed=seed, force=True, progress=True)
        typer.echo(f"      done in {summary['seconds']:.1f} s")
    print_summary(dataset_statistics(data))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
