"""What an inverted file trains on, when the collection streams in order: its first vectors (what
``build_index`` takes from a stream) against a random sample of all of them (what ``icr index
build`` trains on since 2026-11-27, :func:`index.build._trained_on_all`).

The vectors: unit vectors around 256 group centres with 16 sub-centres each (the neighbour structure
of ``bench/gpu_device/scale.py``), streamed one group after another, as a photo folder listed by path
streams one trip after another. 500 held-out queries from the same mixture; recall@10 and
recall@1000 against exact search (tie-aware), per nprobe, for the re-ranked fast-scan factory and
for ``IVF,Flat``.

    python -m bench.training_sample [--vectors 200000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

GROUPS, SUBS, DIM, QUERIES = 256, 16, 128, 500
NPROBES = (16, 32, 64, 128)


def ordered_stream(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """((n, D) vectors sorted by group, (QUERIES, D) held-out queries), all unit length."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((GROUPS, DIM)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    subs = rng.standard_normal((GROUPS * SUBS, DIM)).astype(np.float32) / DIM**0.5
    pick = rng.integers(0, GROUPS * SUBS, n + QUERIES)
    noise = rng.standard_normal((n + QUERIES, DIM)).astype(np.float32) / DIM**0.5
    x = centres[pick // SUBS] + 0.7 * subs[pick] + 0.5 * noise  # (n + Q, D)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    order = np.argsort(pick[:n] // SUBS, kind="stable")  # one group after another
    return np.ascontiguousarray(x[:n][order]), x[n:]


def measure(n: int) -> dict[str, Any]:
    import faiss

    from icr.index.rerank import RerankedIndex, is_reranked
    from icr.index.vector_index import build_index, random_training_sample, recall_per_query, set_nprobe

    vectors, queries = ordered_stream(n)
    exact = faiss.IndexFlatIP(DIM)
    exact.add(vectors)
    nlist = int(4 * np.sqrt(n))
    out: dict[str, Any] = {"vectors": n, "dim": DIM, "groups": GROUPS, "queries": QUERIES, "rows": []}
    for factory in (f"IVF{nlist},PQ{DIM // 2}x4fs,RFlat", f"IVF{nlist},Flat"):
        for trained_on in ("first vectors", "random sample"):
            sample = random_training_sample(vectors, factory) if trained_on == "random sample" else None
            stream = iter(np.array_split(vectors, 50))  # consumed once, as a build's stream
            index: Any = build_index(stream, DIM, factory, train_sample=sample, gpu="off")
            if is_reranked(factory):
                index = RerankedIndex(index, vectors)
            row: dict[str, Any] = {"factory": factory, "trained_on": trained_on}
            for nprobe in NPROBES:
                set_nprobe(index, nprobe)
                row[f"nprobe_{nprobe}"] = {
                    "recall_at_10": float(recall_per_query(index, exact, queries, 10).mean()),
                    "recall_at_1000": float(recall_per_query(index, exact, queries, 1000).mean()),
                }
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vectors", type=int, default=200_000)
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    report = measure(args.vectors)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
