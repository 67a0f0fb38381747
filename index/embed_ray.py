"""``icr embed --engine ray``: the local engine's shards, computed by Ray Data workers.

For the images of the shards not yet recorded (the listing, manifest and bookkeeping are
:class:`index.embed_shards.ShardRun`'s, shared with the local engine)::

    from_items(position, file, byte range, first caption)     the driver's listing of the gallery
      -> map_batches(_decode)       tasks (1 CPU each): decode + the model's eval transform
      -> map_batches(_Embedder)     actor pool: the checkpoint loaded once per actor (1 GPU each
                                    when the cluster has GPUs); image and first-caption embeddings
      -> driver: results gathered by position; once every image of shard i is back (and every
         earlier shard written), the shard is written with write_shard and recorded in the manifest

Shard ``i`` is images ``[i * shard_size, (i + 1) * shard_size)`` of the listing, as in the local
engine, and its rows are written in listing order: the folder is the local engine's (embeddings
within float tolerance), and either engine continues a run of the other.

Exactly once: results are keyed by their position, so a task that Ray runs again (a worker or an
actor killed: tasks and actor calls are retried, actors restarted) cannot add a row twice, and a
shard is written only when each of its positions is back. A run that stops (an error, Ctrl-C, a
lost node beyond the retries) leaves the recorded shards; the same command continues.

Workers read the images and the checkpoint by path and import ``icr``: on a multi-node cluster
both must be on a filesystem every node mounts, and ``icr`` installed on every node. The output
folder is written by the driver only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from icr.index.embed_shards import ShardRun
from icr.index.galleries import FileGallery
from icr.index.photo_folder import ImageRef, decode_image, left_out
from icr.training.checkpoint import load_checkpoint
from icr.training.data.errors import DatasetError
from icr.training.embedding import embed_captions
from icr.training.models.preprocess import ImageTransform

# Task retries, actor restarts and retries of a call on a restarted actor (worker or node lost):
# finite, so a file that crashes its worker every time ends the run (resumable) instead of looping.
RETRIES = 5


def embed_shards_ray(
    run: ShardRun,
    todo: list[int],
    *,
    gallery: FileGallery,
    checkpoint: str | os.PathLike[str],
    transform: Any,
    batch_size: int,
    device: str,
    address: str | None,
    actors: int | None,
    skip_bad: bool,
    progress: bool,
    bar: Any,
    on_shard: Callable[[int], None] | None,
) -> None:
    """Write and record the shards ``todo`` of ``run`` on Ray. ``address``: None starts a local Ray
    instance (a driver already connected is reused and left connected), ``auto`` / ``ray://h:p``
    joins a cluster. ``device``: auto (GPU actors when the cluster has GPUs), cpu or cuda."""
    if not isinstance(transform, ImageTransform):
        raise ValueError("this checkpoint embeds precomputed features, not image files: use --engine local")
    if not todo:
        return
    with _connected(address, progress) as ray, _quiet_data_context(ray), warnings.catch_warnings():
        # Ray 2.60 deprecates passing max_retries / max_restarts / max_task_retries as keyword
        # arguments and names no replacement yet (its defaults retry forever; ours stop at RETRIES)
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        use_gpu, size = _actors(ray, device, actors)
        dataset = _pipeline(ray, run, todo, gallery, transform, batch_size).map_batches(
            _Embedder,
            fn_constructor_kwargs={"checkpoint": str(Path(checkpoint).resolve()), "use_gpu": use_gpu},
            batch_size=batch_size,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=size),
            num_cpus=1,
            num_gpus=1 if use_gpu else 0,
            max_restarts=RETRIES,
            max_task_retries=RETRIES,
        )
        batches = iter(dataset.iter_batches(batch_size=None, batch_format="numpy"))
        try:
            _gather(run, todo, gallery, batches, skip_bad, bar, on_shard)
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # stops the pipeline when the run stops early


@contextlib.contextmanager
def _connected(address: str | None, progress: bool) -> Iterator[Any]:
    """The ``ray`` module, connected: to the driver's existing connection, or a new one (shut down
    on exit)."""
    try:
        import ray  # noqa: PLC0415 (Ray: the optional [distributed] extra)
        import ray.data  # noqa: PLC0415 (Ray: the optional [distributed] extra)
    except ImportError:
        raise ValueError(
            "--engine ray needs Ray Data: pip install 'icr[distributed]' (or pip install 'ray[data]')"
        ) from None
    if ray.is_initialized():
        yield ray
        return
    ray.init(
        address="local" if address is None else address,
        include_dashboard=False if address is None else None,
        logging_level=logging.INFO if progress else logging.WARNING,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def _actors(ray: Any, device: str, actors: int | None) -> tuple[bool, int]:
    """(GPU actors?, how many): one per GPU, or half the CPUs (the other half decodes)."""
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 1))
    if device == "cuda" and not gpus:
        raise ValueError("--device cuda: the Ray cluster has no GPU (use --device auto or cpu)")
    use_gpu = gpus > 0 and device != "cpu"
    size = actors or (gpus if use_gpu else max(1, cpus // 2))
    if use_gpu and size > gpus:
        raise ValueError(f"--actors {size}: each embedding actor takes a GPU and the cluster has {gpus}")
    if size >= cpus:  # the actors would hold every CPU and no decoding task could start
        fix = f"give --actors at most {cpus - 1}" if cpus > 1 else "use --engine local"
        raise ValueError(
            f"the Ray cluster has {cpus} CPU(s): {size} embedding actor(s) take one each and decoding "
            f"needs at least one more; {fix}"
        )
    return use_gpu, size


def _pipeline(
    ray: Any,
    run: ShardRun,
    todo: list[int],
    gallery: FileGallery,
    transform: Any,
    batch_size: int,
) -> Any:
    """The dataset of the pending images, decoded and transformed (before the embedding actors)."""
    items = []
    for i in todo:
        lo, hi = run.bounds(i)
        for j in range(lo, hi):
            ref = gallery.refs[j]
            ref = ref if isinstance(ref, ImageRef) else ImageRef(str(ref))
            captions = gallery.metadata.captions.get(gallery.relative[j]) if run.text else None
            items.append(
                {
                    "pos": j,
                    "path": ref.path,
                    "offset": ref.offset,
                    "size": ref.size,
                    "name": ref.name,
                    "caption": captions[0] if captions else "",
                }
            )
    blocks = max(1, -(-len(items) // batch_size))
    return ray.data.from_items(items, override_num_blocks=blocks).map_batches(
        _decode,
        fn_kwargs={"transform": transform},
        batch_size=batch_size,
        batch_format="numpy",
        num_cpus=1,
        max_retries=RETRIES,
    )


def _decode(batch: dict[str, np.ndarray], transform: Any) -> dict[str, np.ndarray]:
    """A batch's images decoded and put through ``transform`` (the model's eval transform):
    ``pixels`` (n, 3, S, S) float32, zeros where ``ok`` is False and ``error`` says why."""
    images, ok, errors = [], [], []
    for path, offset, size, name in zip(
        batch["path"], batch["offset"], batch["size"], batch["name"], strict=True
    ):
        item = Path(str(path)) if int(size) < 0 else ImageRef(str(path), int(offset), int(size), str(name))
        result = decode_image(item)
        failed = isinstance(result, DatasetError)
        ok.append(not failed)
        errors.append(str(result) if failed else "")  # with its hint: it stops a run without --skip-bad
        if not failed:
            images.append(result)
    mask = np.asarray(ok, dtype=bool)
    pixels = np.zeros((len(mask), 3, transform.image_size, transform.image_size), np.float32)
    if images:
        # eval transforms are deterministic; the generator argument is never called
        pixels[mask] = transform.stack(images, lambda _j: np.random.default_rng(0)).numpy()
    return {
        "pos": batch["pos"],
        "ok": mask,
        "error": np.asarray(errors, dtype=object),
        "pixels": pixels,
        "caption": batch["caption"],
    }


class _Embedder:
    """An actor of the pool: the checkpoint, loaded once; a batch's image embeddings and, when the
    run writes text embeddings, its first captions' (zeros where the image did not decode)."""

    def __init__(self, checkpoint: str, use_gpu: bool) -> None:
        self.device = "cuda" if use_gpu else "cpu"
        self.model, _ = load_checkpoint(checkpoint, self.device)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ok = np.asarray(batch["ok"], dtype=bool)
        dim = int(self.model.embed_dim)
        vectors = np.zeros((len(ok), dim), np.float32)  # (n, D)
        texts = np.zeros((len(ok), dim), np.float32)  # (n, D)
        if ok.any():
            with torch.no_grad():
                x = torch.from_numpy(np.ascontiguousarray(batch["pixels"][ok])).to(
                    self.device
                )  # (k, 3, S, S)
                vectors[ok] = self.model.encode_image(x).float().cpu().numpy()
            captions = [str(c) for c in batch["caption"][ok]]
            if all(captions):
                texts[ok] = embed_captions(self.model, captions, device=self.device)
        return {"pos": batch["pos"], "ok": ok, "error": batch["error"], "vector": vectors, "text": texts}

    def pid(self) -> int:
        return os.getpid()


