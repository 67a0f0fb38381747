"""Training step time and peak memory per objective, relative to ``ntxent`` in the same run.

Each objective trains in a fresh child process (``bench.train_objectives``: warm-up steps, then
timed steps of the whole training step: batch assembly, both encoders, the objective, backward,
optimizer), so its peak RSS is its own. The objectives run in interleaved rounds (all of them,
then all again) and each one's ratio to ``ntxent`` is taken within a round, then the median over
rounds: machine-wide slowdowns hit both sides of a ratio alike.

Every objective uses its own batch layout at batch size 128: caption-level objectives see 128
captions and their images; SmoothAP (ranking-based sampling, as in the ECIR runs) sees 128 images
with all 5 captions each, so its step encodes 5 times the captions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from bench.objectives import OBJECTIVES, label

QUICK_OBJECTIVES = ("ntxent", "smoothap", "goal", "cross_example_softmax", "ntxent/+ltd")


def run(
    data: Path,
    *,
    batch: int,
    steps: int,
    warmup: int,
    rounds: int,
    log,
    only: Collection[str] | None = None,
    config: str = "synthetic-ntxent",
    overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``only``: objective labels to run (``ntxent`` always runs: the ratios are to it). An objective
    whose child process fails (a missing optional package, out of memory) is listed under ``failed``
    with its last error line, and the others still run."""
    wanted = None if only is None else {*only, "ntxent"}
    chosen = [(n, e) for n, e in OBJECTIVES if wanted is None or label(n, e) in wanted]
    samples: dict[str, list[dict[str, Any]]] = {label(n, e): [] for n, e in chosen}
    failed: dict[str, str] = {}
    for r in range(rounds):
        for name, extra in chosen:
            if label(name, extra) in failed:
                continue
            command = [
                sys.executable,
                "-m",
                "bench.train_objectives",
                "--data",
                str(data),
                "--batch",
                str(batch),
                "--steps",
                str(steps),
                "--warmup",
                str(warmup),
                "--child",
                json.dumps([name, extra]),
                "--config",
                config,
                *(f"--set={o}" for o in overrides),
            ]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                if name == "ntxent" and not extra:
                    raise RuntimeError(f"the ntxent baseline failed to train: {why}")
                failed[label(name, extra)] = why
                log(f"train round {r + 1}/{rounds}: {label(name, extra)} failed: {why}")
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            samples[row["objective"]].append(row)
            log(
                f"train round {r + 1}/{rounds}: {row['objective']} {row['step_ms']} ms/step, "
                f"peak RSS {row['peak_rss_mb']:.0f} MB"
            )
    base = samples["ntxent"]
    rows = []
    for objective, runs in samples.items():
        if objective in failed:
            continue
        step = [x["step_ms"] for x in runs]
        ratios = [x["step_ms"] / b["step_ms"] for x, b in zip(runs, base, strict=True)]
        rows.append(
            {
                "objective": objective,
                "captions_per_step": runs[0]["captions_per_step"],
                "step_ms_median": float(np.median(step)),
                "step_ms_min": min(step),
                "step_ms_max": max(step),
                "vs_ntxent_median": float(np.median(ratios)),
                "vs_ntxent_per_round": ratios,
                "per_caption_vs_ntxent": float(np.median(ratios))
                * base[0]["captions_per_step"]
                / runs[0]["captions_per_step"],
                "loss_fwd_bwd_ms_median": float(np.median([x["loss_fwd_bwd_ms"] for x in runs])),
                "towers_fwd_bwd_ms_median": float(np.median([x["towers_fwd_bwd_ms"] for x in runs])),
                "decoder_fwd_bwd_ms_median": float(np.median([x["decoder_fwd_bwd_ms"] for x in runs])),
                "peak_rss_mb": max(x["peak_rss_mb"] for x in runs),
            }
        )
    return {
        "config": config,
        "overrides": list(overrides),
        "batch": batch,
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "rows": rows,
        "failed": failed,
    }
