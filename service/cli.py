"""The `icr` command. The CLI sits at the top of the import chain (service -> index -> training),
so it may reach every stage; each command imports what it needs when it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from index.cli import index_app
from training.analysis.cli import analyze_app
from training.cli import data_app, dataset_statistics
from training.cli_support import fail_cleanly, print_summary
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

# The embedded default's sizes: big enough for a meaningful 1K test protocol, ~30 s to generate.
DEMO_COUNTS = {"train": 10000, "val": 1000, "test": 1000}
# The demo model: the shipped embedded-default config, shortened to a few minutes on 2 CPU cores.
DEMO_CONFIG = "synthetic-ntxent"
DEMO_TRAIN = ["train.epochs=6"]


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

    Today: generates the synthetic benchmark and trains the default model (small CNN + GRU,
    InfoNCE), reusing both when a matching cached copy exists and resuming an interrupted
    training. Indexing and serving join this command as they land.

    Examples:

      icr demo

      icr demo --workdir /tmp/icr-demo --seed 3
    """
    data = workdir / "data"
    fresh_data = _demo_data(data, seed, force)
    print_summary(dataset_statistics(data))
    _demo_model(workdir / "model", data, retrain=force or fresh_data)


def _demo_data(data: Path, seed: int, force: bool) -> bool:
    """Generate the benchmark unless a matching copy is cached; returns whether it generated."""
    from training.data.synthetic.generate import GENERATOR_VERSION, load_scenes, write_dataset

    cached = None
    if (data / "scenes.json").is_file() and not force:
        try:
            cached = load_scenes(data).generator
        except ValueError:
            cached = None  # unreadable cache: regenerate below
    wanted = {"version": GENERATOR_VERSION, "seed": seed, "image_size": 64, "counts": DEMO_COUNTS}
    if cached is not None and all(cached.get(k) == v for k, v in wanted.items()):
        typer.echo(f"[1/2] synthetic benchmark: cached in {data}")
        return False
    typer.echo(f"[1/2] synthetic benchmark: generating {sum(DEMO_COUNTS.values())} images into {data}")
    summary = write_dataset(data, **DEMO_COUNTS, image_size=64, seed=seed, force=True, progress=True)
    typer.echo(f"      done in {summary['seconds']:.1f} s")
    return True


def _demo_model(run: Path, data: Path, retrain: bool) -> Path:
    """Train the demo model into ``run`` (best checkpoint: ``run/best``), reusing a finished run."""
    import shutil

    from training.checkpoint import read_checkpoint_config
    from training.config import load_config
    from training.train import STATE_FILE, ConfigMismatchError, train

    config = load_config(DEMO_CONFIG, [f'data.path="{data}"', f'train.out="{run}"', *DEMO_TRAIN])
    last = run / "last" / "config.json"
    if not retrain and last.is_file():
        meta = read_checkpoint_config(run / "last")
        if meta.get("train_config") == config and meta.get("epoch") == config["train"]["epochs"]:
            typer.echo(f"[2/2] model: cached in {run} (val rsum {_best_rsum(run)})")
            return run / "best"
    resume = not retrain and (run / STATE_FILE).is_file()
    if not resume:
        shutil.rmtree(run, ignore_errors=True)
    epochs = config["train"]["epochs"]
    typer.echo(f"[2/2] model: {'resuming' if resume else 'training'} {DEMO_CONFIG} for {epochs} epochs "
               f"into {run} (interrupt any time; the next `icr demo` resumes)")
    try:
        summary = train(config, resume=resume, progress=True)
    except ConfigMismatchError:  # a state from another config: start over rather than fail the demo
        shutil.rmtree(run, ignore_errors=True)
        summary = train(config, progress=True)
    assert summary is not None
    typer.echo(f"      done in {summary['elapsed_s']} s, {summary['samples_per_s']} captions/s, "
               f"val rsum {_best_rsum(run)}")
    return run / "best"


def _best_rsum(run: Path) -> str:
    """The best checkpoint's validation rsum, for the demo's messages."""
    from training.checkpoint import read_checkpoint_config

    try:
        metrics = read_checkpoint_config(run / "best").get("val_metrics") or {}
    except (OSError, ValueError):
        return "n/a"
    return f"{metrics['rsum']:.1f}" if "rsum" in metrics else "n/a"


def main() -> None:
    app()


if __name__ == "__main__":
    main()
