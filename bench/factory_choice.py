"""Re-run ``--factory auto``'s measured choice on an inverted-file index already built, without
rebuilding it: the same candidates, queries (the build's held-out captions, same seed), targets
and rule as ``icr index build`` (:mod:`index.factory_choice`).

    python -m bench.factory_choice --index bench-work/index-1000000 --exact bench-work/exact-1000000 \\
        --checkpoint bench-work/model/best --data bench-work/data --json out.json

The index's coarse quantizer is reset to a scan of its centroids first, so an index whose build
kept the HNSW coarse quantizer is measured from the same starting point as a fresh build.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import faiss
import numpy as np

from icr.index.build import (
    DEFAULT_MEMORY_BUDGET,
    DEPTH_TARGET,
    NPROBE_TARGET,
    RECALL_K,
    RECALL_QUERIES,
    SEARCH_DEPTH,
)
from icr.index.factory_choice import Targets, choose_by_measurement, swap_quantizer
from icr.index.index_folder import load_index_dir
from icr.index.vector_index import ExactTopK, exact_depth


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--index", type=Path, required=True, help="an IVF index folder (icr index build)")
    parser.add_argument("--exact", type=Path, required=True, help="its Flat twin (the same vectors)")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="the dataset folder of the index's split")
    parser.add_argument("--seed", type=int, default=0, help="the build's seed (picks the held-out captions)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from icr.training.checkpoint import load_checkpoint
    from icr.training.data.training_data import open_split
    from icr.training.embedding import embed_captions

    index, manifest, meta = load_index_dir(args.index)
    meta.close()
    ivf = faiss.extract_index_ivf(index)
    scan = faiss.IndexFlat(ivf.d, ivf.metric_type)
    scan.add(ivf.quantizer.reconstruct_n(0, ivf.nlist))  # (nlist, D) the same centroids
    swap_quantizer(index, scan)
    data = open_split(args.data, manifest.data["split"])
    rng = np.random.default_rng(args.seed)  # as the build picks its recall queries
    pick = np.sort(rng.choice(len(data.captions), min(RECALL_QUERIES, len(data.captions)), replace=False))
    model, _ = load_checkpoint(args.checkpoint)
    queries = np.ascontiguousarray(embed_captions(model, [data.captions[i] for i in pick]), np.float32)
    flat, _, meta = load_index_dir(args.exact)
    meta.close()
    exact = ExactTopK(queries, max(exact_depth(RECALL_K), exact_depth(SEARCH_DEPTH)))
    for start in range(0, flat.ntotal, 65_536):
        exact.add(flat.reconstruct_n(start, min(65_536, flat.ntotal - start)))
    del flat
    factory = f"IVF{ivf.nlist}," + manifest.factory.partition(",")[2]
    t0 = time.perf_counter()
    choice = choose_by_measurement(
        index,
        factory,
        "rule-based start",
        exact,
        queries,
        Targets(RECALL_K, NPROBE_TARGET, SEARCH_DEPTH, DEPTH_TARGET),
        memory_budget_bytes=DEFAULT_MEMORY_BUDGET,
        log=print,
    )
    seconds = time.perf_counter() - t0
    print(f"kept {choice.factory} after {seconds:.1f} s of measuring")
    if args.json:
        report = {
            "index": str(args.index),
            "built_with": manifest.factory,
            "kept": choice.factory,
            "seconds": seconds,
            "reason": choice.reason,
            "trials": choice.trials_json(),
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
