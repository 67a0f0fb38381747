"""Training throughput and peak memory per objective (embedded default model, CPU or GPU).

Each objective runs in a fresh process (so peak RSS is its own) for a few warm-up steps and then
``--steps`` timed steps at the configured batch size; step time includes data loading (preloaded
images), both encoders, the loss, backward and the optimizer step. A second figure times the
objective alone (forward + backward on random unit embeddings of the same batch shape), which is
where the objectives differ; a third the two encoders alone (forward + backward, no objective), and
for LTD/ITD a fourth the target decoder alone: what is left of a step beyond them is the optimizer,
clipping and the data.

    python -m bench.train_objectives --data icr-demo/data --steps 20
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path
from typing import Any

from bench.objectives import label
from bench.training import run
from icr.core.memory import peak_rss_mb


def _sync(device: Any) -> None:
    """Wait for the GPU's queued work, so that a wall-clock interval covers it."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _towers_ms(trainer: Any, batches: list[dict[str, Any]]) -> float:
    """Both encoders' forward + backward on the step's batches, without the objective: the part of a
    step that grows with the captions an objective asks for (SmoothAP's image-level batches carry
    5 captions per image where ntxent's carry one)."""
    dev = trainer.device
    on_device = [
        (b["images"].to(dev), {k: v.to(dev) for k, v in b["text"].items()}) for b in batches
    ]  # moved before the clock starts, as _step's copies overlap with compute
    _sync(dev)
    start = time.perf_counter()
    for images, text in on_device:
        trainer.model.zero_grad(set_to_none=True)
        img = trainer.model.encode_image(images)  # (Ni, D)
        cap = trainer.model.encode_text(text)  # (Nc, D)
        (img.sum() + cap.sum()).backward()
    trainer.model.zero_grad(set_to_none=True)
    _sync(dev)
    return (time.perf_counter() - start) / len(batches) * 1e3


def _decoder_ms(trainer: Any, batches: list[dict[str, Any]]) -> float:
    """The target decoder's forward + backward (LTD's MLP, ITD's GRU language model) on unit caption
    embeddings of the step's shape: the part of an LTD/ITD step that ntxent does not have."""
    import torch

    dim, dev = trainer.model.embed_dim, trainer.device
    _sync(dev)
    start = time.perf_counter()
    for b in batches:
        n_cap = len(b["cap_img_ids"])
        cap = torch.nn.functional.normalize(torch.randn(n_cap, dim, device=dev), dim=1)  # (Nc, D)
        target = b["target"]
        target = {k: v.to(dev) for k, v in target.items()} if isinstance(target, dict) else target.to(dev)
        loss, _ = trainer.decoding(cap.requires_grad_(), target)
        loss.backward()
    trainer.decoding.zero_grad(set_to_none=True)
    _sync(dev)
    return (time.perf_counter() - start) / len(batches) * 1e3


def run_one(args: argparse.Namespace, name: str, extra: list[str]) -> dict:
    """Child process: time ``--steps`` training steps after ``--warmup`` untimed ones."""
    import torch

    from icr.training.config import load_config
    from icr.training.losses import build_loss
    from icr.training.train import Trainer

    overrides = [
        f'data.path="{args.data}"',
        f'loss.name="{name}"',
        f"train.batch_size={args.batch}",
        'train.out="/tmp/icr-bench-train"',
        "train.val_every=0",
        *args.set,
        *extra,
    ]
    cfg = load_config(args.config, overrides)
    trainer = Trainer(cfg, progress=False)
    from icr.training.data.training_data import plan_epoch

    plans: list = []
    for epoch in range(args.warmup + args.steps):  # a small benchmark: the steps run into later epochs
        plans += plan_epoch(trainer.train_data, trainer.loss_fn.sampling, trainer.batch_size, 0, epoch)
        if len(plans) >= args.warmup + args.steps:
            break
    else:
        raise ValueError(f"{args.data}: the train split holds no batch of {trainer.batch_size}")
    batches = [trainer._make_batch(plans[k], 0, k) for k in range(args.warmup + args.steps)]
    for b in batches[: args.warmup]:
        trainer._step(b, 1e-4)
    _sync(trainer.device)
    start = time.perf_counter()
    for b in batches[args.warmup :]:
        trainer._step(b, 1e-4)
    _sync(trainer.device)
    step_s = (time.perf_counter() - start) / args.steps
    captions = len(plans[0].cap_idx)
    towers_ms = _towers_ms(trainer, batches[args.warmup :])
    decoder_ms = _decoder_ms(trainer, batches[args.warmup :]) if trainer.decoding is not None else 0.0

    # the objective alone, on random unit embeddings with the same layout, on the trainer's device
    dev = trainer.device
    loss = build_loss(name, **cfg.loss.params()).to(dev)
    n_img = len(plans[0].img_idx)
    dim = trainer.model.embed_dim
    img = torch.nn.functional.normalize(torch.randn(n_img, dim, device=dev), dim=1).requires_grad_()
    cap = torch.nn.functional.normalize(torch.randn(captions, dim, device=dev), dim=1).requires_grad_()
    ids = torch.from_numpy(plans[0].img_idx.astype("int64")).to(dev)
    cap_ids = torch.from_numpy(trainer.train_data.img_of_cap[plans[0].cap_idx].astype("int64")).to(dev)
    for _ in range(3):
        loss(img, cap, ids, cap_ids)["loss"].backward()
    reps = 20
    _sync(dev)
    start = time.perf_counter()
    for _ in range(reps):
        loss(img, cap, ids, cap_ids)["loss"].backward()
    _sync(dev)
    loss_ms = (time.perf_counter() - start) / reps * 1e3
    return {
        "objective": label(name, extra),
        "step_ms": round(step_s * 1e3, 1),
        "samples_per_s": round(captions / step_s, 1),
        "captions_per_step": captions,
        "loss_fwd_bwd_ms": round(loss_ms, 2),
        "towers_fwd_bwd_ms": round(towers_ms, 1),
        "decoder_fwd_bwd_ms": round(decoder_ms, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="icr-demo/data")
    parser.add_argument("--config", default="synthetic-ntxent")
    parser.add_argument("--set", action="append", default=[], help="config override KEY=VALUE (repeatable)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated objective labels")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.child:
        name, extra = json.loads(args.child)
        print(json.dumps(run_one(args, name, extra)))
        return
    only = [x for x in args.only.split(",") if x] or None
    result = run(
        Path(args.data),
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        rounds=1,
        log=print,
        only=only,
        config=args.config,
        overrides=tuple(args.set),
    )
    print(
        "\n| objective | captions/step | step ms | vs ntxent | loss fwd+bwd ms | towers fwd+bwd ms "
        "| decoder fwd+bwd ms | peak RSS MB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        cells = [
            r["objective"],
            r["captions_per_step"],
            r["step_ms_median"],
            round(r["vs_ntxent_median"], 2),
            r["loss_fwd_bwd_ms_median"],
            r["towers_fwd_bwd_ms_median"],
            r["decoder_fwd_bwd_ms_median"],
            r["peak_rss_mb"],
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    out = Path(args.out or f"bench/results/train-objectives-{platform.node()}-{date.today()}.json")
    out.write_text(json.dumps({"machine": platform.node(), **result}, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
