"""The ``cluster`` section: the ways to serve one index on this machine, through HTTP, side by side.

Layouts (all over the same ANN index folder, the same checkpoint, the same text queries):

* ``single``: ``icr serve`` as it is, one process;
* ``workers-N``: ``icr serve --workers N`` (one process per core, each with its own copy of the
  index), and ``workers-N-mmap`` (ICR_MMAP=true: one memory-mapped copy for all);
* ``ray-S``: the index cut into S shards (``icr index shard``), ``icr serve --shards --ray`` on a
  local Ray: S shard applications and the coordinator, all on this machine.

For each: p50/p99 and queries/s for 1 and 16 clients (:func:`bench.search_http.load`).

The coordinator's own cost is measured apart, from a Ray driver calling the shard applications as
the coordinator does (:class:`service.sharded_index.ShardSet`): per query, the wall time of the
scatter minus the slowest shard's own time in its replica (the hop: serialising, Ray's routing, two
process switches) and the merge of the S top-``depth`` lists. The projection to S machines:
latency(S) ~ shard(N) / S + hop + merge(S) (:func:`_projection`).
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.markdown import table
from bench.search_http import Server, load
from bench.stats import latency

SHARDS = (1, 2, 4)
QUICK_SHARDS = (2,)


def _layouts(
    index: Path, workdir: Path, workers: int, shards: tuple[int, ...], log: Callable[[str], None]
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each layout's ``icr serve`` arguments and environment."""
    from icr.index.shard import shard_index

    many = ["--index", str(index), "--workers", str(workers)]
    layouts = {
        "single": (["--index", str(index)], {}),
        f"workers-{workers}": (many, {}),
        f"workers-{workers}-mmap": (many, {"ICR_MMAP": "true"}),
    }
    for s in shards:
        folder = workdir / f"shards-{s}"
        if not _cut_already(index, folder, s):
            log(f"cluster: cutting {index.name} into {s} shard(s)")
            shutil.rmtree(folder, ignore_errors=True)
            shard_index(index, folder, s)
        layouts[f"ray-{s}"] = (["--shards", str(folder), "--ray"], {})
    return layouts


def _cut_already(index: Path, folder: Path, shards: int) -> bool:
    """Whether ``folder`` holds the ``shards`` shards of this very build of ``index`` from an earlier
    run, in the current format (a shard records its id range)."""
    from icr.index.manifest import MANIFEST_FILE, Manifest

    source = Manifest.read(index / MANIFEST_FILE)
    try:
        cut = [Manifest.read(folder / f"shard-{k}-of-{shards}" / MANIFEST_FILE) for k in range(shards)]
    except (FileNotFoundError, ValueError):
        return False
    build = (source.checkpoint_sha256, source.created)
    return all(m.id_range is not None and (m.checkpoint_sha256, m.created) == build for m in cut)


