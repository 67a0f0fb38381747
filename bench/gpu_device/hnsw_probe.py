"""Why `--factory auto`'s HNSW trial measured recall@10 0.000 on a GPU-built IVF index (H200,
2026-11-27): build the same IVF,Flat on the GPU and on the CPU from one set of vectors, then compare
what the HNSW trial reads (``reconstruct_batch`` through a direct map) with the vectors added, the
lists' ids, and the recall of graphs built from each. Prints one JSON object per line.

    python3 bench/gpu_device/hnsw_probe.py [N]
    python3 bench/gpu_device/hnsw_probe.py trial [N]   # the trial itself, as `icr index build` runs it

The first probe (2026-11-27) ruled out the reconstructed vectors. ``trial`` runs the build's own
``choose_by_measurement`` (an ExactTopK fed in id order, 200 held-out queries, depth 1,000) on the
GPU-built and the CPU-built inverted file, then searches each trial graph at efSearch 1,000 / 2,000 /
4,000 for k = 10 and k = 1,000 directly, with and without per-call parameters, against brute force.
"""

from __future__ import annotations

import json
import sys

import faiss
import numpy as np

from icr.index.factory_choice import Targets, _graph, choose_by_measurement
from icr.index.vector_index import ExactTopK, build_index, exact_depth, search


def clustered(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(n // 100, 1), dim), dtype=np.float32)
    x = centres[rng.integers(0, len(centres), n)] + 0.6 * rng.standard_normal((n, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def list_ids(ivf: faiss.IndexIVF) -> np.ndarray:
    inv = ivf.invlists
    out = [faiss.rev_swig_ptr(inv.get_ids(i), inv.list_size(i)).copy() for i in range(ivf.nlist)]
    return np.concatenate(out)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth, strict=True)]))


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_200
    x = clustered(n, 128)
    queries = x[:500]
    exact = faiss.IndexFlatIP(128)
    exact.add(x)
    _, truth = exact.search(queries, 10)
    wheres = ("gpu", "cpu") if faiss.get_num_gpus() > 0 else ("cpu",)
    for where in wheres:
        report: dict[str, str] = {}
        index = build_index(x, 128, "IVF1266,Flat", gpu="on" if where == "gpu" else "off", report=report)
        ivf = faiss.extract_index_ivf(index)
        ivf.nprobe = 64
        ids = list_ids(ivf)
        row: dict[str, object] = {
            "built": where,
            "report": report,
            "type": type(faiss.downcast_index(ivf)).__name__,
            "invlists": type(faiss.downcast_InvertedLists(ivf.invlists)).__name__,
            "ids_sorted_equal_arange": bool(np.array_equal(np.sort(ids), np.arange(n))),
            "code_size": ivf.code_size,
        }
        _, found = index.search(queries, 10)
        row["ivf_recall10"] = recall(found, truth)
        ivf.make_direct_map()
        rec = ivf.reconstruct_batch(np.arange(n))
        row["reconstruct_max_abs_err"] = float(np.abs(rec - x).max())
        row["reconstruct_rows_equal"] = int((np.abs(rec - x).max(axis=1) < 1e-6).sum())
        one = np.stack([ivf.reconstruct(int(i)) for i in range(0, n, n // 50)])
        row["reconstruct_one_max_abs_err"] = float(np.abs(one - x[:: n // 50][: len(one)]).max())
        if row["reconstruct_rows_equal"] < n:  # where the reconstructed row comes from
            nearest = exact.search(rec[:20], 1)[1][:, 0]
            row["reconstructed_rows_are_vectors"] = nearest.tolist()
        graph = _graph(ivf, np.arange(n))
        ivf.set_direct_map_type(faiss.DirectMap.NoMap)
        graph.hnsw.efSearch = 256
        _, found = graph.search(queries, 10)
        row["hnsw_from_reconstruct_recall10"] = recall(found, truth)
        print(json.dumps(row), flush=True)


def trial(n: int) -> None:
    x = clustered(n + 200, 128)
    x, queries = x[:n], x[n:]  # held out, as the build's queries are
    brute = faiss.IndexFlatIP(128)
    brute.add(x)
    _, truth10 = brute.search(queries, 10)
    _, truth1000 = brute.search(queries, 1000)
    wheres = ("gpu", "cpu") if faiss.get_num_gpus() > 0 else ("cpu",)
    for where in wheres:
        exact = ExactTopK(queries, exact_depth(1000))  # as the build keeps it
        for start in range(0, n, 65_536):
            exact.add(x[start : start + 65_536])
        index = build_index(x, 128, "IVF1266,Flat", gpu="on" if where == "gpu" else "off")
        choice = choose_by_measurement(
            index,
            "IVF1266,Flat",
            "probe",
            exact,
            queries,
            Targets(10, 0.98, 1000, 0.95),
            memory_budget_bytes=8 << 30,
            log=lambda m, w=where: print(f"[{w}] {m}", flush=True),
        )
        print(
            json.dumps({"built": where, "kept": choice.factory, "trials": choice.trials_json()}), flush=True
        )
        ivf = faiss.extract_index_ivf(index)
        ivf.make_direct_map()
        graph = _graph(ivf, np.arange(n))
        ivf.set_direct_map_type(faiss.DirectMap.NoMap)
        for ef in (1000, 2000, 4000):
            graph.hnsw.efSearch = ef
            _, f10 = graph.search(queries, 10)
            _, f1000 = graph.search(queries, 1000)
            _, p10 = search(graph, queries, 10)  # the project's search(), as recall_per_query calls it
            row = {
                "built": where,
                "efSearch": ef,
                "recall10": recall(f10, truth10),
                "recall1000": recall(f1000, truth1000),
                "recall10_via_search": recall(p10, truth10),
                "minus_one_ids_k1000": int((f1000 < 0).sum()),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trial":
        trial(int(sys.argv[2]) if len(sys.argv) > 2 else 100_200)
    else:
        main()
