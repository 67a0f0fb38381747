"""The ``cluster`` section: the ways to serve one index on this machine, through HTTP, side by side.

Layouts (all over the same ANN index folder, the same checkpoint, the same text queries):

* ``single``: ``icr serve`` as it is, one process;
* ``workers-N``: ``icr serve --workers N`` (one process per core, one memory-mapped index);
* ``ray-S``: the index cut into S shards (``icr index shard``), ``icr serve --shards --ray`` on a
  local Ray: S shard applications and the coordinator, all on this machine.

For each: p50/p99 and queries/s for 1 and 16 clients (:func:`bench.search_http.load`).

The coordinator's own cost is measured apart, from a Ray driver calling the shard applications as
the coordinator does (:class:`service.sharded_index.ShardSet`): per query, the wall time of the
scatter minus the slowest shard's own time in its replica (the hop: serialising, Ray's routing, two
process switches) and the merge of the S top-``depth`` lists. The projection to S machines adds
them to one shard's measured search time: latency(S) ~ shard(N/S) + hop + merge(S).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.search_http import Server, load
from bench.stats import latency

SHARDS = (1, 2, 4)


def _layouts(index: Path, workdir: Path, workers: int, log: Callable[[str], None]) -> dict[str, list[str]]:
    from icr.index.shard import shard_index

    layouts = {
        "single": ["--index", str(index)],
        f"workers-{workers}": ["--index", str(index), "--workers", str(workers)],
    }
    for s in SHARDS:
        folder = workdir / f"shards-{s}"
        if not (folder / f"shard-{s - 1}-of-{s}").is_dir():
            log(f"cluster: cutting {index.name} into {s} shard(s)")
            shard_index(index, folder, s)
        layouts[f"ray-{s}"] = ["--shards", str(folder), "--ray"]
    return layouts


def _coordinator_cost(
    index: Path, checkpoint: Path, workdir: Path, captions: list[str], depth: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Per shard count: the hop and the merge per query, and one shard's own search time."""
    import ray
    from ray import serve

    from icr.index.live_state import merge
    from icr.service.cli import shard_folders
    from icr.service.config import Settings
    from icr.service.ray_serving import RayShard, ShardDeployment, shard_app_name
    from icr.service.sharded_index import ShardSet
    from icr.training.checkpoint import load_checkpoint

    model, _ = load_checkpoint(checkpoint, "cpu")
    with torch.inference_mode():
        queries = model.encode_text(model.tokenize(captions)).float().numpy()  # (Q, D)
    settings = Settings(index=index)
    ray.init(log_to_driver=False)
    out: dict[str, Any] = {}
    try:
        serve.start(http_options={"location": "NoServer"})  # handles only: no HTTP proxy
        for s in SHARDS:
            for k, folder in enumerate(shard_folders(workdir / f"shards-{s}")):
                app = ShardDeployment.bind(str(folder.resolve()), "off", settings.faiss_threads, 64, True)
                serve.run(app, name=shard_app_name(k), route_prefix=None)
            shards = ShardSet([RayShard(shard_app_name(k)) for k in range(s)], timeout_s=60)
            hop, merged, own = [], [], []
            for q in queries:
                t0 = time.perf_counter()
                answers, _ = shards.ask(dict.fromkeys(range(s), (q[None, :], depth, None)), "search")
                t1 = time.perf_counter()
                merge(depth, *((h.scores[0], h.ids[0]) for h in answers.values()))
                t2 = time.perf_counter()
                slowest = max(h.seconds for h in answers.values())
                hop.append(t1 - t0 - slowest)
                merged.append(t2 - t1)
                own.append(slowest)
            out[str(s)] = {"hop": latency(hop), "merge": latency(merged), "shard_search": latency(own)}
            p50 = {
                name: statistics.median(x) * 1e3
                for name, x in (("hop", hop), ("merge", merged), ("own", own))
            }
            log(
                f"cluster: {s} shard(s), p50 ms: hop {p50['hop']:.2f}, merge {p50['merge']:.3f}, "
                f"shard {p50['own']:.2f}"
            )
            for k in range(s):
                serve.delete(shard_app_name(k))
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def _projection(cost: dict[str, Any]) -> dict[str, Any]:
    """latency(S machines) ~ one shard's search over N/S + the hop + the merge of S lists, from the
    medians measured on this machine (each shard alone on its machine: no core shared)."""
    out = {}
    for s, c in cost.items():
        parts = {k: c[k]["p50_ms"] for k in ("shard_search", "hop", "merge")}
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
    for name, args in _layouts(index, workdir, workers, log).items():
        log(f"cluster: {name}")
        env = {"ICR_WRITES": "false", "ICR_WATCH_SECONDS": "0"}
        with Server(index, checkpoint, workdir / f"serve-{name}.log", env, serve_args=args) as server:
            load(server, captions, 1, 10)  # warm-up
            out["layouts"][name] = {str(c): load(server, captions, c, per_client) for c in (1, 16)}
    single = out["layouts"]["single"]
    many = out["layouts"][f"workers-{workers}"]
    out["workers_gain"] = {
        "one_client_qps": single["1"]["queries_per_s"],
        "sixteen_clients_qps": many["16"]["queries_per_s"],
        "ratio": many["16"]["queries_per_s"] / single["1"]["queries_per_s"],
        "single_process_ratio": single["16"]["queries_per_s"] / single["1"]["queries_per_s"],
    }
    cost = _coordinator_cost(index, checkpoint, workdir, captions[: 50 if quick else 200], 1000, log)
    out["coordinator"] = cost
    out["projection"] = _projection(cost)
    return out
