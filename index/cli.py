"""`icr index ...`: build self-describing FAISS index directories.

Heavy modules (torch, faiss) are imported inside the commands so `icr --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from icr.core.cli_support import fail_cleanly, print_summary
from icr.core.devices import Device

index_app = typer.Typer(
    help="FAISS indices over a checkpoint's embeddings: gallery images (+ distractors) or captions.",
    no_args_is_help=True,
)


@index_app.command("build")
@fail_cleanly
def build(
    checkpoint: Annotated[
        Path, typer.Option("--checkpoint", "-m", help="Checkpoint folder (e.g. runs/x/best).")
    ],
    out: Annotated[
        Path, typer.Option("--out", help="Index folder to write (an existing index there is replaced).")
    ],
    data: Annotated[
        Path | None,
        typer.Option(
            "--data", "-d", help="Dataset: Karpathy JSON/folder, precomp folder, or icr data synth output."
        ),
    ] = None,
    images: Annotated[
        Path | None, typer.Option(help="Your photos as the gallery: a folder of images (recursive).")
    ] = None,
    metadata: Annotated[
        Path | None,
        typer.Option(help="With --images: .jsonl/.csv/.parquet of fields per image, keyed by relative path."),
    ] = None,
    embeddings: Annotated[
        Path | None, typer.Option(help="The gallery from an `icr embed` folder written by this checkpoint.")
    ] = None,
    skip_bad: Annotated[
        bool, typer.Option(help="With --images: leave out files that do not decode (listed in the manifest).")
    ] = False,
    workers: Annotated[
        int | None, typer.Option(help="With --images: threads decoding images (default: cores, at most 8).")
    ] = None,
    split: Annotated[str, typer.Option(help="Split whose images (or captions) form the gallery.")] = "test",
    distractors: Annotated[
        int, typer.Option(help="Embedded benchmark: add N images from its distractor generator.")
    ] = 0,
    distractor_embeddings: Annotated[
        Path | None,
        typer.Option(
            help="(N, D) float32 .npy of L2-normalised distractor embeddings (memory-mapped), or an "
            "embeddings folder (icr embed / clip-retrieval layout)."
        ),
    ] = None,
    distractor_images: Annotated[
        Path | None, typer.Option(help="A folder of distractor image files (recursive).")
    ] = None,
    factory: Annotated[
        str,
        typer.Option(
            help="auto (Flat below 100k vectors; else IVF measured at the service's depth against an "
            "HNSW coarse quantizer and an HNSW graph, the fastest meeting the recall targets kept), Flat, "
            "HNSW32, IVF<k>,Flat, IVF<k>_HNSW32,Flat, IVF<k>,PQ<m>, IVF<k>,PQ<m>x4fs,RFlat (4-bit "
            "fast-scan codes re-ranked exactly from the raw vectors kept beside them, vectors.f32: the "
            "fastest at the service's depth on 1M demo embeddings; m = dim/2 is a good start), "
            "IVF<k>,PQ<m>,RFlat (8-bit codes re-ranked the same way; with --on-disk, auto's choice "
            "when raw vectors exceed the budget), or "
            "Graph<M> (hnswlib's HNSW graph in cluster order, e.g. Graph16: the fastest at a short "
            "search depth (ICR_SEARCH_DEPTH, e.g. 100); needs the [graph] extra)."
        ),
    ] = "auto",
    gpu: Annotated[
        Literal["auto", "on", "off"],
        typer.Option(help="FAISS on the GPU: auto (when one is visible), on (required) or off."),
    ] = "auto",
    modality: Annotated[
        Literal["image", "text"],
        typer.Option(help="image: index images for text->image search; text: captions for image->text."),
    ] = "image",
    memory_budget_mb: Annotated[
        int,
        typer.Option(
            help="auto: raw vectors up to this size, PQ codes above. With --on-disk: the build's peak "
            "memory (codes and ids in half of it, training sample and shards in the other half)."
        ),
    ] = 2048,
    on_disk: Annotated[
        bool,
        typer.Option(
            help="Larger than memory: train IVF on a sample, add shards, merge the inverted lists into "
            "index.ivfdata on disk; served memory-mapped."
        ),
    ] = False,
    batch_size: Annotated[int, typer.Option(help="Images per embedding batch.")] = 256,
    device: Annotated[
        Device, typer.Option(help="Where the model embeds: auto (CUDA if present), cpu, cuda.")
    ] = "auto",
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> None:
    """Embed a split's images (plus distractors) or captions and write an index directory.

    The folder holds index.faiss (CPU form), manifest.json (checkpoint sha256, dim, factory and
    why, counts, recall@10 of the index against exact search, build time and memory) and
    metadata.sqlite (source, captions, distractor flag, scene per id). It is built beside --out
    and renamed into place when complete, so an interrupted build keeps the previous index.

    Examples:

      icr index build --checkpoint icr-demo/model/best --data icr-demo/data --out indices/test

      icr index build -m icr-demo/model/best -d icr-demo/data --distractors 1000000 --out indices/1m

      icr index build -m runs/f30k/best -d ~/data/f30k --distractor-embeddings extra.npy --out idx

      icr index build -m runs/coco/best -d ~/data/coco --distractor-images ~/data/openimages --out idx

      icr index build -m runs/f30k/best -d ~/data/f30k --factory IVF1024,Flat --gpu off --out idx

      icr index build -m icr-demo/model/best -d icr-demo/data --modality text --out indices/captions

      icr index build -m runs/clip/best --images ~/photos --metadata ~/photos/meta.csv --out idx

      icr index build -m runs/clip/best --embeddings emb/photos --out idx

      icr index build -m runs/clip/best --embeddings emb/laion --on-disk --memory-budget-mb 4096 --out idx
    """
    from icr.index.build import build_caption_index, build_image_index, build_photo_index

    common: dict[str, Any] = {  # the options both builders take
        "split": split,
        "factory": factory,
        "gpu": gpu,
        "out": out,
        "batch_size": batch_size,
        "progress": not quiet,
        "memory_budget_bytes": memory_budget_mb << 20,
        "on_disk": on_disk,
        "device": device,
    }
    own = images is not None or embeddings is not None
    if own and (data is not None or modality != "image" or distractors):
        raise ValueError(
            "--images / --embeddings build an image index of your own gallery: leave out --data, "
            "--modality text and --distractors (use --distractor-embeddings or --distractor-images)"
        )
    if own:
        manifest = build_photo_index(
            checkpoint,
            images=images,
            metadata=metadata,
            embeddings=embeddings,
            skip_bad=skip_bad,
            workers=workers,
            distractor_embeddings=distractor_embeddings,
            distractor_images=distractor_images,
            **{k: v for k, v in common.items() if k != "split"},
        )
    elif data is None:
        raise ValueError("give the gallery: --data D (a dataset split), --images DIR or --embeddings DIR")
    elif metadata is not None or skip_bad:
        raise ValueError("--metadata and --skip-bad go with --images DIR")
    elif modality == "image":
        manifest = build_image_index(
            checkpoint,
            data,
            distractors=distractors,
            distractor_embeddings=distractor_embeddings,
            distractor_images=distractor_images,
            **common,
        )
    elif modality == "text":
        if distractors or distractor_embeddings is not None or distractor_images is not None:
            raise ValueError("distractors are images: they go into an image index (--modality image)")
        manifest = build_caption_index(checkpoint, data, **common)
    else:  # the option's choices allow nothing else
        raise AssertionError(modality)
    typer.echo(f"wrote {out}")
    print_summary(manifest.to_dict())
    skipped = manifest.data.get("skipped") or []
    if skipped:
        typer.echo(f"left out {len(skipped)} file(s) that did not decode (listed in the manifest), e.g.:")
        for item in skipped[:5]:
            typer.echo(f"  {item['error']}")
    unmatched = manifest.data.get("metadata_unmatched") or 0
    if unmatched:
        names = ", ".join(manifest.data.get("metadata_unmatched_files") or [])
        typer.echo(
            f"{unmatched} metadata row(s) name no image in the folder (a typo or a missing file): {names}"
        )


@fail_cleanly
def embed_command(
    checkpoint: Annotated[
        Path, typer.Option("--checkpoint", "-m", help="Checkpoint folder (e.g. runs/x/best).")
    ],
    out: Annotated[Path, typer.Option("--out", help="Embeddings folder to write (or to continue).")],
    images: Annotated[Path | None, typer.Option(help="A folder of your images (recursive).")] = None,
    metadata: Annotated[
        Path | None,
        typer.Option(help="With --images: .jsonl/.csv/.parquet of fields per image, keyed by relative path."),
    ] = None,
    data: Annotated[
        Path | None, typer.Option("--data", "-d", help="Or a dataset (Karpathy, precomp, synth).")
    ] = None,
    split: Annotated[str, typer.Option(help="With --data: the split to embed.")] = "test",
    webdataset: Annotated[
        str | None,
        typer.Option(
            help="Or webdataset shards: a folder of .tar files, a glob or one .tar; {key}.jpg|png|webp "
            "+ optional {key}.txt (caption) and {key}.json (fields); the key is the image_path."
        ),
    ] = None,
    image_list: Annotated[
        Path | None,
        typer.Option(
            help="Or a .parquet listing image paths (column file, path, image_path or filename; relative "
            "to its folder or absolute) in its row order; other columns are fields, caption(s) captions."
        ),
    ] = None,
    shard_size: Annotated[int, typer.Option(help="Images per shard file.")] = 100_000,
    batch_size: Annotated[int, typer.Option(help="Images per embedding batch.")] = 256,
    skip_bad: Annotated[
        bool, typer.Option(help="Leave out files that do not decode (listed in the manifest).")
    ] = False,
    workers: Annotated[
        int | None, typer.Option(help="Threads decoding images (default: cores, at most 8).")
    ] = None,
    device: Annotated[
        Device, typer.Option(help="Where the model embeds: auto (CUDA if present), cpu, cuda.")
    ] = "auto",
    engine: Annotated[
        Literal["local", "ray"],
        typer.Option(help="local: this process; ray: Ray Data workers (pip install 'icr[distributed]')."),
    ] = "local",
    address: Annotated[
        str | None,
        typer.Option(
            help="With --engine ray: the cluster to join (auto, or ray://HOST:PORT); default: start a "
            "local Ray instance on this machine."
        ),
    ] = None,
    actors: Annotated[
        int | None,
        typer.Option(help="With --engine ray: embedding actors (default: one per GPU, else half the CPUs)."),
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Embed images into clip-retrieval's layout: img_emb/img_emb_{i}.npy, text_emb/text_emb_{i}.npy
    (each image's first caption, when every image has one), metadata/metadata_{i}.parquet (image_path,
    caption, captions, your fields) and embeddings_manifest.json (checkpoint sha256, shards done).

    Shards are written atomically and recorded as they finish: after a crash or Ctrl-C, run the same
    command again and it continues (with either engine). `icr index build --embeddings OUT` indexes
    the result.

    --engine ray decodes on Ray tasks and embeds on an actor pool (one GPU per actor when the cluster
    has GPUs), writing the same shards; images and checkpoint must be on a filesystem every node sees.

    Examples:

      icr embed -m runs/clip/best --images ~/photos --metadata ~/photos/meta.jsonl --out emb/photos

      icr embed -m icr-demo/model/best --data icr-demo/data --split test --out emb/test

      icr embed -m runs/clip/best --webdataset 'shards/*.tar' --engine ray --out emb/laion

      icr embed -m runs/clip/best --image-list list.parquet --engine ray --address auto --out emb/list
    """
    from icr.index.embed import embed_to_folder

    manifest = embed_to_folder(
        checkpoint,
        out,
        images=images,
        metadata=metadata,
        data=data,
        split=split,
        webdataset=webdataset,
        image_list=image_list,
        shard_size=shard_size,
        batch_size=batch_size,
        device=device,
        skip_bad=skip_bad,
        workers=workers,
        progress=not quiet,
        engine=engine,
        address=address,
        actors=actors,
    )
    typer.echo(f"wrote {out}")
    print_summary(
        {
            k: manifest[k]
            for k in ("checkpoint_sha256", "dim", "rows", "num_shards", "text", "fields", "engine", "seconds")
        }
    )
    if manifest["skipped"]:
        typer.echo(
            f"left out {len(manifest['skipped'])} file(s) that did not decode (listed in the manifest)"
        )