def _gather(
    run: ShardRun,
    todo: list[int],
    gallery: FileGallery,
    batches: Iterator[dict[str, np.ndarray]],
    skip_bad: bool,
    bar: Any,
    on_shard: Callable[[int], None] | None,
) -> None:
    """Collect results by position; write and record the shards in order, each once all its images
    are back (results that come early wait, embeddings only), so a run that stops leaves a prefix of
    the shards as the local engine does. Without ``skip_bad`` a file that does not decode stops the
    run as in the local engine: the shards before its shard are written, then its error is raised."""
    got: dict[int, dict[int, tuple[bool, str, np.ndarray, np.ndarray]]] = {i: {} for i in todo}
    bad: dict[int, str] = {}  # position -> error, without skip_bad

    def first_bad_shard() -> int | None:
        return min(bad) // run.shard_size if bad else None

    def flush() -> None:  # the complete shards at the head of the queue, up to a bad file's shard
        stop = first_bad_shard()
        while got:
            i = min(got)
            lo, hi = run.bounds(i)
            if (stop is not None and i >= stop) or len(got[i]) < hi - lo:
                return
            _write(run, i, gallery, got.pop(i))
            if on_shard is not None:
                on_shard(i)

    def blocked() -> bool:  # a bad file is known and every shard before it is written
        stop = first_bad_shard()
        return stop is not None and all(i >= stop for i in got)

    for batch in batches:
        for pos, ok, error, vector, text in zip(
            batch["pos"], batch["ok"], batch["error"], batch["vector"], batch["text"], strict=True
        ):
            j = int(pos)
            i = j // run.shard_size
            if i not in got:
                continue  # a shard written already: a retried task's second answer
            if j not in got[i]:
                bar.update(1)
            got[i][j] = (bool(ok), str(error), vector, text)
            if not ok and not skip_bad:
                bad[j] = str(error)
        flush()
        if blocked():
            break
    flush()
    if bad:
        raise DatasetError(bad[min(bad)])
    if got:
        missing = sum(run.bounds(i)[1] - run.bounds(i)[0] - len(got[i]) for i in got)
        raise RuntimeError(
            f"Ray returned no result for {missing} image(s) of shards {sorted(got)[:8]}; run the same "
            "command again to finish them"
        )


