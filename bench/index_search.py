"""Single-query search latency of a built index directory, with the query text encoding timed apart.

    python -m bench.index_search --index DIR [--queries 1000] [--k 10] [--threads 1]

Queries are the captions of the index's own split (its manifest names checkpoint, data and split),
encoded once with the checkpoint; each is then searched alone (batch of 1), as a search service
does. Reports p50 / p99 / mean of the FAISS search and of the caption encoding, the FAISS thread
count used (on 2 cores one thread is fastest for single queries: the default two threads take the
slower database-parallel path), and the manifest's recall check. Writes
``bench/results/index-search-<host>-<date>.json`` (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import socket
import time
from pathlib import Path

import faiss
import numpy as np

from icr.index.index_folder import load_index_dir


def _percentiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "mean_ms": float(a.mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--index", type=Path, required=True)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="FAISS OpenMP threads (0: FAISS default)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from icr.training.checkpoint import load_checkpoint
    from icr.training.data.training_data import open_split
    from icr.training.embedding import embed_captions

    index, manifest, metadata = load_index_dir(args.index)
    metadata.close()
    if args.threads:
        faiss.omp_set_num_threads(args.threads)
    model, _ = load_checkpoint(manifest.checkpoint_path)
    captions = open_split(manifest.data["path"], manifest.data["split"]).captions[: args.queries]
    encode_ms = []
    for caption in captions[:200]:  # one caption at a time, as a request would
        t0 = time.perf_counter()
        embed_captions(model, [caption])
        encode_ms.append(1000 * (time.perf_counter() - t0))
    queries = embed_captions(model, captions)  # (Q, D)
    index.search(queries[:10], args.k)  # warm-up: page in the lists
    search_ms = []
    for q in queries:
        t0 = time.perf_counter()
        index.search(q[None, :], args.k)
        search_ms.append(1000 * (time.perf_counter() - t0))
    report = {
        "benchmark": "index-search",
        "host": socket.gethostname(),
        "date": dt.date.today().isoformat(),
        "index": str(args.index),
        "factory": manifest.factory,
        "ntotal": manifest.ntotal,
        "recall_check": manifest.recall_check,
        "faiss_threads": faiss.omp_get_max_threads(),
        "queries": len(search_ms),
        "k": args.k,
        "search": _percentiles(search_ms),
        "encode_caption": _percentiles(encode_ms),
    }
    out = args.out or Path("bench/results") / f"index-search-{socket.gethostname()}-{report['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps(
            {
                k: report[k]
                for k in ("factory", "ntotal", "faiss_threads", "search", "encode_caption", "recall_check")
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