@index_app.command("calibrate")
@fail_cleanly
def calibrate(
    index_dir: Annotated[Path, typer.Argument(help="Index folder written by `icr index build`.")],
    split: Annotated[str, typer.Option(help="Split to fit on: auto (val, precomp dev) or a name.")] = "auto",
    eval_split: Annotated[str, typer.Option(help="Second split to report ECE on ('none' to skip).")] = "test",
    method: Annotated[str, typer.Option(help="The global map's form: isotonic or platt.")] = "isotonic",
    depth: Annotated[
        int, typer.Option(help="How deep held-out captions search, as the service does (ICR_SEARCH_DEPTH).")
    ] = 1000,
    checkpoint: Annotated[
        Path | None, typer.Option("--checkpoint", "-m", help="Default: the one in the manifest.")
    ] = None,
    data: Annotated[
        Path | None, typer.Option("--data", "-d", help="Default: the one in the manifest.")
    ] = None,
    device: Annotated[
        Device, typer.Option(help="Where the model embeds: auto (CUDA if present), cpu, cuda.")
    ] = "auto",
    generated_queries: Annotated[
        int,
        typer.Option(
            help="Embedded benchmark: generated queries (unseen scenes, bare counts, impossible ones) "
            "added to the fit, and as many others judged beside the evaluation (0: none)."
        ),
    ] = 2000,
    labels: Annotated[
        Path | None,
        typer.Option(
            help="Your labels (jsonl, csv or parquet: query, image, relevant): fit the map on them "
            "instead, each value a Clopper-Pearson lower bound (see below)."
        ),
    ] = None,
    confidence: Annotated[
        float, typer.Option(help="--labels: confidence of each lower bound.", min=0.5, max=0.999)
    ] = 0.95,
    relevant_from: Annotated[
        float, typer.Option(help="--labels: graded labels count as relevant from this grade up.")
    ] = 1.0,
    min_block: Annotated[int, typer.Option(help="--labels: labels per score block at least.", min=1)] = 10,
    from_feedback: Annotated[
        Path | None,
        typer.Option(
            help="Fit on the labels given on the search page: the service's feedback.sqlite "
            "(in its state directory), the labels of this index only."
        ),
    ] = None,
    transfer_from: Annotated[
        Path | None,
        typer.Option(
            help="Copy the calibration of another index of the same checkpoint (or its calibration.json), "
            "marked as transferred in every answer: a prior for a collection with no labels yet."
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> None:
    """Fit score -> probability of relevance where thresholds act; writes calibration.json.

    On the embedded benchmark, validation captions search this index to --depth and every hit is
    labelled with the generator's ground truth; the fitted per-query map (score + what the query's
    own results and embedding show) is what the service applies, a global map is kept beside it.
    Test captions are then searched the same way and judged on the distractors: the table shows the
    precision that min_relevance 0.5 / 0.8 delivers, pooled and per query kind, what each query's top
    20 promise against what they deliver, and whether out-of-domain queries (nonsense, other
    domains, a kind left out of the fit) are promised anything. A query unlike every fitted one is
    given no relevance by the service (the file keeps the fitted queries' evidence). On Flickr30k/COCO
    the maps are fitted on the validation split's annotated pairs (relevance is then
    underestimated, and the file says so).

    With --labels (your own collection): each labelled query searches the index to --depth as the
    service does; the labelled hits, sorted by score, are cut into blocks of at least --min-block
    labels, and each block's relevance is the one-sided Clopper-Pearson lower bound of its fraction
    relevant (never more than its labels can back). The table shows, per min_relevance, where the
    threshold falls, what the labels above it show, how many more labels would bring its bound to
    +-0.05, and what the map delivers on labels whose query and image it was not fitted on.

    Examples:

      icr index calibrate indices/test

      icr index calibrate indices/test --depth 500 --eval-split none

      icr index calibrate indices/my-photos --labels my-labels.jsonl

      icr index calibrate indices/my-photos --transfer-from indices/val
    """
    from icr.index.calibration import CALIBRATION_FILE, calibrate_index

    if sum(x is not None for x in (labels, from_feedback, transfer_from)) > 1:
        raise ValueError("--labels, --from-feedback and --transfer-from each make the calibration: pick one")
    if transfer_from is not None:
        from icr.index.calibration_transfer import transfer_calibration

        out = transfer_calibration(index_dir, transfer_from)
        typer.echo(out["labels_note"])
        typer.echo(f"wrote {index_dir / CALIBRATION_FILE}")
        return
    feedback = None
    if from_feedback is not None:
        from icr.index.feedback_labels import FeedbackStore, index_key
        from icr.index.manifest import Manifest

        if not from_feedback.is_file():
            raise FileNotFoundError(
                f"{from_feedback}: no feedback file (the service writes it on the first label)"
            )
        manifest = Manifest.read(index_dir)
        feedback = FeedbackStore(from_feedback).labels(
            index_key(manifest.checkpoint_sha256, manifest.created)
        )
    if labels is not None or feedback is not None:
        from icr.index.label_calibration import calibrate_from_labels

        out = calibrate_from_labels(
            index_dir,
            labels if labels is not None else feedback or [],
            checkpoint=checkpoint,
            depth=depth,
            confidence=confidence,
            min_block=min_block,
            relevant_from=relevant_from,
            device=device,
            progress=not quiet,
        )
        typer.echo(format_label_report(out["label_report"]))
        typer.echo(f"wrote {index_dir / CALIBRATION_FILE}")
        return
    result = calibrate_index(
        index_dir,
        checkpoint=checkpoint,
        data=data,
        split=split,
        eval_split=None if eval_split.lower() == "none" else eval_split,
        method=method,
        depth=depth,
        device=device,
        progress=not quiet,
        generated=generated_queries,
    )
    print_summary({k: result.get(k) for k in ("method", "labels", "labels_note", "score_for_relevance")})
    if "evaluation" in result:
        typer.echo(format_evaluation(result["evaluation"]))
    typer.echo(f"wrote {index_dir / CALIBRATION_FILE}")


_STATE_HELP = (
    "The server's state directory (ICR_STATE_DIR), where its write log is: default "
    "$XDG_STATE_HOME/icr or ~/.local/state/icr, as the server's."
)


@index_app.command("add")
@fail_cleanly
def add(
    index_dir: Annotated[Path, typer.Argument(help="Index folder written by `icr index build`.")],
    embeddings: Annotated[
        Path, typer.Option(help="An `icr embed` folder written by the index's checkpoint.")
    ],
    state_dir: Annotated[Path | None, typer.Option(help=_STATE_HELP)] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Add images to a built index without rebuilding it: into the write log a server on the same
    state directory applies (within ICR_WRITES_POLL_SECONDS; one started later replays it).

    Each image is named by its path in the embeddings folder, so adding the same folder again
    replaces those images rather than adding them twice. Metadata columns must be the index's own
    fields, with values of the kinds they hold.

    Examples:

      icr embed -m runs/my-clip/best --images new-photos --metadata new-photos/meta.csv --out new-emb

      icr index add my-index --embeddings new-emb
    """
    from icr.core.state_dir import default_state_dir
    from icr.index.live_bulk import add_embeddings

    done = add_embeddings(index_dir, embeddings, state_dir or default_state_dir(), progress=progress)
    print_summary(done)


@index_app.command("remove")
@fail_cleanly
def remove(
    index_dir: Annotated[Path, typer.Argument(help="Index folder written by `icr index build`.")],
    ids: Annotated[list[int] | None, typer.Option("--id", help="An image id (repeatable).")] = None,
    external_ids: Annotated[
        list[str] | None,
        typer.Option("--external-id", help="An image's external id, e.g. its path as added (repeatable)."),
    ] = None,
    filter_json: Annotated[
        str | None,
        typer.Option("--filter", help='Delete every live image a filter selects, e.g. \'{"album": "old"}\'.'),
    ] = None,
    state_dir: Annotated[Path | None, typer.Option(help=_STATE_HELP)] = None,
) -> None:
    """Delete images from a built index without rebuilding it (through the same write log as
    `icr index add`), in one transaction.

    Examples:

      icr index remove my-index --id 17 --id 18

      icr index remove my-index --filter '{"year": {"lt": 2015}}'
    """
    import json

    from icr.core.state_dir import default_state_dir
    from icr.index.live_bulk import remove_images

    if not ids and not external_ids and filter_json is None:
        raise ValueError("name what to remove: --id, --external-id or --filter")
    try:
        spec = json.loads(filter_json) if filter_json is not None else None
    except json.JSONDecodeError as err:
        raise ValueError(f'--filter: not JSON ({err}); e.g. --filter \'{{"album": "old"}}\'') from None
    done = remove_images(index_dir, state_dir or default_state_dir(), ids or [], external_ids or [], spec)
    print_summary({**done, "deleted": len(done["deleted"])})


@index_app.command("compact")
@fail_cleanly
def compact_command(
    index_dir: Annotated[Path, typer.Argument(help="Index folder written by `icr index build`.")],
    state_dir: Annotated[Path | None, typer.Option(help=_STATE_HELP)] = None,
    progress: Annotated[bool, typer.Option(help="Say what it does.")] = True,
) -> None:
    """Rewrite an index folder with its write log folded in: deleted vectors gone, added images in,
    ids unchanged, the inverted file trained again when its lists have drifted. The new folder
    replaces the old one whole (a server serving it switches to it by itself, ICR_WATCH_SECONDS);
    later writes go on into the same log. A running server does the same on POST /v1/admin/compact.

    Examples:

      icr index compact my-index

      icr index compact my-index --state-dir /var/lib/icr
    """
    from icr.core.state_dir import default_state_dir
    from icr.index.live_bulk import compact_folder

    print_summary(compact_folder(index_dir, state_dir or default_state_dir(), progress=progress))


@index_app.command("shard")
@fail_cleanly
def shard_command(
    index_dir: Annotated[
        Path, typer.Argument(help="Index folder written by `icr index build` (or compacted).")
    ],
    shards: Annotated[int, typer.Option(help="How many shards: contiguous, near-equal id ranges.")],
    out: Annotated[Path, typer.Option(help="Folder to write shard-<s>-of-<S> folders into.")],
    progress: Annotated[bool, typer.Option(help="Say what it does.")] = True,
) -> None:
    """Cut an index folder into shard folders that each hold one range of its ids, under the same
    global ids (inverted files keep their centroids and codes; nothing is encoded again). Merging the
    shards' top-k by score gives the whole index's top-k. Each shard is an index folder `icr serve`
    loads (read-only for now: ICR_WRITES=false). Writes made after the folder's build or compaction
    are not included: compact first (`icr index compact`).

    Examples:

      icr index shard my-index --shards 4 --out my-index-shards
    """
    from icr.index.shard import shard_index

    for done in shard_index(index_dir, out, shards, say=typer.echo if progress else lambda _m: None):
        lo, hi = done["ids"]
        typer.echo(f"shard {done['shard']}: ids {lo:,}-{hi - 1:,}, {done['vectors']:,} vectors")


def format_label_report(report: dict[str, Any]) -> str:
    """What the labels support at each min_relevance, and what the map delivers out of fold."""
    lines = [
        f"{report['used']:,} of {report['labels']:,} labels used ({report['beyond_depth']:,} beyond the "
        f"search depth), {report['relevant']:,} relevant, {report['queries']:,} queries, "
        f"{report['images']:,} images; bounds at {report['confidence']:.0%} confidence",
        f"  {'min_relevance':<14} {'score':>8} {'labels above':>13} {'precision':>10} "
        f"{'more labels for +-0.05':>23} {'out of fold: passed':>20} {'delivered':>10}",
    ]
    oof = report["out_of_fold"]["targets"]
    for target, t in report["thresholds"].items():
        o = oof[target]
        delivered = "-" if o["delivered"] is None else f"{o['delivered']:.3f}"
        if not t["reached"]:
            lines.append(
                f"  {target:<14} {'not reached: the best bound is ' + format(t['best_bound'], '.3f'):>56} "
                f"{o['passed']:>20,} {delivered:>10}"
            )
            continue
        lines.append(
            f"  {target:<14} {t['score']:>8.4f} {t['labels_above']:>13,} {t['precision_above']:>10.3f} "
            f"{t['more_labels']:>23,} {o['passed']:>20,} {delivered:>10}"
        )
    return "\n".join(lines)


def format_evaluation(evaluation: dict[str, Any]) -> str:
    """What min_relevance delivers on held-out captions, per map and query kind."""
    lines = [
        f"held-out {evaluation['split']} captions ({evaluation['queries']:,}), top {evaluation['depth']}, "
        f"judged on {evaluation['judged']}:"
    ]
    for name, report in evaluation["maps"].items():
        lines.append(
            f"  {name:<10} {'queries':<16} {'n':>5} {'P@10':>6} {'prec@0.5':>9} {'pass':>9} "
            f"{'recall':>7} {'prec@0.8':>9} {'pass':>8}"
        )
        for kind, g in [("pooled", report["pooled"]), *sorted(report["by_kind"].items())]:
            t5, t8 = g["thresholds"]["0.5"], g["thresholds"]["0.8"]

            def f(v: float | None, d: int = 3) -> str:
                return "-" if v is None else f"{v:.{d}f}"

            lines.append(
                f"  {'':<10} {kind:<16} {g['queries']:>5} {f(g['p_at_10']):>6} {f(t5['precision']):>9} "
                f"{t5['passing']:>9,} {f(t5['recall']):>7} {f(t8['precision']):>9} {t8['passing']:>8,}"
            )
    from icr.training.evaluation.metrics.query_honesty import format_out_of_domain, format_query_honesty

    if "queries" in evaluation["maps"].get("per_query", {}):
        lines.append(format_query_honesty(evaluation["maps"]["per_query"]["queries"]))
    if "generated" in evaluation:
        gen = evaluation["generated"]
        lines.append(
            f"  generated queries ({gen['queries']:,}, {gen['no_answer']:,} with no answer), by style:"
        )
        lines.append(format_query_honesty(gen["honesty"]))
    if "out_of_domain" in evaluation:
        lines.append(format_out_of_domain(evaluation["out_of_domain"]))
    return "\n".join(lines)
