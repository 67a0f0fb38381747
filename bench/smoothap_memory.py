"""Peak memory of SmoothAP forward + backward: the seed's full difference tensors vs ours.

    python -m bench.smoothap_memory [--batch 128] [--captions 5] [--dim 1024]

The ECIR SmoothAP run uses B = 128 images x 5 captions, D = 1024. The seed code builds the (Q, m, m)
difference tensor of every candidate pair per query (128 x 640 x 640 for i2t) and autograd keeps
several of them; :mod:`icr.training.losses.smoothap` builds (Q, Pmax, m) for the positives only.

Each variant runs in a fresh subprocess, because peak RSS (``VmHWM``, :func:`training.memory.peak_rss_mb`)
is a peak over the process's lifetime:
baseline = peak RSS after the inputs exist and one similarity matmul + backward has warmed up the
allocator and thread pools; reported figure = peak RSS after forward + backward minus that baseline.
Writes bench/results/smoothap-memory.json and prints both figures (not a test).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from icr.core.memory import peak_rss_mb

VARIANTS = {
    "naive": "seed-style: full (Q, m, m) difference tensors, clamped sigmoid",
    "ours": "icr.training.losses.smoothap: positives-only (Q, Pmax, m) differences",
}


def _seed_direction(scores: Tensor, gt: Tensor, tau: float) -> Tensor:
    """The seed's batched Smooth-AP of one direction. ``scores``, ``gt``: (Q, 1, m)."""
    m = scores.shape[2]
    rows = scores.repeat(1, m, 1)  # (Q, m, m): rows[q, i, j] = s_j
    diff = rows - rows.transpose(2, 1)  # (Q, m, m): s_j - s_i
    step = 1.0 / (1.0 + torch.exp(torch.clamp(-diff / tau, min=-50, max=50)))  # (Q, m, m)
    step = step * (1 - torch.eye(m))
    rank = 1 + step.sum(dim=2)  # (Q, m)
    rank_pos = (1 + (step * gt).sum(dim=2)) * gt.squeeze(1)  # (Q, m), 0 off the positives
    ap = (rank_pos / rank).sum(dim=1) / gt.sum(dim=2).squeeze(1)  # (Q,)
    return (1 - ap).mean()


def naive_smoothap(img: Tensor, cap: Tensor, captions_per_image: int, tau: float) -> Tensor:
    """Seed layout: captions of image i at columns k*i .. k*i + k - 1; 0.5 (i2t + t2i)."""
    scores = (img @ cap.T).unsqueeze(1)  # (B, 1, kB)
    gt = torch.eye(img.shape[0]).repeat_interleave(captions_per_image, dim=1).unsqueeze(1)  # (B, 1, kB)
    i2t = _seed_direction(scores, gt, tau)
    t2i = _seed_direction(scores.transpose(2, 0), gt.transpose(2, 0), tau)  # (kB, 1, B)
    return 0.5 * (i2t + t2i)


def measure(variant: str, batch: int, captions: int, dim: int, tau: float = 0.01) -> dict:
    """Forward + backward of one variant in this process; peak RSS above the warmed-up baseline."""
    from icr.training.losses.smoothap import SmoothAP

    gen = torch.Generator().manual_seed(0)
    img = F.normalize(torch.randn(batch, dim, generator=gen), dim=1).requires_grad_()  # (B, D)
    cap = F.normalize(torch.randn(batch * captions, dim, generator=gen), dim=1).requires_grad_()  # (kB, D)
    img_ids = torch.arange(batch)
    cap_img_ids = img_ids.repeat_interleave(captions)
    (img @ cap.T).sum().backward()  # warm-up: allocator, BLAS and autograd threads
    img.grad = cap.grad = None
    baseline = peak_rss_mb()
    start = time.perf_counter()
    if variant == "naive":
        loss = naive_smoothap(img, cap, captions, tau)
    else:
        loss = SmoothAP(tau=tau)(img, cap, img_ids, cap_img_ids)["loss"]
    loss.backward()
    seconds = time.perf_counter() - start
    return {
        "variant": variant,
        "description": VARIANTS[variant],
        "peak_mb": round(peak_rss_mb() - baseline, 1),
        "baseline_mb": round(baseline, 1),
        "seconds": round(seconds, 3),
        "loss": float(loss.detach()),
    }


def run(batch: int, captions: int, dim: int) -> dict:
    results = []
    for variant in VARIANTS:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.smoothap_memory",
                "--worker",
                variant,
                "--batch",
                str(batch),
                "--captions",
                str(captions),
                "--dim",
                str(dim),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {
        "host": socket.gethostname(),
        "date": dt.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "cpu",
        "batch_images": batch,
        "captions_per_image": captions,
        "dim": dim,
        "metric": "peak RSS (VmHWM) of forward+backward above a warmed-up baseline, fresh process each",
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--captions", type=int, default=5)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.batch, args.captions, args.dim)))
        return
    report = run(args.batch, args.captions, args.dim)
    print(
        f"SmoothAP forward+backward, B={args.batch} images x {args.captions} captions, D={args.dim} "
        f"({report['host']}, {report['date']}):"
    )
    for r in report["results"]:
        print(
            f"  {r['variant']:>5}: {r['peak_mb']:8.1f} MB peak above baseline, {r['seconds']:.2f} s, "
            f"loss {r['loss']:.6f}  ({r['description']})"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "smoothap-memory.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
