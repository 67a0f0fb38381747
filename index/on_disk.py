"""IVF indices larger than memory: trained on a sample, filled shard by shard, inverted lists merged on
disk, served memory-mapped.

The build holds at most: the training sample, and ``workers`` shards being added (each a copy of
the trained, empty index filling with one shard's codes, written to a block file and freed). The
blocks' inverted lists are then merged into one ``index.ivfdata`` file (FAISS's
``OnDiskInvertedLists``, reading the blocks memory-mapped), which ``index.faiss`` refers to by
name: the service maps it instead of loading it, so the index may exceed RAM. Peak resident memory
is then bounded by ``--memory-budget-mb``: the factory is chosen so that the codes and ids fit a
quarter of the budget (the merge maps both the blocks it reads and the file it writes, so twice
the codes may be resident: half the budget), the sample and shards take the other half.

Factories: ``IVF{nlist},Flat`` when raw vectors fit; ``IVF{nlist},PQ{m},RFlat`` down to 16x
compression; ``OPQ{m},IVF{nlist},PQ{m},RFlat`` beyond (a learned rotation keeps more of the recall at
few bytes); with more than :data:`HNSW_QUANTIZER_ABOVE` lists the centroids are searched through an
HNSW graph (``IVF{nlist}_HNSW32``). ``,RFlat``: the PQ codes find candidates that are re-ranked
exactly from the raw vectors (:mod:`index.rerank`), written to :data:`index.rerank.RAW_FILE` during the
build and memory-mapped when served: they cost disk, not the memory budget (the pages a search reads
stay in the page cache, which the kernel reclaims). PQ codes alone stop at a recall the probing
cannot raise: recall@10 0.656 at every nprobe on 10M vectors with PQ64 (2026-11-23).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from faiss.contrib.ondisk import merge_ondisk

from icr.index.rerank import RAW_FILE, SUFFIX, is_reranked
from icr.index.vector_index import empty_index, load_index

ONDISK_DATA = "index.ivfdata"
MAX_NLIST = 65_536
TRAIN_POINTS_PER_LIST = 32  # FAISS warns below 39; 32 keeps k-means on 2 cores within minutes at 10M
MIN_TRAIN_POINTS = 10_000  # the PQ codebooks (256 centroids each) need that many on their own
DEFAULT_SHARD_SIZE = 1_000_000
PQ_CHOICES = (64, 48, 32, 24, 16, 8, 4)
ID_BYTES = 8  # an int64 id per vector in the inverted lists
# Above this many lists the coarse quantizer is an HNSW graph over the centroids: assigning 10M
# vectors to 12,649 lists by brute force is ~30 TFLOP (minutes on 2 cores), through the graph ~1.
HNSW_QUANTIZER_ABOVE = 4096
KMEANS_ITERATIONS = 10  # FAISS's IVF default is 25; the lists barely move after 10
OPQ_ITERATIONS = 4  # most of the rotation's gain; each iteration retrains the PQ (seconds at d=256)


def choose_on_disk_factory(n: int, dim: int, memory_budget_bytes: int) -> tuple[str, str]:
    """(factory, reason): the codes and ids of ``n`` vectors must fit a quarter of the memory budget;
    PQ codes are re-ranked from the raw vectors on disk."""
    if n < 1 or dim < 1:
        raise ValueError(f"need n >= 1 and dim >= 1, got n={n}, dim={dim}")
    nlist = int(min(MAX_NLIST, max(1, round(4 * math.sqrt(n)))))
    ivf = f"IVF{nlist}_HNSW32" if nlist > HNSW_QUANTIZER_ABOVE else f"IVF{nlist}"
    lists = (
        f"{nlist} lists (4 sqrt(n){', found through an HNSW graph' if nlist > HNSW_QUANTIZER_ABOVE else ''})"
    )
    quarter = memory_budget_bytes // 4
    budget = f"a quarter of the memory budget ({quarter / 2**20:,.0f} MiB)"
    if n * (dim * 4 + ID_BYTES) <= quarter:
        return f"{ivf},Flat", f"{n:,} raw vectors and ids fit {budget}; {lists}"
    for m in PQ_CHOICES:
        if dim % m or n * (m + ID_BYTES) > quarter:
            continue
        ratio = dim * 4 / m
        opq = f"OPQ{m}," if ratio > 16 else ""
        why = f"{m}-byte codes ({ratio:.0f}x smaller than float32{', OPQ-rotated' if opq else ''})"
        rerank = f"the candidates re-ranked exactly from the raw vectors on disk ({RAW_FILE}, memory-mapped)"
        return f"{opq}{ivf},PQ{m}{SUFFIX}", f"{n:,} vectors: {why} and ids fit {budget}; {lists}; {rerank}"
    raise ValueError(
        f"{n:,} vectors of dim {dim}: even the smallest PQ codes exceed {budget}; raise --memory-budget-mb"
    )


@dataclass
class OnDiskBuild:
    ntotal: int
    shards: int
    train_points: int
    seconds: dict[str, float]


def build_on_disk(
    chunks: Iterable[np.ndarray],
    dim: int,
    factory: str,
    out_dir: str | os.PathLike[str],
    index_file: str,
    *,
    memory_budget_bytes: int,
    shard_size: int = DEFAULT_SHARD_SIZE,
    workers: int = 2,
    on_vectors: Callable[[np.ndarray], None] | None = None,
) -> OnDiskBuild:
    """Write ``index_file`` and :data:`ONDISK_DATA` into ``out_dir`` from ``chunks`` of (b, D) unit rows
    (ids 0..N-1 in order, consumed once), and for a re-ranked factory (``...,RFlat``) the raw vectors
    as :data:`index.rerank.RAW_FILE`. ``on_vectors`` sees every chunk (e.g. an exact top-k for the
    recall check). Shards hold at most ``shard_size`` vectors, fewer when the budget asks."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build = functools.partial(
        _build, dim=dim, factory=factory, out_dir=out_dir, index_file=index_file,
        memory_budget_bytes=memory_budget_bytes, shard_size=shard_size, workers=workers,
    )  # fmt: skip
    if not is_reranked(factory):
        return build(chunks, on_vectors=on_vectors)
    with (out_dir / RAW_FILE).open("wb") as raw:

        def tee(block: np.ndarray) -> None:
            raw.write(block.tobytes())  # C-contiguous float32 (see _observed)
            if on_vectors is not None:
                on_vectors(block)

        return build(chunks, on_vectors=tee)