def _coordinator_cost(
    index: Path,
    checkpoint: Path,
    workdir: Path,
    captions: list[str],
    depth: int,
    shard_counts: tuple[int, ...],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Per shard count: the hop and the merge per query, and one shard's own search time."""
    import ray
    from ray import serve

    from icr.index.live_state import merge
    from icr.index.vector_index import recall_of_ids
    from icr.service.cli import shard_folders
    from icr.service.config import Settings
    from icr.service.ray_serving import RayShard, deploy_shards, undeploy
    from icr.service.sharded_index import ShardSet
    from icr.training.checkpoint import load_checkpoint

    model, _ = load_checkpoint(checkpoint, "cpu")
    with torch.inference_mode():
        queries = model.encode_text(model.tokenize(captions)).float().numpy()  # (Q, D)
    exact = _exact_top(index, queries, depth)
    settings = Settings(index=index, gpu="off")
    ray.init(log_to_driver=False)
    out: dict[str, Any] = {}
    try:
        serve.start(http_options={"location": "NoServer"})  # handles only: no HTTP proxy
        for s in shard_counts:
            names = deploy_shards(settings, shard_folders(workdir / f"shards-{s}"))
            shards = ShardSet([RayShard(name) for name in names], timeout_s=60)
            hop, merged, own, found = [], [], [], []
            for q in queries:
                t0 = time.perf_counter()
                answers, _ = shards.ask(dict.fromkeys(range(s), (q[None, :], depth, None)), "search")
                t1 = time.perf_counter()
                _, ids = merge(depth, *((h.scores[0], h.ids[0]) for h in answers.values()))
                t2 = time.perf_counter()
                found.append(ids)
                slowest = max(h.seconds for h in answers.values())
                hop.append(t1 - t0 - slowest)
                merged.append(t2 - t1)
                own.append(slowest)
            out[str(s)] = {
                "hop": latency(hop),
                "merge": latency(merged),
                "shard_search": latency(own),
                **{f"recall_at_{k}": recall_of_ids(found, *exact, k) for k in (10, depth)},
            }
            p50 = {
                name: statistics.median(x) * 1e3
                for name, x in (("hop", hop), ("merge", merged), ("own", own))
            }
            log(
                f"cluster: {s} shard(s), p50 ms: hop {p50['hop']:.2f}, merge {p50['merge']:.3f}, "
                f"shard {p50['own']:.2f}"
            )
            undeploy(names, started=False)
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def _exact_top(index: Path, queries: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids), each (Q, exact_depth(depth)): the exact search of ``queries`` (Q, D) over the
    index's stored vectors, deep enough to count ties (:func:`index.vector_index.recall_of_ids`)."""
    from icr.index.index_folder import load_index_dir
    from icr.index.vector_index import ExactTopK, exact_depth, stored_vectors

    ann, manifest, metadata = load_index_dir(index)
    metadata.close()
    read = stored_vectors(ann)
    assert read is not None, f"{index}: its index cannot give its vectors back"
    exact = ExactTopK(queries, exact_depth(depth))
    for start in range(0, manifest.ntotal, 65_536):  # streamed: never all N vectors, nor Q x N scores
        exact.add(read(np.arange(start, min(start + 65_536, manifest.ntotal))))  # (b, D)
    return exact.scores, exact.ids


def _projection(cost: dict[str, Any]) -> dict[str, Any]:
    """latency(S machines) ~ shard(N) / S + hop + merge(S): one shard's own search time over all N
    vectors (measured with 1 shard) divided by S (the same lists probed, 1/S of their vectors), the
    hop as measured with 1 shard (no shard competing for this machine's cores; a network adds its
    round trip), the merge of S lists as measured; medians."""
    alone = cost.get("1")
    if alone is None:
        return {}
    shard, hop = alone["shard_search"]["p50_ms"], alone["hop"]["p50_ms"]
    out = {}
    for s, c in cost.items():
        parts = {"shard_search": shard / int(s), "hop": hop, "merge": c["merge"]["p50_ms"]}
        out[s] = {**parts, "latency_ms": sum(parts.values())}
    return out


def run(
    index: Path,
    checkpoint: Path,
    captions: list[str],
    workdir: Path,
    quick: bool,
    log: Callable[[str], None],
    workers: int = 2,
) -> dict[str, Any]:
    """Every layout through HTTP, then the coordinator's cost and the projection."""
    from icr.index.manifest import MANIFEST_FILE, Manifest

    manifest = Manifest.read(index / MANIFEST_FILE)
    workdir.mkdir(parents=True, exist_ok=True)
    per_client = 10 if quick else 60
    out: dict[str, Any] = {
        "index": {"vectors": manifest.ntotal, "factory": manifest.factory, "dim": manifest.dim},
        "per_client": per_client,
        "layouts": {},
    }
    shards = QUICK_SHARDS if quick else SHARDS
    for name, (args, extra) in _layouts(index, workdir, workers, shards, log).items():
        log(f"cluster: {name}")
        env = {"ICR_WRITES": "false", "ICR_WATCH_SECONDS": "0", **extra}
        with Server(index, checkpoint, workdir / f"serve-{name}.log", env, serve_args=args) as server:
            load(server, captions, 1, 10)  # warm-up
            out["layouts"][name] = {str(c): load(server, captions, c, per_client) for c in (1, 16)}
    single = out["layouts"]["single"]
    many = out["layouts"][f"workers-{workers}"]
    out["workers_gain"] = {
        "workers": workers,
        "one_client_qps": single["1"]["queries_per_s"],
        "sixteen_clients_qps": many["16"]["queries_per_s"],
        "ratio": many["16"]["queries_per_s"] / single["1"]["queries_per_s"],
        "single_process_ratio": single["16"]["queries_per_s"] / single["1"]["queries_per_s"],
    }
    cost = _coordinator_cost(index, checkpoint, workdir, captions[: 50 if quick else 200], 1000, shards, log)
    out["coordinator"] = cost
    out["projection"] = _projection(cost)
    return out


def markdown(section: dict[str, Any]) -> list[str]:
    ix = section["index"]
    rows = [
        [
            name,
            c,
            r["latency"]["p50_ms"],
            r["latency"]["p99_ms"],
            r["queries_per_s"],
            "-" if name.startswith("ray") else r.get("server_cores"),
            "-" if name.startswith("ray") else r.get("server_cpu_ms_per_query"),
            r["errors"],
        ]
        for name, by_clients in section["layouts"].items()
        for c, r in by_clients.items()
    ]
    gain = section["workers_gain"]
    mapped = section["layouts"].get(f"workers-{gain['workers']}-mmap", {}).get("16")
    cost_rows = [
        [
            s,
            c["shard_search"]["p50_ms"],
            c["hop"]["p50_ms"],
            c["hop"]["p99_ms"],
            c["merge"]["p50_ms"],
            f"{c['recall_at_10']:.3f}",
            f"{c['recall_at_1000']:.3f}",
        ]
        for s, c in section["coordinator"].items()
    ]
    projected = [
        [s, *(p[k] for k in ("shard_search", "hop", "merge", "latency_ms"))]
        for s, p in section["projection"].items()
    ]
    return [
        f"## Serving layouts on this machine: {ix['vectors']:,} vectors, `{ix['factory']}` (dim {ix['dim']})",
        "",
        f"`POST /v1/search/text` (k 10, depth 1,000), {section['per_client']} requests per client; "
        "`single`: `icr serve`; `workers-N`: `--workers N` (`-mmap`: ICR_MMAP=true); `ray-S`: "
        "`--shards --ray` with S shards, "
        "coordinator and shards on this machine's cores.",
        "",
        *table(
            ["layout", "clients", "p50 ms", "p99 ms", "queries/s", "server cores", "CPU ms/query", "errors"],
            rows,
        ),
        f"16 clients on the workers: {gain['sixteen_clients_qps']:.0f} queries/s, "
        f"{gain['ratio']:.2f}x one client on one process ({gain['one_client_qps']:.0f}/s); one process "
        f"with 16 clients: {gain['single_process_ratio']:.2f}x"
        + (
            f"; the workers on one memory-mapped copy: "
            f"{mapped['queries_per_s'] / gain['one_client_qps']:.2f}x."
            if mapped
            else "."
        ),
        "",
        "The coordinator's own cost per query (a Ray driver scattering to the shard applications as the "
        "coordinator does; the hop is the call's wall time less the slowest shard's own time), and the "
        "merged top 1,000's recall against exact search over the same vectors (tie-aware, as every "
        "recall here):",
        "",
        *table(
            [
                "shards",
                "shard search p50 ms",
                "hop p50 ms",
                "hop p99 ms",
                "merge p50 ms",
                "recall@10",
                "recall@1000",
            ],
            cost_rows,
        ),
    ] + (
        [
            "Projected latency of the scatter with each shard on its own machine (one shard's search "
            "over all vectors / S + the hop measured with one shard + the merge of S lists, medians; "
            "add the network's round trip and the HTTP ingress):",
            "",
            *table(["shards (machines)", "shard ms", "hop ms", "merge ms", "latency ms"], projected),
        ]
        if projected
        else []
    )