def _write(
    run: ShardRun, i: int, gallery: FileGallery, results: dict[int, tuple[bool, str, np.ndarray, np.ndarray]]
) -> None:
    """Shard ``i`` from its results, in listing order."""
    lo, hi = run.bounds(i)
    rows, vectors, texts, failed = [], [], [], []
    for j in range(lo, hi):
        ok, error, vector, text = results[j]
        if ok:
            rows.append(gallery.row(j))
            vectors.append(vector)
            texts.append(text)
        else:
            failed.append((gallery.relative[j], left_out(error)))
    dim = int(run.manifest["dim"])
    image_emb = np.stack(vectors) if vectors else np.zeros((0, dim), np.float32)  # (r, D)
    text_emb = (np.stack(texts) if texts else np.zeros((0, dim), np.float32)) if run.text else None  # (r, D)
    run.record(i, image_emb, text_emb, rows, failed)


@contextlib.contextmanager
def _quiet_data_context(ray: Any) -> Iterator[None]:
    """No Ray Data progress bars, banners or notes (the run has its own bar), errors still shown;
    restored on exit."""
    context = ray.data.DataContext.get_current()
    saved = (context.enable_progress_bars, context.print_on_execution_start)
    logger = logging.getLogger("ray.data")
    level = logger.level
    logger.setLevel(logging.ERROR)
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    try:
        yield
    finally:
        context.enable_progress_bars, context.print_on_execution_start = saved
        logger.setLevel(level)
