"""Gallery vectors with real neighbour structure at any size: rendered distractors of the embedded
benchmark, embedded by a checkpoint, written as one (N, D) float32 ``.npy`` (resumable).

    python -m bench.rendered_vectors --checkpoint icr/demo_weights --data icr-demo/data \\
        --count 10000000 --out base10m.npy --first test-images.npy --query-out queries.npy

``--first``: rows placed before the distractors (e.g. the test images' embeddings from ``icr embed``).
``--query-out``: ``--queries`` test captions (a seeded sample) embedded by the same checkpoint. Every
distractor is a function of (the benchmark's seed, its number), so a run stopped part way continues
where its last flushed block ended (``<out>.done``) and writes the same file. Resampling a few real
rows into millions crowds near-ties around them and hides what an index's codes lose; these vectors
are what the model makes of images it never saw. On 2 cores with the shipped demo model: 2,099
vectors/s (10M in 79 minutes).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

FLUSH_ROWS = 200_000


def write(
    checkpoint: Path, data: Path, count: int, out: Path, first: np.ndarray | None = None, batch: int = 2048
) -> None:
    """``out`` (count, D): ``first``'s rows, then distractors 0, 1, ... embedded; a run resumes from
    ``<out>.done``."""
    from icr.training.checkpoint import load_checkpoint
    from icr.training.data.synthetic.generate import DistractorStream, render_workers
    from icr.training.embedding import embed_image_batch, threads_beside_workers

    model, meta = load_checkpoint(checkpoint)
    head = 0 if first is None else len(first)
    done_file = out.with_name(out.name + ".done")
    start = int(done_file.read_text()) if done_file.exists() and out.exists() else 0
    dim = meta.embed_dim
    rows = np.lib.format.open_memmap(
        out, mode="r+" if start else "w+", dtype=np.float32, shape=(count, dim)
    )  # (count, D)
    if first is not None:
        rows[:head] = first
    stream = DistractorStream.for_dataset(data, count - head)
    workers = render_workers()
    t0, flushed = time.perf_counter(), start
    with threads_beside_workers(workers, "cpu"):
        for ks, images, _ in stream.batches(batch, start, workers=workers):
            rows[head + ks[0] : head + ks[-1] + 1] = embed_image_batch(model, images)
            done = int(ks[-1]) + 1
            if done - flushed >= FLUSH_ROWS or done == count - head:
                rows.flush()
                tmp = done_file.with_name(done_file.name + ".tmp")
                tmp.write_text(str(done))
                os.replace(tmp, done_file)
                rate = (done - start) / (time.perf_counter() - t0)
                print(f"{done:,} of {count - head:,} distractors, {rate:,.0f}/s", flush=True)
                flushed = done
    rows.flush()


def queries(checkpoint: Path, data: Path, n: int, seed: int = 0) -> np.ndarray:
    """(n, D) embeddings of ``n`` test captions drawn without replacement (``seed``)."""
    from icr.training.checkpoint import load_checkpoint
    from icr.training.data.training_data import open_split
    from icr.training.embedding import embed_captions

    model, _ = load_checkpoint(checkpoint)
    captions = open_split(data, "test").captions
    pick = np.random.default_rng(seed).choice(len(captions), n, replace=False)
    return np.ascontiguousarray(embed_captions(model, [captions[k] for k in pick]), dtype=np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="the embedded benchmark (icr data synth)")
    parser.add_argument("--count", type=int, required=True, help="rows in all, --first's included")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--first", type=Path, help="(n, D) float32 .npy placed before the distractors")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--query-out", type=Path)
    args = parser.parse_args()
    first = None if args.first is None else np.load(args.first).astype(np.float32)
    write(args.checkpoint, args.data, args.count, args.out, first)
    if args.query_out is not None:
        np.save(args.query_out, queries(args.checkpoint, args.data, args.queries))


if __name__ == "__main__":
    main()
