"""`icr model ...`: checkpoints that need no training (`icr model import`: a stock CLIP or SigLIP).

Heavy modules (torch, transformers) are imported inside the commands so `icr --help` stays instant.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from icr.core.cli_support import fail_cleanly, print_summary

model_app = typer.Typer(
    help="Checkpoints without training: import a stock CLIP or SigLIP model.",
    no_args_is_help=True,
)


@model_app.command("import")
@fail_cleanly
def import_command(
    folder: Annotated[
        Path,
        typer.Argument(
            metavar="FOLDER",
            help="A local CLIPModel or SiglipModel folder: config.json, weights, tokenizer and "
            "preprocessor_config.json (save_pretrained of the model and of its processor).",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Checkpoint folder to write.")],
    force: Annotated[
        bool, typer.Option(help="Replace a checkpoint already at --out (any other folder never).")
    ] = False,
    quiet: Annotated[bool, typer.Option(help="No progress lines, only the summary.")] = False,
) -> None:
    """Turn a stock CLIP or SigLIP folder into an icr checkpoint, with no training.

    The checkpoint is the model `icr train` would build from the folder with both towers frozen:
    the pretrained towers and projection heads, the folder's tokenizer and image preprocessing.
    Its embeddings are the stock model's get_text_features / get_image_features, L2-normalised,
    and it loads without the folder. config.json records the folder, its model_type and the sha256
    of its weights (imported_from).

    Nothing is downloaded: save the model and its processor once, on a machine with network:

      python -c "from transformers import CLIPModel, CLIPProcessor; n = 'openai/clip-vit-base-patch32';
      CLIPModel.from_pretrained(n).save_pretrained('models/clip-b32');
      CLIPProcessor.from_pretrained(n).save_pretrained('models/clip-b32')"

    Examples:

      icr model import models/clip-b32 --out models/clip-b32-icr

      icr model import models/siglip-base-patch16-224 --out models/siglip-icr --force

      icr index build -m models/clip-b32-icr --images ~/photos --out indices/photos

      icr serve --index indices/photos

    In Python: icr.load("models/clip-b32-icr").encode_text(["a dog on a beach"]).
    """
    from icr.training.pretrained_import import import_stock_model

    started = time.perf_counter()
    meta = import_stock_model(
        folder, out, replace=force, log=(lambda _m: None) if quiet else lambda m: typer.echo(m, err=True)
    )
    image = meta.preprocessing
    resize = "both sides" if image.get("resize_mode") == "square" else "shorter side"
    print_summary(
        {
            "checkpoint": str(out),
            "model_type": meta.model["image"]["hf_config"]["model_type"],
            "embed_dim": meta.embed_dim,
            "images": f"{resize} to {image['resize']}, {image['image_size']} x {image['image_size']} "
            f"({image['resample']})",
            "captions": f"at most {meta.model['text']['max_len']} tokens",
            "weights_sha256": meta.weights_sha256,
            "seconds": round(time.perf_counter() - started, 1),
        }
    )
