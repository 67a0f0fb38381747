"""GPU figures, when a CUDA GPU is visible (skipped otherwise, and said so in the report).

* floors: device memory bandwidth (a copy of 1 GiB: bytes read + written over the time) and fp32
  matmul rate (TF32 off, so the rate matches FAISS's fp32 search);
* faiss-gpu search over the same gallery vectors as the CPU figures: exact ``GpuIndexFlatIP`` for
  batches of 1, 64 and 1,024 queries against ``max(bytes / bandwidth, 2 N d Q / matmul rate)``,
  and the CPU build's ANN index moved to the GPU (recall@10 against the exact GPU search);
* training: step time per objective for a ResNet-50 (random weights, frozen as in the ECIR runs) +
  GRU model at batch 128, relative to ntxent (child processes, as on the CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.stats import ratio, repeat, summary

BATCHES = (1, 64, 1024)


def available() -> tuple[bool, str]:
    try:
        import torch
    except ImportError as err:
        return False, f"torch does not import: {err}"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible"
    import faiss

    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() < 1:
        return False, "FAISS has no GPU support here (install the [gpu] extra: faiss-gpu)"
    return True, torch.cuda.get_device_name(0)


def _cuda_ms(fn, repeats: int) -> list[float]:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def floors() -> dict[str, Any]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_s = min(_cuda_ms(lambda: dst.copy_(src), 10))
    square = torch.randn(8192, 8192, device="cuda")
    mm_s = min(_cuda_ms(lambda: square @ square, 5))
    return {"bandwidth_gbps": 2 * (1 << 30) / copy_s / 1e9, "matmul_tflops": 2 * 8192**3 / mm_s / 1e12}


def search(gallery: np.ndarray, queries: np.ndarray, ann_index: Any, repeats: int) -> dict[str, Any]:
    """Exact and ANN search on the GPU; ``gallery`` (N, D) float32, ``queries`` (Q >= 1024, D)."""
    import faiss

    f = floors()
    n, dim = gallery.shape
    resources = faiss.StandardGpuResources()
    exact = faiss.GpuIndexFlatIP(resources, dim)
    exact.add(gallery)
    ann = faiss.index_cpu_to_gpu(resources, 0, ann_index)
    out: dict[str, Any] = {"floors": f, "vectors": n}
    for size in BATCHES:
        batch = queries[np.arange(size) % len(queries)]
        floor_ms = max(
            n * dim * 4 / (f["bandwidth_gbps"] * 1e9), 2 * n * dim * size / (f["matmul_tflops"] * 1e12)
        )
        floor_ms *= 1e3
        row: dict[str, Any] = {"floor_ms": floor_ms}
        for name, index in (("exact", exact), ("ann", ann)):
            row[name] = summary(repeat(lambda i=index, b=batch: i.search(b, 10), repeats))
        row["exact_vs_floor"] = ratio(row["exact"]["median_ms"], floor_ms)
        out[str(size)] = row
    _, truth = exact.search(queries[:1024], 10)
    _, found = ann.search(queries[:1024], 10)
    out["ann_recall_at_10_vs_exact"] = float(
        np.mean([len(set(a) & set(t)) / 10 for a, t in zip(found, truth, strict=True)])
    )
    return out


def resnet_folder(workdir: Path) -> Path:
    """A Hugging Face ResNet-50 folder with random weights (step time does not depend on them)."""
    folder = workdir / "resnet-50-random"
    if not (folder / "config.json").is_file():
        from transformers import ResNetConfig, ResNetModel

        ResNetModel(ResNetConfig()).save_pretrained(folder)
    return folder
