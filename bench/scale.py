"""Beyond one machine, measured on this one: `icr embed` single-process vs Ray, an index
larger than its memory budget built from shards and searched memory-mapped, and scatter-gather over
index shards in separate processes.

Full: 100,000 images through both engines, 10,000,000 vectors under a 4 GiB budget; ``--quick``:
2,000 images, 200,000 vectors under 512 MiB (the process itself takes ~90 MiB). The on-disk build
runs in its own process so that its peak RSS is its own (see :mod:`bench.on_disk_index`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import embed_engines, scatter_gather

ROOT = Path(__file__).resolve().parent.parent


def run(
    checkpoint: Path, embeddings: Path, workdir: Path, quick: bool, log: Callable[[str], None]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    images = embed_engines.QUICK_IMAGES if quick else embed_engines.FULL_IMAGES
    log(f"scale: icr embed, local vs ray, {images:,} images")
    out["embed"] = embed_engines.run(checkpoint, workdir, images, log)
    count, budget = (200_000, 512) if quick else (10_000_000, 4096)
    log(f"scale: on-disk index of {count:,} resampled vectors under {budget} MiB (own process)")
    result = workdir / f"on-disk-{count}.json"
    command = [
        sys.executable, "-m", "bench.on_disk_index", "--source", str(embeddings), "--count", str(count),
        "--budget-mb", str(budget), "--out", str(workdir / f"on-disk-{count}"), "--json", str(result),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        out["on_disk"] = {"failed": done.stderr.strip().splitlines()[-1:] or ["no output"]}
    else:
        out["on_disk"] = json.loads(result.read_text())
    log("scale: scatter-gather over 2 and 4 shard processes")
    out["scatter_gather"] = scatter_gather.run(embeddings, [2, 4], 100 if quick else 300, 1000)
    return out


def markdown(section: dict[str, Any]) -> list[str]:
    lines = embed_engines.markdown(section["embed"]).splitlines()
    d = section["on_disk"]
    if "failed" in d:
        lines += ["## On-disk index", "", f"Failed: {' '.join(d['failed'])}", ""]
    else:
        under = "under" if d["peak_rss_mb"] <= d["budget_mb"] else "OVER"
        stages = d["stages_s"]
        lines += [
            f"## On-disk index: {d['vectors']:,} vectors (dim {d['dim']}), {d['budget_mb']:,} MiB budget",
            "",
            f"`{d['factory']}` ({d['factory_reason']}). Built in {d['build_s']:.0f} s (train "
            f"{stages['train']:.0f} s on {d['train_points']:,} points, add {stages['add']:.0f} s in "
            f"{d['shards']} shards, merge {stages['merge']:.1f} s); peak RSS {d['peak_rss_mb']:,.0f} MiB, "
            f"{under} the budget; index.ivfdata {d['ivfdata_mb']:,.0f} MiB, searched memory-mapped. "
            f"Vectors resampled from {d['source_rows']:,} real embeddings (bench/on_disk_index.py). "
            f"Recall@10 against exact search on {d['queries']} queries (exact top-10: "
            f"{d['exact_top10_s']:.0f} s):",
            "",
            "| nprobe | recall@10 | p50 ms | p99 ms |",
            "|---:|---:|---:|---:|",
            *(
                f"| {r['nprobe']} | {r['recall_at_10']:.3f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |"
                for r in d["search"]
            ),
            "",
        ]
    return [*lines, *scatter_gather.markdown(section["scatter_gather"])]
