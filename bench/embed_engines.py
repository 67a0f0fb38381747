"""``icr embed`` throughput: the local engine (one process) against the Ray engine (a local Ray
instance of ``ray_cpus`` workers), images per second on the same N synthetic JPEGs, same model,
same shards; the two folders are checked against each other (largest absolute difference).

The full bench embeds 100,000 images, ``--quick`` 2,000. The Ray instance starts before the clock
(its start is reported apart); the Ray figure includes the dataset's start and the actors' model
loading, as a run of ``icr embed --engine ray`` does.

    python -m bench.embed_engines --checkpoint runs/x/best --images 2000
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

FULL_IMAGES, QUICK_IMAGES = 100_000, 2_000


def synthetic_images(folder: Path, n: int, size: int = 128, seed: int = 0) -> Path:
    """``n`` JPEGs of ``size`` x ``size`` (smooth colour fields with noise, so they compress like
    photos), written once and reused: ``folder`` is complete when its ``.done`` file names ``n``."""
    from PIL import Image

    done = folder / ".done"
    if done.is_file() and done.read_text() == f"{n} {size} {seed}":
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, size, dtype=np.float32)
    for i in range(n):
        sub = folder / f"{i // 1000:04d}"
        if i % 1000 == 0:
            sub.mkdir(parents=True, exist_ok=True)
        a, b, c = rng.random((3, 3), dtype=np.float32)
        base = a[None, None, :] * ramp[:, None, None] + b[None, None, :] * ramp[None, :, None] + c * 0.3
        noise = rng.normal(0, 0.05, (size, size, 3)).astype(np.float32)
        pixels = np.clip((base / 2 + noise) * 255, 0, 255).astype(np.uint8)  # (size, size, 3)
        Image.fromarray(pixels).save(sub / f"{i:06d}.jpg", quality=90)
    done.write_text(f"{n} {size} {seed}")
    return folder


def run(
    checkpoint: Path,
    workdir: Path,
    images: int,
    log: Callable[[str], None],
    *,
    ray_cpus: int = 2,
    actors: int | None = None,
    batch_size: int = 128,
    shard_size: int = 10_000,
    image_size: int = 128,
) -> dict[str, Any]:
    """Embed ``images`` synthetic JPEGs with each engine; returns their throughputs (see module doc).

    ``ray_cpus``: the local Ray instance's CPUs (its workers); ``actors``: embedding actors (default
    the engine's: half the CPUs). Without Ray installed, ``ray`` holds ``{"skipped": why}``."""
    from icr.index.embed import embed_to_folder
    from icr.index.embeddings_layout import open_embeddings_folder

    folder = synthetic_images(workdir / f"embed-engines-{images}-{image_size}", images, image_size)
    out: dict[str, Any] = {
        "images": images,
        "image_size": image_size,
        "batch_size": batch_size,
        "shard_size": shard_size,
        "checkpoint": str(checkpoint),
    }
    common = {"images": folder, "shard_size": shard_size, "batch_size": batch_size, "progress": False}

    local_dir = workdir / "embed-engines-local"
    shutil.rmtree(local_dir, ignore_errors=True)
    started = time.perf_counter()
    manifest = embed_to_folder(checkpoint, local_dir, device="cpu", **common)
    seconds = time.perf_counter() - started
    out["local"] = {"seconds": seconds, "images_per_s": images / seconds, "rows": manifest["rows"]}
    log(f"embed engines: local {images:,} images in {seconds:.1f} s ({images / seconds:,.0f} img/s)")

    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as err:
        out["ray"] = {"skipped": f"ray[data] does not import ({err}); pip install -e '.[distributed]'"}
        return out
    if ray.is_initialized():
        ray.shutdown()
    ray_dir = workdir / "embed-engines-ray"
    shutil.rmtree(ray_dir, ignore_errors=True)
    started = time.perf_counter()
    ray.init(num_cpus=ray_cpus, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    start_s = time.perf_counter() - started
    try:
        started = time.perf_counter()
        manifest = embed_to_folder(checkpoint, ray_dir, engine="ray", actors=actors, device="cpu", **common)
        seconds = time.perf_counter() - started
        used = actors or max(1, ray_cpus // 2)
    finally:
        ray.shutdown()
    out["ray"] = {
        "seconds": seconds,
        "images_per_s": images / seconds,
        "rows": manifest["rows"],
        "workers": ray_cpus,
        "actors": used,
        "start_s": start_s,
    }
    out["speedup"] = out["local"]["seconds"] / seconds
    log(
        f"embed engines: ray ({ray_cpus} workers, {used} actor(s)) {images:,} images in {seconds:.1f} s "
        f"({images / seconds:,.0f} img/s; Ray started in {start_s:.1f} s)"
    )
    dim = int(manifest["dim"])
    a = np.concatenate([v for v, _ in open_embeddings_folder(local_dir, dim).chunks()])
    b = np.concatenate([v for v, _ in open_embeddings_folder(ray_dir, dim).chunks()])
    out["max_abs_diff"] = float(np.abs(a - b).max()) if a.shape == b.shape else None
    return out


def markdown(result: dict[str, Any]) -> str:
    """The figure as a Markdown section (a table: engine, wall time, images/s)."""
    lines = [
        "## Embedding engines (`icr embed`)",
        "",
        f"{result['images']:,} synthetic {result['image_size']} px JPEGs, batch {result['batch_size']}, "
        f"shards of {result['shard_size']:,}; model `{result['checkpoint']}`.",
        "",
        "| engine | wall (s) | images/s |",
        "|---|---:|---:|",
    ]
    local = result["local"]
    lines.append(f"| local (one process) | {local['seconds']:.1f} | {local['images_per_s']:,.0f} |")
    ray = result["ray"]
    if "skipped" in ray:
        lines += [f"| ray | skipped: {ray['skipped']} | |", ""]
        return "\n".join(lines)
    lines.append(
        f"| ray (local, {ray['workers']} workers, {ray['actors']} actor(s)) | {ray['seconds']:.1f} | "
        f"{ray['images_per_s']:,.0f} |"
    )
    diff = result.get("max_abs_diff")
    lines += [
        "",
        f"Ray / local speed: {result['speedup']:.2f}x (Ray started in {ray['start_s']:.1f} s, not counted). "
        f"Largest difference between the two folders' embeddings: "
        f"{'shapes differ' if diff is None else f'{diff:.1e}'}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--images", type=int, default=QUICK_IMAGES)
    parser.add_argument("--workdir", type=Path, default=Path("bench-work"))
    parser.add_argument("--ray-cpus", type=int, default=2)
    parser.add_argument("--actors", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = run(
        args.checkpoint,
        args.workdir.resolve(),
        args.images,
        lambda text: print(text, flush=True),
        ray_cpus=args.ray_cpus,
        actors=args.actors,
        batch_size=args.batch_size,
    )
    print(markdown(result))


if __name__ == "__main__":
    main()
