"""`icr data ...`: make the embedded benchmark, inspect and check real datasets.

Heavy modules are imported inside the commands so `icr --help` stays instant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from icr.core.cli_support import fail_cleanly, print_summary

data_app = typer.Typer(
    help="Datasets: the embedded synthetic benchmark and Flickr30k/COCO (Karpathy JSON or precomp) checks.",
    no_args_is_help=True,
)


@data_app.command("synth")
@fail_cleanly
def synth(
    out: Annotated[Path, typer.Option("--out", help="Folder to write (replaced only with --force).")],
    train: Annotated[int, typer.Option(help="Training images.")] = 10000,
    val: Annotated[int, typer.Option(help="Validation images.")] = 1000,
    test: Annotated[int, typer.Option(help="Test images.")] = 1000,
    image_size: Annotated[int, typer.Option(help="Image side in pixels.")] = 64,
    seed: Annotated[int, typer.Option(help="Same seed, same bytes.")] = 0,
    force: Annotated[bool, typer.Option(help="Replace an existing non-empty --out.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    tone_captions: Annotated[
        float,
        typer.Option(
            help="Training data: the probability that a one-object train caption is also given the "
            "background tone (`icr demo` uses 0.1). 0 writes the benchmark."
        ),
    ] = 0.0,
    count_captions: Annotated[
        float,
        typer.Option(
            help="Training data: the probability that a one-object train caption of a scene of 2-3 "
            "objects is replaced by its bare count ('two shapes'). 0 writes the benchmark."
        ),
    ] = 0.0,
) -> None:
    """Generate the embedded synthetic benchmark: Karpathy JSON + PNG folder + scene structures.

    Each image holds 1-3 coloured shapes on a grid; each has 5 captions (full, partial,
    relational...). Ground-truth relevance of any caption for any image comes from the stored scenes.

    Examples:

      icr data synth --out data/synth

      icr data synth --out /tmp/s --train 2000 --val 200 --test 200 --seed 1

      icr data synth --out data/train-scenes --train 50000 --test 0 --tone-captions 0.1
    """
    from icr.training.data.synthetic.generate import write_dataset

    summary = write_dataset(
        out,
        train=train,
        val=val,
        test=test,
        image_size=image_size,
        seed=seed,
        force=force,
        progress=not quiet,
        tone_captions=tone_captions,
        count_captions=count_captions,
    )
    typer.echo(f"wrote {summary['images']} images to {out} in {summary['seconds']:.1f} s")


@data_app.command("features")
@fail_cleanly
def features(
    data: Annotated[
        Path, typer.Option("--data", help="Synthetic dataset folder (written by `icr data synth`).")
    ],
    out: Annotated[Path, typer.Option("--out", help="Precomp folder to write (reused when it matches).")],
    grid: Annotated[int, typer.Option(help="Regions per image: grid x grid cells of the feature map.")] = 4,
    dim: Annotated[int, typer.Option(help="Feature size of each region.")] = 256,
    epochs: Annotated[
        int, typer.Option(help="Pretraining epochs over the train split (~15 s each for 10,000 images).")
    ] = 8,  # features.DEFAULT_EPOCHS (not imported here: `icr --help` stays instant)
    seed: Annotated[int, typer.Option(help="Seed of the backbone's initialisation and batch order.")] = 0,
    threads: Annotated[int, typer.Option(help="Torch threads (0: every core; fewer on a busy machine).")] = 0,
    force: Annotated[
        bool, typer.Option(help="Rebuild even if --out holds matching or other features.")
    ] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> None:
    """Frozen "pretrained backbone" region features of the synthetic benchmark, in the precomp format.

    The papers' regime: a small CNN is pretrained on the train split to name the shape, colour and
    size of the objects in each cell of a grid (and the background tone and object count), not on
    captions; it is then frozen and its grid cells become (N, grid*grid, dim) region features of
    train, val (written as dev) and test, with the captions in {split}_caps.txt. features.json names
    the source dataset (ground truth stays available) and the held-out attribute metrics;
    backbone.safetensors keeps the network (generated distractors are featurised with it). Re-running
    with the same settings on the same dataset prints "cached" and returns.

    Examples:

      icr data features --data icr-demo/data --out icr-demo/features

      icr data features --data data/synth --out data/synth-feats --grid 3 --dim 128 --epochs 4

      icr train --config synthetic-ntxent --set data.path=icr-demo/features --set data.val_split=dev
      --set 'model.image={kind="precomp", feature_dim=256, pooling="mean"}'
    """
    from icr.training.data.synthetic.features import build_features

    result = build_features(
        data,
        out,
        grid=grid,
        dim=dim,
        epochs=epochs,
        seed=seed,
        threads=threads,
        force=force,
        progress=not quiet,
    )
    manifest = result["manifest"]
    held_out = manifest["pretraining"]["held_out"]
    chance = held_out["chance"]
    if result["cached"]:
        typer.echo(
            f"cached: {out} (built with grid {manifest['grid']}, dim {manifest['dim']}, seed "
            f"{manifest['seed']}, {manifest['epochs']} epochs from {manifest['source']['path']})"
        )
        return
    typer.echo(
        f"pretrained the backbone on {manifest['counts']['train']:,} train images in "
        f"{manifest['pretraining']['seconds']:.1f} s ({manifest['epochs']} epochs)"
    )
    typer.echo(
        "held-out (val) attributes: cell mAP {m:.3f} (chance {c:.3f}); accuracy shape {s:.3f}, colour "
        "{co:.3f}, size {si:.3f}, count {n:.3f}, tone {t:.3f}".format(
            m=held_out["cell_map"],
            c=chance["cell_map"],
            s=held_out["shape_accuracy"],
            co=held_out["colour_accuracy"],
            si=held_out["size_accuracy"],
            n=held_out["count_accuracy"],
            t=held_out["tone_accuracy"],
        )
    )
    shapes = ", ".join(f"{name} {count:,}" for name, count in manifest["counts"].items())
    typer.echo(
        f"wrote {manifest['regions']} x {manifest['dim']} region features ({shapes} images) to {out} "
        f"in {manifest['seconds']:.1f} s"
    )


@data_app.command("stats")
@fail_cleanly
def stats(
    path: Annotated[
        Path, typer.Argument(help="Dataset folder (dataset_*.json, or a precomp folder) or JSON file.")
    ],
    images: Annotated[Path | None, typer.Option(help="Image folder, if not beside the JSON.")] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the statistics as JSON here.")
    ] = None,
) -> None:
    """Print per-split statistics; on the synthetic benchmark also ground-truth relevance figures.

    Examples:

      icr data stats data/synth

      icr data stats ~/data/coco --images ~/data/coco/images --json coco-stats.json

      icr data stats ~/data/f30k_precomp
    """
    result = dataset_statistics(path, images)
    print_summary(result)
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2))
        typer.echo(f"wrote {json_out}")


@data_app.command("check")
@fail_cleanly
def check(
    path: Annotated[
        Path, typer.Argument(help="Dataset folder or JSON file (Karpathy), or a precomp folder.")
    ],
    images: Annotated[Path | None, typer.Option(help="Image folder, if not beside the JSON.")] = None,
    split: Annotated[list[str] | None, typer.Option(help="Only these splits (repeatable).")] = None,
) -> None:
    """Load a dataset and decode every image: reports each file that fails, by name.

    Examples:

      icr data check ~/data/flickr30k --images ~/data/flickr30k/flickr30k-images

      icr data check ~/data/coco --split test
    """
    from icr.training.data.karpathy import load_karpathy, verify_images
    from icr.training.data.precomp import available_precomp_splits, is_precomp, load_precomp

    if is_precomp(path):
        for name in split or available_precomp_splits(path):
            s = load_precomp(path, name)
            typer.echo(
                f"{name}: {s.num_images} feature rows {tuple(s.images.shape[1:])}, {len(s)} captions: ok"
            )
        return
    dataset = load_karpathy(path, images)
    for name in split or list(dataset.splits):
        n = verify_images(dataset.split(name), progress=True)
        typer.echo(f"{name}: {n} images decoded, {dataset.split(name).num_captions} captions: ok")


def dataset_statistics(path: Path, images: Path | None = None) -> dict[str, Any]:
    """Statistics of a Karpathy or precomp dataset, plus ground truth for synthetic ones."""
    from icr.training.data.karpathy import load_karpathy
    from icr.training.data.precomp import available_precomp_splits, is_precomp, load_precomp
    from icr.training.data.stats import describe_karpathy, describe_precomp

    if is_precomp(path):
        return describe_precomp({s: load_precomp(path, s) for s in available_precomp_splits(path)})
    dataset = load_karpathy(path, images)
    result = describe_karpathy(dataset)
    scenes_file = dataset.json_path.parent / "scenes.json"
    if scenes_file.is_file():
        from icr.training.data.synthetic.generate import load_scenes
        from icr.training.data.synthetic.stats import relevance_stats

        scenes = load_scenes(dataset.json_path.parent)
        result["generator"] = scenes.generator
        result["ground_truth"] = {
            name: relevance_stats(
                dataset.split(name), scenes.for_imgids([r.imgid for r in dataset.split(name).images])
            )
            for name in ("val", "test")
            if name in dataset.splits
        }
    return result
