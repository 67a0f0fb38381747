"""``icr demo``: the embedded default end to end, on a machine with no data and no network.

Synthetic benchmark -> model -> image index with generated distractors -> caption index ->
calibration -> ``icr serve``. Every step reuses a cached artifact that matches (same generator
settings, same training config, same checkpoint weights, same distractor count), so a second run
goes straight to serving; an interrupted training resumes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from icr.core.cli_support import fail_cleanly

# The embedded default's sizes: big enough for a meaningful 1K test protocol, ~6 s to generate.
DEMO_COUNTS = {"train": 10000, "val": 1000, "test": 1000}
# The demo model's own training scenes: the same generator and seed with 50,000 training images
# (the benchmark's 10,000 are the first of them) and the same 1,000 validation images. Unseen
# scenes teach composition better than repeated ones: at about the same number of steps (4 epochs
# of 50,000 against 20 of 10,000) held-out P@10 over the demo index rose from 0.785 to 0.814
# (README, "The demo model"). A folder of its own, so that icr-demo/data stays the 10,000-image benchmark
# other commands train on in minutes.
DEMO_TRAIN_COUNTS = {"train": 50000, "val": 1000, "test": 0}
# Their training captions name the background tone more often than the benchmark's (about 8 %):
# 10 % of the one-object captions are given it (`write_captions`). With the benchmark's captions
# alone, whether a run learned that "on a dark background" matters was chance; at 30 %, 2 seeds
# in 4 trained weakly on every kind (README, "The demo model"). The images are the same either way.
DEMO_TRAIN_TONE = 0.1
# 15 % of the one-object captions of scenes of 2-3 objects are replaced by the bare count ("two
# shapes"): the benchmark never says a count alone, and a model trained without it ranked
# three-object scenes first for "two shapes".
DEMO_TRAIN_COUNT = 0.15
# The demo model shipped with icr (`icr demo` without --train): the files, and SHIPPED.json with
# the commands that made them, the commit, what it measured, and each file's sha256, verified on use.
SHIPPED_WEIGHTS = Path(__file__).with_name("demo_weights")
SHIPPED_RECORD = "SHIPPED.json"
# The demo model: trained for precision over the demo's gallery in a few minutes on 2 CPU cores
# (training/configs/synthetic-demo.toml says what it changes and why).
DEMO_CONFIG = "synthetic-demo"
DEMO_TRAIN: list[str] = []
DEMO_DISTRACTORS = 100_000
STEPS = 5


def _step(n: int, text: str) -> None:
    typer.echo(f"[{n}/{STEPS}] {text}")


@fail_cleanly
def demo_command(
    workdir: Annotated[
        Path, typer.Option(help="Where the demo keeps its artifacts (reused on the next run).")
    ] = Path("icr-demo"),
    seed: Annotated[int, typer.Option(help="Seed of the synthetic benchmark.")] = 0,
    distractors: Annotated[
        int, typer.Option(help="Generated distractor images added to the 1,000 test images in the index.")
    ] = DEMO_DISTRACTORS,
    host: Annotated[str, typer.Option(help="Interface to serve on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to serve on.")] = 8000,
    serve: Annotated[
        bool, typer.Option(help="Serve when the artifacts are ready (--no-serve: build only).")
    ] = True,
    force: Annotated[bool, typer.Option(help="Rebuild every artifact even if cached ones match.")] = False,
    train: Annotated[
        bool,
        typer.Option(
            "--train",
            help="Train the demo model from scratch (50,000 scenes, about 6 minutes on 2 cores) instead "
            "of using the weights shipped with icr (trained longer by the same command).",
        ),
    ] = False,
) -> None:
    """Run the embedded default end to end: data, model, indices, calibration, then the search service.

    Generates the synthetic benchmark (10,000 / 1,000 / 1,000 images), takes the demo model shipped
    with icr (its checksums verified; --train trains it from scratch on 50,000 generated scenes:
    small CNN + GRU, multi-positive InfoNCE on the generator's ground truth), indexes the 1,000
    test images plus 100,000 generated distractors, indexes the
    test captions for image->text search, fits the score -> relevance calibration on validation
    captions searched in that index, and serves it all at http://HOST:PORT/ (search page at /, API
    docs at /docs). Artifacts are cached in --workdir: the next run serves within seconds.

    Examples:

      icr demo

      icr demo --workdir /tmp/icr-demo --port 8080

      icr demo --distractors 1000000 --no-serve

      icr demo --train --workdir icr-demo-retrained
    """
    started = time.perf_counter()
    workdir = workdir.resolve()  # manifests record absolute paths: serving works from any directory
    data, checkpoint = demo_data_and_model(workdir, seed, force, train)
    images = _demo_index(
        3,
        f"image index (1,000 test images + {distractors:,} distractors)",
        workdir / "index" / "images",
        checkpoint,
        data,
        "image",
        distractors,
        force,
    )
    captions = _demo_index(
        4,
        "caption index (5,000 test captions, for image->text search)",
        workdir / "index" / "captions",
        checkpoint,
        data,
        "text",
        0,
        force,
    )
    _demo_calibration(images, force)
    typer.echo(f"artifacts ready in {time.perf_counter() - started:.0f} s")
    if not serve:
        typer.echo(
            f"serve them with: icr serve --index {images} --caption-index {captions} "
            f"--dataset synthetic={data}"
        )
        return
    from icr.service.cli import serve as run_server
    from icr.service.cli import settings_from

    run_server(
        settings_from(
            None, index=images, caption_index=captions, host=host, port=port, datasets={"synthetic": data}
        )
    )


def demo_data_and_model(workdir: Path, seed: int, force: bool, train: bool = True) -> tuple[Path, Path]:
    """Steps 1-2, each cached: the benchmark, then the shipped model (``train=False``) or the
    model's training scenes and the model trained on them.

    Returns (benchmark folder, best checkpoint).
    """
    data = workdir / "data"
    fresh = _demo_data(data, seed, DEMO_COUNTS, "synthetic benchmark", force)
    if not train:
        checkpoint = shipped_checkpoint()
        record = json.loads((checkpoint / SHIPPED_RECORD).read_text())
        _step(2, f"model: shipped with icr, checksums verified ({record['summary']}); --train retrains it")
        return data, checkpoint
    train_data = workdir / "train-data"
    what = "the model's training scenes"
    mix = {"tone_captions": DEMO_TRAIN_TONE, "count_captions": DEMO_TRAIN_COUNT}
    fresh |= _demo_data(train_data, seed, DEMO_TRAIN_COUNTS, what, force, **mix)
    return data, _demo_model(workdir / "model", train_data, retrain=force or fresh)


def shipped_checkpoint(folder: Path | None = None) -> Path:
    """The shipped demo checkpoint folder, once every file's sha256 matches ``SHIPPED.json``;
    ValueError naming the file that does not (or is missing) and how to get a model anyway."""
    folder = SHIPPED_WEIGHTS if folder is None else folder
    fix = "reinstall icr, or train the demo model yourself with `icr demo --train`"
    try:
        record = json.loads((folder / SHIPPED_RECORD).read_text())
        expected = dict(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{folder / SHIPPED_RECORD}: unreadable record of the shipped weights ({err}); {fix}"
        ) from None
    for name, digest in expected.items():
        path = folder / name
        try:
            actual = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as err:
            raise ValueError(f"{path}: cannot read the shipped weights ({err.strerror}); {fix}") from None
        if actual != digest:
            raise ValueError(
                f"{path}: sha256 {actual[:16]}... differs from the {digest[:16]}... recorded in "
                f"{SHIPPED_RECORD}: the shipped weights are damaged; {fix}"
            )
    return folder


def _demo_data(
    data: Path,
    seed: int,
    counts: dict[str, int],
    what: str,
    force: bool,
    tone_captions: float = 0.0,
    count_captions: float = 0.0,
) -> bool:
    """Generate ``counts`` scenes into ``data`` unless a matching copy is cached; True if it generated."""
    from icr.core.cli_support import print_summary
    from icr.training.cli.data import dataset_statistics
    from icr.training.data.synthetic.generate import GENERATOR_VERSION, load_scenes, write_dataset

    cached = None
    if (data / "scenes.json").is_file() and not force:
        try:
            cached = load_scenes(data).generator
        except ValueError:
            cached = None  # unreadable cache: regenerate below
    wanted = {"version": GENERATOR_VERSION, "seed": seed, "image_size": 64, "counts": counts}
    # datasets written before the option existed have no key and were written at 0
    if (
        cached is not None
        and all(cached.get(k) == v for k, v in wanted.items())
        and cached.get("tone_captions", 0.0) == tone_captions
        and cached.get("count_captions", 0.0) == count_captions
    ):
        _step(1, f"{what}: cached in {data}")
        return False
    _step(1, f"{what}: generating {sum(counts.values())} images into {data}")
    summary = write_dataset(
        data,
        **counts,
        image_size=64,
        seed=seed,
        force=True,
        progress=True,
        tone_captions=tone_captions,
        count_captions=count_captions,
    )
    typer.echo(f"      done in {summary['seconds']:.1f} s")
    print_summary(dataset_statistics(data))
    return True


def _demo_model(run: Path, data: Path, retrain: bool) -> Path:
    """Train the demo model into ``run`` (best checkpoint: ``run/best``), reusing a finished run."""
    from icr.training.checkpoint import read_checkpoint_config
    from icr.training.config import load_config
    from icr.training.run_state import STATE_FILE, ConfigMismatchError
    from icr.training.train import train

    config = load_config(DEMO_CONFIG, [f'data.path="{data}"', f'train.out="{run}"', *DEMO_TRAIN])
    last = run / "last" / "config.json"
    if not retrain and last.is_file():
        meta = read_checkpoint_config(run / "last")
        if meta.train_config == config.as_dict() and meta.epoch == config.train.epochs:
            _step(2, f"model: cached in {run} (val rsum {_best_rsum(run)})")
            return run / "best"
    resume = not retrain and (run / STATE_FILE).is_file()
    if not resume:
        shutil.rmtree(run, ignore_errors=True)
    epochs = config.train.epochs
    _step(
        2,
        f"model: {'resuming' if resume else 'training'} {DEMO_CONFIG} for {epochs} epochs into {run} "
        "(interrupt any time; the next `icr demo` resumes)",
    )
    try:
        summary = train(config, resume=resume, progress=True)
    except ConfigMismatchError:  # a state from another config: start over rather than fail the demo
        shutil.rmtree(run, ignore_errors=True)
        summary = train(config, progress=True)
    assert summary is not None
    typer.echo(
        f"      done in {summary['elapsed_s']} s, {summary['samples_per_s']} captions/s, "
        f"val rsum {_best_rsum(run)}"
    )
    return run / "best"


def _best_rsum(run: Path) -> str:
    """The best checkpoint's validation rsum, for the demo's messages."""
    from icr.training.checkpoint import read_checkpoint_config

    try:
        metrics = read_checkpoint_config(run / "best").val_metrics or {}
    except (OSError, ValueError):
        return "n/a"
    return f"{metrics['rsum']:.1f}" if "rsum" in metrics else "n/a"


def _cached_manifest(out: Path, checkpoint: Path, data: Path, modality: str, distractors: int) -> Any | None:
    """The index manifest at ``out`` if it was built from this checkpoint, data and distractor count."""
    from icr.index.manifest import MANIFEST_FILE, Manifest
    from icr.training.checkpoint import checkpoint_sha256

    try:
        manifest = Manifest.read(out / MANIFEST_FILE)
    except (FileNotFoundError, ValueError):
        return None
    wanted = (checkpoint_sha256(checkpoint), str(data), modality, distractors)
    found = (
        manifest.checkpoint_sha256,
        manifest.data.get("path"),
        manifest.modality,
        manifest.distractor_count,
    )
    return manifest if found == wanted else None


def _demo_index(
    step: int,
    what: str,
    out: Path,
    checkpoint: Path,
    data: Path,
    modality: str,
    distractors: int,
    force: bool,
) -> Path:
    from icr.index.build import build_caption_index, build_image_index

    manifest = None if force else _cached_manifest(out, checkpoint, data, modality, distractors)
    if manifest is not None:
        _step(step, f"{what}: cached in {out}")
        return out
    _step(step, f"{what}: building into {out}")
    t0 = time.perf_counter()
    if modality == "image":
        manifest = build_image_index(checkpoint, data, distractors=distractors, out=out, progress=True)
    else:
        manifest = build_caption_index(checkpoint, data, out=out, progress=True)
    typer.echo(
        f"      done in {time.perf_counter() - t0:.0f} s: {manifest.factory}, {manifest.ntotal:,} vectors, "
        f"recall@10 {manifest.recall_check['recall']:.3f} against exact search"
    )
    return out


def _demo_calibration(images: Path, force: bool) -> None:
    from icr.index.calibration import CALIBRATION_FILE, CALIBRATION_FORMAT, calibrate_index
    from icr.index.manifest import MANIFEST_FILE, Manifest

    path = images / CALIBRATION_FILE
    if not force and path.is_file():
        try:
            stored = json.loads(path.read_text())
            cached = (stored.get("checkpoint_sha256"), stored.get("format_version"))
        except (ValueError, AttributeError):
            cached = None
        if cached == (Manifest.read(images / MANIFEST_FILE).checkpoint_sha256, CALIBRATION_FORMAT):
            _step(5, f"calibration: cached in {path}")
            return
    _step(5, "calibration: validation captions search the index; fitting score -> relevance on their hits")
    t0 = time.perf_counter()
    result = calibrate_index(images)
    typer.echo(f"      done in {time.perf_counter() - t0:.0f} s ({result['method']} map)")
    evaluation = result.get("evaluation")
    if evaluation:
        from icr.index.cli import format_evaluation

        typer.echo(format_evaluation({**evaluation, "maps": {"per_query": evaluation["maps"]["per_query"]}}))
