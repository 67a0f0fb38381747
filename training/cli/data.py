"""`icr data ...`: make the embedded benchmark, inspect and check real datasets.

Heavy modules are imported inside the commands so `icr --help` stays instant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from icr.training.cli.support import fail_cleanly, print_summary
from icr.training.data.training_data import is_precomp

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
) -> None:
    """Generate the embedded synthetic benchmark: Karpathy JSON + PNG folder + scene structures.

    Each image holds 1-3 coloured shapes on a grid; each has 5 captions (full, partial,
    relational...). Ground-truth relevance of any caption for any image comes from the stored scenes.

    Examples:

      icr data synth --out data/synth

      icr data synth --out /tmp/s --train 2000 --val 200 --test 200 --seed 1
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
    )
    typer.echo(f"wrote {summary['images']} images to {out} in {summary['seconds']:.1f} s")


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
    from icr.training.data.precomp import available_precomp_splits, load_precomp

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


def dataset_statistics(path: Path, images: Path | None = None) -> dict:
    """Statistics of a Karpathy or precomp dataset, plus ground truth for synthetic ones."""
    from icr.training.data.karpathy import load_karpathy
    from icr.training.data.precomp import available_precomp_splits, load_precomp
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
