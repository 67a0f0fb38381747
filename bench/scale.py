"""Beyond one machine, measured on this one: `icr embed` single-process vs Ray, an index
larger than its memory budget built from shards and searched memory-mapped, and scatter-gather over
index shards in separate processes.

Full: 100,000 images through both engines, 10,000,000 vectors under a 4 GiB budget; ``--quick``:
2,000 images, 200,000 vectors under 512 MiB (the process itself takes ~90 MiB). The on-disk index
is built from resampled embeddings unless ``icr bench --scale-vectors`` gives a file with real
neighbour structure (``python -m bench.rendered_vectors``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import embed_engines, scatter_gather

ROOT = Path(__file__).resolve().parent.parent


def run(
    checkpoint: Path,
    embeddings: Path,
    workdir: Path,
    quick: bool,
    log: Callable[[str], None],
    vectors: tuple[Path, Path] | None = None,
) -> dict[str, Any]:
    """``vectors``: an (N, D) gallery file and its (Q, D) queries for the on-disk index (e.g. from
    ``python -m bench.rendered_vectors``), indexed as they are; without, vectors resampled from
    ``embeddings``, whose near-ties hide recall (see :mod:`bench.on_disk_index`)."""
    out: dict[str, Any] = {}
    images = embed_engines.QUICK_IMAGES if quick else embed_engines.FULL_IMAGES
    log(f"scale: icr embed, local vs ray, {images:,} images")
    out["embed"] = embed_engines.run(checkpoint, workdir, images, log)
    out["on_disk"] = on_disk(embeddings, workdir, quick, log, vectors)
    log("scale: scatter-gather over 2 and 4 shard processes")
    out["scatter_gather"] = scatter_gather.run(embeddings, [2, 4], 100 if quick else 300, 1000)
    return out


def on_disk(
    embeddings: Path,
    workdir: Path,
    quick: bool,
    log: Callable[[str], None],
    vectors: tuple[Path, Path] | None = None,
) -> dict[str, Any]:
    """The on-disk index's figures, from :mod:`bench.on_disk_index` run in its own process (so that
    its peak RSS is its own), or ``{"failed": [its last error line]}``."""
    budget = 512 if quick else 4096
    if vectors is None:
        count = 200_000 if quick else 10_000_000
        given = ["--source", str(embeddings), "--count", str(count)]
        log(f"scale: on-disk index of {count:,} resampled vectors under {budget} MiB (own process)")
    else:
        count = len(np.load(vectors[0], mmap_mode="r"))
        given = ["--vectors", str(vectors[0]), "--query-vectors", str(vectors[1])]
        log(f"scale: on-disk index of {count:,} vectors from {vectors[0]} under {budget} MiB (own process)")
    result = workdir / f"on-disk-{count}.json"
    command = [
        sys.executable, "-m", "bench.on_disk_index", *given, "--budget-mb", str(budget),
        "--out", str(workdir / f"on-disk-{count}"), "--json", str(result),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return {"failed": done.stderr.strip().splitlines()[-1:] or ["no output"]}
    return dict(json.loads(result.read_text()))


def markdown(section: dict[str, Any]) -> list[str]:
    lines = embed_engines.markdown(section["embed"]).splitlines()
    d = section["on_disk"]
    if "failed" in d:
        lines += ["## On-disk index", "", f"Failed: {' '.join(d['failed'])}", ""]
    else:
        lines += on_disk_markdown(d)
    return [*lines, *scatter_gather.markdown(section["scatter_gather"])]


def on_disk_markdown(d: dict[str, Any]) -> list[str]:
    """The on-disk index's figures (:mod:`bench.on_disk_index`) as Markdown lines."""
    under = "under" if d["peak_rss_mb"] <= d["budget_mb"] else "OVER"
    stages, held, cold = d["stages_s"], d["resident_after_search"], d["cold"]
    origin = (
        f"The vectors: `{d['vectors_file']}`, queries `{d['queries_file']}`."
        if "vectors_file" in d
        else f"Vectors resampled from {d['source_rows']:,} real embeddings (bench/on_disk_index.py)."
    )
    candidates = sorted({c for r in d["search"] for c in r.get("reranked", {})}, key=int)
    return [
        f"## On-disk index: {d['vectors']:,} vectors (dim {d['dim']}), {d['budget_mb']:,} MiB budget",
        "",
        f"`{d['factory']}` ({d['factory_reason']}). Built in {d['build_s']:.0f} s (train "
        f"{stages['train']:.0f} s on {d['train_points']:,} points, add {stages['add']:.0f} s in "
        f"{d['shards']} shards, merge {stages['merge']:.1f} s); peak RSS {d['peak_rss_mb']:,.0f} MiB, "
        f"{under} the budget (build: {d['peak_rss_mb_build']:,.0f} MiB). After the searches the process "
        f"holds {held['rss_mb']:,.0f} MiB: {held['anon_mb']:,.0f} its own, {held['file_mb']:,.0f} of mapped "
        f"file pages. On disk: index.ivfdata {d['ivfdata_mb']:,.0f} MiB, raw vectors {d['raw_mb']:,.0f} MiB, "
        f"both memory-mapped. {origin} One query at a time on one thread, k = 10, recall@10 against exact "
        f"search on {d['queries']} queries (exact top 10: {d['exact_top10_s']:.0f} s). First pass, "
        f"{cold.get('queries', d['queries'])} queries with the files dropped from the page cache (nprobe "
        f"{cold['nprobe']}, the default candidates): recall@10 "
        f"{cold['recall_at_10']:.3f}, p50 {cold['p50_ms']:.2f} ms, p99 {cold['p99_ms']:.2f} ms. Then warm:",
        "",
        "| nprobe | codes alone: recall@10 | p50 ms |"
        + "".join(f" {c} re-ranked: recall@10 | p50 ms | p99 ms |" for c in candidates),
        "|---:|---:|---:|" + "---:|---:|---:|" * len(candidates),
        *(
            f"| {r['nprobe']} | {r['codes_only']['recall_at_10']:.3f} | {r['codes_only']['p50_ms']:.2f} |"
            + "".join(
                f" {x['recall_at_10']:.3f} | {x['p50_ms']:.2f} | {x['p99_ms']:.2f} |"
                for x in (r["reranked"][c] for c in candidates)
            )
            for r in d["search"]
        ),
        "",
    ]


def best_recall_within(d: dict[str, Any], p50_ms: float) -> float | None:
    """The best warm recall@10 of any setting (codes alone or re-ranked) with p50 <= ``p50_ms`` (rows
    before re-ranking hold the codes' figures themselves)."""
    cells = [c for r in d["search"] for c in [r.get("codes_only", r), *r.get("reranked", {}).values()]]
    fast = [c["recall_at_10"] for c in cells if c["p50_ms"] <= p50_ms]
    return max(fast) if fast else None