def _build(
    chunks: Iterable[np.ndarray],
    *,
    dim: int,
    factory: str,
    out_dir: Path,
    index_file: str,
    memory_budget_bytes: int,
    shard_size: int,
    workers: int,
    on_vectors: Callable[[np.ndarray], None] | None,
) -> OnDiskBuild:
    index = empty_index(dim, factory)
    # Any: the stubs declare the base classes, not the downcast ones FAISS returns
    ivf: Any = faiss.downcast_index(faiss.extract_index_ivf(index))
    ivf.cp.niter = KMEANS_ITERATIONS
    if isinstance(index, faiss.IndexPreTransform):  # OPQ: FAISS's default 50 rotation updates take minutes
        opq: Any = faiss.downcast_VectorTransform(index.chain.at(0))  # type: ignore[attr-defined]
        opq.niter = OPQ_ITERATIONS
    # the other half of the budget: the sample, and each worker's shard (float32 + its codes)
    half = memory_budget_bytes // 2
    wanted = max(MIN_TRAIN_POINTS, TRAIN_POINTS_PER_LIST * int(ivf.nlist))
    wanted = min(wanted, max(MIN_TRAIN_POINTS, half // 2 // (dim * 4)))
    shard_size = max(1, min(shard_size, half // 2 // max(1, workers) // (dim * 4 + ivf.code_size + ID_BYTES)))
    seconds = {"train": 0.0, "add": 0.0, "merge": 0.0}

    stream = _observed(chunks, dim, on_vectors)
    held: list[np.ndarray] = []
    count = 0
    for block in stream:
        held.append(block)
        count += len(block)
        if count >= wanted:
            break
    sample = np.concatenate(held) if held else np.zeros((0, dim), np.float32)  # (T, D)
    if len(sample) < max(int(ivf.nlist), 1):
        raise ValueError(
            f"{factory} needs at least {ivf.nlist} vectors to train, the stream has {len(sample)}"
        )
    t0 = time.perf_counter()
    index.train(sample[:wanted])
    seconds["train"] = time.perf_counter() - t0
    train_points = min(len(sample), wanted)
    del sample

    blocks_dir = out_dir / ".blocks"
    blocks_dir.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        files = _add_shards(index, _reshard(_chain(held, stream), shard_size), blocks_dir, workers)
        seconds["add"] = time.perf_counter() - t0
        t0 = time.perf_counter()

        merged = faiss.clone_index(index)  # trained and empty
        merge_ondisk(merged, [str(f) for f, _ in files], str(out_dir / ONDISK_DATA))
        faiss.write_index(merged, str(out_dir / index_file))
        seconds["merge"] = time.perf_counter() - t0
        ntotal = int(merged.ntotal)
    finally:
        shutil.rmtree(blocks_dir, ignore_errors=True)
    return OnDiskBuild(ntotal, len(files), train_points, seconds)


def _observed(
    chunks: Iterable[np.ndarray], dim: int, on_vectors: Callable[[np.ndarray], None] | None
) -> Iterator[np.ndarray]:
    for block in chunks:
        block = np.ascontiguousarray(block, dtype=np.float32)
        if block.ndim != 2 or block.shape[1] != dim:
            raise ValueError(f"a chunk of vectors must be (b, {dim}), got {block.shape}")
        if on_vectors is not None:
            on_vectors(block)
        yield block


def _chain(first: list[np.ndarray], rest: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    yield from first
    first.clear()  # the training sample's chunks are freed as they are added
    yield from rest


def _reshard(chunks: Iterator[np.ndarray], size: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first id, (<= size, D)) blocks of consecutive vectors."""
    pending: list[np.ndarray] = []
    held = first = 0
    for block in chunks:
        while len(block):
            take = block[: size - held]
            block = block[len(take) :]
            pending.append(take)
            held += len(take)
            if held == size:
                yield first, np.concatenate(pending)
                first += held
                pending, held = [], 0
    if held:
        yield first, np.concatenate(pending)


def _add_shards(
    trained: faiss.Index, shards: Iterator[tuple[int, np.ndarray]], folder: Path, workers: int
) -> list[tuple[Path, int]]:
    """Each shard into a copy of the empty trained index, written to a block file; ``workers`` at
    a time (FAISS releases the GIL; OpenMP threads are split between them)."""
    threads = max(1, (os.cpu_count() or 1) // max(1, workers))
    slots = threading.Semaphore(workers)  # bounds the shards held in memory
    files: list[tuple[Path, int]] = []

    def add(number: int, first: int, vectors: np.ndarray) -> tuple[Path, int]:
        try:
            faiss.omp_set_num_threads(threads)  # per thread (OpenMP)
            block = faiss.clone_index(trained)
            block.add_with_ids(vectors, np.arange(first, first + len(vectors), dtype=np.int64))
            path = folder / f"block_{number:05d}.faiss"
            faiss.write_index(block, str(path))
            return path, len(vectors)
        finally:
            slots.release()

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures: list[Future[tuple[Path, int]]] = []
        for number, (first, vectors) in enumerate(shards):
            slots.acquire()
            futures.append(pool.submit(add, number, first, vectors))
            del vectors
        files = [f.result() for f in futures]
    return files


def load_on_disk(path: str | os.PathLike[str]) -> Any:
    """An index whose inverted lists live in :data:`ONDISK_DATA` beside ``path``, memory-mapped (of a
    re-ranked factory, its codes: :func:`index.index_folder.load_index_dir` adds the raw vectors)."""
    return load_index(path, on_disk=True)
