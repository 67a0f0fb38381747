"""Time every evaluation metric on a COCO-5K-size similarity matrix (5,000 images x 25,000 captions).

    python -m bench.eval_metrics [--images 5000] [--captions-per-image 5] [--dim 256] [--repeats 3]

The matrix comes from structured embeddings, not uniform noise: images are random unit vectors
and each caption is its image plus Gaussian noise (noise 6: t2i R@1 about 16 % at 5K and 29 % at
1K, the range of real COCO models), so ranks, ties and thresholds behave as for a model rather
than for uniform noise. Timed:
``full_metrics`` under the 1K (5 folds) and 5K protocols, which include rank metrics, PR-AUC over
all 125 M pairs, threshold metrics and score distributions, plus fitting an isotonic calibration
and its ECE. Median and spread over repeats, and the peak RSS, are written to
``bench/results/eval-metrics-<host>-<date>.json`` (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import socket
import time
from pathlib import Path

import numpy as np

from icr.core.memory import peak_rss_mb
from icr.training.evaluation.metrics.calibration import fit_calibration, score_histogram
from icr.training.evaluation.metrics.relevant_pairs import Relevance
from icr.training.evaluation.metrics.report import full_metrics


def structured_similarity(n_img: int, per_image: int, dim: int, noise: float, seed: int = 0) -> np.ndarray:
    """(n_img, n_img * per_image) float32 cosine scores of noisy caption copies of random images."""
    rng = np.random.default_rng(seed)
    img = rng.standard_normal((n_img, dim), dtype=np.float32)
    img /= np.linalg.norm(img, axis=1, keepdims=True)
    cap = np.repeat(img, per_image, axis=0) + noise / np.sqrt(dim) * rng.standard_normal(
        (n_img * per_image, dim), dtype=np.float32
    )
    cap /= np.linalg.norm(cap, axis=1, keepdims=True)
    return img @ cap.T  # (N_img, N_cap)


def _timed(fn, repeats: int) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--captions-per-image", type=int, default=5)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--noise", type=float, default=6.0, help="caption noise (t2i R@1 about 16 %% at 5K)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    sim = structured_similarity(args.images, args.captions_per_image, args.dim, args.noise)
    layout = np.arange(sim.shape[1]) // args.captions_per_image
    relevance = Relevance.annotations(layout, args.images)
    calibration = fit_calibration(score_histogram(sim, relevance))
    stages = {
        "full_metrics_5k": lambda: full_metrics(sim, relevance, layout, protocol="full"),
        "full_metrics_1k_folds": lambda: full_metrics(sim, relevance, layout, protocol="1k"),
        "fit_isotonic_calibration": lambda: fit_calibration(score_histogram(sim, relevance)),
        "full_metrics_5k_with_ece": lambda: full_metrics(sim, relevance, layout, calibration=calibration),
    }
    results = {}
    for name, fn in stages.items():
        times, out = _timed(fn, args.repeats)
        results[name] = {
            "median_s": float(np.median(times)),
            "min_s": min(times),
            "max_s": max(times),
            "runs": times,
        }
        if isinstance(out, dict) and "timings" in out:
            results[name]["stages_s"] = out["timings"]
            results[name]["rsum"] = out["retrieval"]["rsum"]
            results[name]["t2i_r1"] = out["retrieval"]["t2i_r1"]
            results[name]["pr_auc"] = out["global"]["pr_auc"]
        print(
            f"{name:28s} median {results[name]['median_s']:6.2f} s"
            f"  (min {min(times):.2f}, max {max(times):.2f})"
        )
    report = {
        "benchmark": "eval-metrics",
        "host": socket.gethostname(),
        "date": dt.date.today().isoformat(),
        "machine": {"cpus": len(__import__("os").sched_getaffinity(0)), "platform": platform.platform()},
        "matrix": {
            "images": args.images,
            "captions": int(sim.shape[1]),
            "pairs": int(sim.size),
            "dim": args.dim,
        },
        "repeats": args.repeats,
        "results": results,
        "peak_rss_mb": peak_rss_mb(),
    }
    out = args.out or Path("bench/results") / f"eval-metrics-{socket.gethostname()}-{report['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"peak RSS {report['peak_rss_mb']:.0f} MB; wrote {out}")


if __name__ == "__main__":
    main()
