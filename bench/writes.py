"""What a living index's writes cost (:mod:`icr.index.live_index`), on a synthetic base of unit vectors
with photo-like metadata:

* **upsert throughput**: embeddings added per second in batches of 1,000 and one per request (each a
  durable SQLite commit: ``synchronous=FULL``);
* **replay**: opening the index over a log of ``writes`` adds (a server's start-up, or a second
  server catching up);
* **search**: p50/p99 of one query at the service's depth with the log's added images and 1 % of the
  base deleted, while 1 and 4 writer threads add images one at a time in the same process (as a
  server's write requests would), and over the read-only base index alone;
* **uploads** (:func:`uploads`, where the bench built a gallery): images per second through a real
  ``icr serve``'s ``POST /v1/images:upload`` (decoded, embedded by the checkpoint, stored and
  committed per request), from 1 and 4 concurrent clients.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.markdown import table
from bench.stats import latency

DIM = 128
DEPTH = 1000


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)  # (n, D)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _base(folder: Path, n: int) -> tuple[Any, Any]:
    from icr.index.metadata import MetadataStore
    from icr.index.vector_index import build_index

    rng = np.random.default_rng(0)
    index = build_index(_unit(rng, n), DIM, "Flat", gpu="off")
    with MetadataStore.create(folder / "metadata.sqlite") as store:
        store.add({"id": i, "source": f"{i}.jpg", "fields": {"year": 2000 + i % 25}} for i in range(n))
    return index, MetadataStore.open(folder / "metadata.sqlite")


def _folder(folder: Path, index: Any, factory: str) -> Path:
    """An index folder of the bench's base (index.faiss, metadata.sqlite linked, a manifest)."""
    from icr.index.manifest import Manifest
    from icr.index.vector_index import save_index

    built = folder / f"built-{factory.replace(',', '-')}"
    built.mkdir()
    save_index(index, built / "index.faiss")
    (built / "metadata.sqlite").hardlink_to(folder / "metadata.sqlite")
    manifest = Manifest(
        modality="image", checkpoint_sha256="0" * 64, checkpoint_path="bench", dim=DIM, factory=factory,
        factory_reason="bench", ntotal=index.ntotal, gallery_count=index.ntotal, distractor_count=0,
        recall_check={"k": 10, "recall": None, "queries": 0}, build_seconds=0.0, peak_rss_mb=0.0,
        created="2026-11-27T00:00:00+00:00", data={"path": "bench", "split": "bench"},
    )  # fmt: skip
    (built / "manifest.json").write_text(manifest.to_json())
    return built


def _compaction(folder: Path, index: Any, metadata: Any, log_path: Path, factory: str) -> dict[str, Any]:
    """Compaction of the base with the log's writes (``factory``: the base index's), and the start-up
    of a server over the compacted folder (load, replay of the writes after it)."""
    from icr.index.index_folder import load_index_dir
    from icr.index.live_compact import compact
    from icr.index.live_index import LiveIndex, base_ids

    built = _folder(folder, index, factory)
    live = LiveIndex(index, metadata, log_path, "bench")
    out = folder / f"compacted-{factory.replace(',', '-')}"
    report = compact(live, built, out)
    live.close()
    t0 = time.perf_counter()
    compacted, manifest, store = load_index_dir(out)
    LiveIndex(compacted, store, log_path, "bench", base=base_ids(out, manifest)).close()
    store.close()
    return {**report, "factory": factory, "load_seconds": time.perf_counter() - t0}


def _vectors_of(index: Any) -> np.ndarray:
    return np.asarray(index.reconstruct_n(0, index.ntotal), np.float32)  # (N, D)


def _images(rng: np.random.Generator, n: int, prefix: str) -> list[Any]:
    from icr.index.live_writes import NewImage

    return [
        NewImage(v, {"source": f"{prefix}{k}.jpg", "fields": {"year": 2030}})
        for k, v in enumerate(_unit(rng, n))
    ]


def _search_latency(live: Any, queries: np.ndarray) -> dict[str, float]:
    for q in queries[:10]:  # untimed: the first searches page the index in
        live.search(q[None, :], DEPTH, live.state)
    times = []
    for q in queries:
        t0 = time.perf_counter()
        live.search(q[None, :], DEPTH, live.state)
        times.append(time.perf_counter() - t0)
    return latency(times)


def _search_while_writing(live: Any, queries: np.ndarray, writers: int) -> dict[str, float]:
    """Search latency while ``writers`` threads add one image per durable commit, and their rate."""
    stop = threading.Event()
    counts = [0] * writers

    def write(k: int) -> None:
        local = np.random.default_rng(100 + k)
        while not stop.is_set():
            live.add(_images(local, 1, f"w{k}-{counts[k]}-"), "bench")
            counts[k] += 1

    threads = [threading.Thread(target=write, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    measured = _search_latency(live, queries)
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    return {**measured, "writes_per_s": sum(counts) / elapsed}


def run(base_size: int, writes: int, queries: int, log: Any) -> dict[str, Any]:
    from icr.index.live_index import LiveIndex
    from icr.index.vector_index import build_index

    rng = np.random.default_rng(1)
    out: dict[str, Any] = {"base": base_size, "writes": writes, "depth": DEPTH}
    with tempfile.TemporaryDirectory(prefix="icr-bench-writes-") as tmp:
        folder = Path(tmp)
        index, metadata = _base(folder, base_size)
        path = folder / "state" / "writes.sqlite"
        live = LiveIndex(index, metadata, path, "bench")
        qs = _unit(rng, queries)

        log(f"writes: {writes:,} adds in batches of 1,000")
        t0 = time.perf_counter()
        for start in range(0, writes, 1000):
            live.add(_images(rng, min(1000, writes - start), f"b{start}-"), "bench")
        out["batch_1000_per_s"] = writes / (time.perf_counter() - t0)
        single = min(500, writes)
        t0 = time.perf_counter()
        for image in _images(rng, single, "s"):
            live.add([image], "bench")
        out["single_per_s"] = single / (time.perf_counter() - t0)
        dead = rng.choice(base_size, base_size // 100, replace=False)
        live.delete([int(i) for i in dead], "bench")
        live.close()

        log("writes: replaying the log")
        t0 = time.perf_counter()
        replayed = LiveIndex(index, metadata, path, "bench")
        out["replay_seconds"] = time.perf_counter() - t0
        out["replayed_writes"] = replayed.state.seq
        out["search_after_writes"] = _search_latency(replayed, qs)

        for writers in (1, 4):
            out[f"search_with_{writers}_writers"] = _search_while_writing(replayed, qs, writers)
        # the read-only index last, in the same process state as the others (measured first, it ran
        # 1x-2x slower from run to run while the fresh build's pages were still being written back)
        out["search_base"] = _search_latency(LiveIndex(index, metadata, None, "bench"), qs)
        replayed.close()
        log(f"writes: compacting {base_size:,} + {writes:,} (exact index)")
        out["compaction"] = [_compaction(folder, index, metadata, path, "Flat")]
        nlist = int(4 * np.sqrt(base_size))  # an inverted file over the same vectors, as --factory auto picks
        ivf = build_index(_vectors_of(index), DIM, f"IVF{nlist},Flat", gpu="off")
        log(f"writes: compacting the same as IVF{nlist},Flat")
        out["compaction"].append(_compaction(folder, ivf, metadata, path, f"IVF{nlist},Flat"))
        metadata.close()
    return out


def uploads(
    index: Path, checkpoint: Path, images: list[Path], log: Any, clients: tuple[int, ...] = (1, 4)
) -> dict:
    """{"images", "clients": {n: {"images_per_s", "p50_ms", ...}}}: every file of ``images`` uploaded
    by each number of concurrent clients to a server over ``index`` with a fresh state directory (a
    new image each time: no external id)."""
    from bench.search_http import Server

    payloads = [(p.name, p.read_bytes()) for p in images]
    out: dict[str, Any] = {"images": len(payloads), "clients": {}}
    key = os.environ.get("ICR_ADMIN_KEY")  # the server inherits it: writes need it then
    headers = {"X-API-Key": key} if key else {}
    with tempfile.TemporaryDirectory(prefix="icr-bench-uploads-") as tmp:
        with Server(index, checkpoint, Path(tmp) / "serve.log", env={"ICR_STATE_DIR": tmp}) as server:
            url = f"http://127.0.0.1:{server.port}/v1/images:upload"
            for n in clients:
                log(f"writes: {len(payloads)} uploads from {n} client(s)")
                out["clients"][str(n)] = _upload_round(url, payloads, n, headers)
    return out


def _upload_round(url: str, payloads: list[tuple[str, bytes]], clients: int, headers: dict[str, str]) -> dict:
    import httpx

    times: list[float] = []
    errors: list[str] = []

    def client(part: list[tuple[str, bytes]]) -> None:
        with httpx.Client(timeout=120, headers=headers) as http:
            for name, data in part:
                t0 = time.perf_counter()
                r = http.post(url, files={"file": (name, data, "image/png")})
                times.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors.append(f"{r.status_code}: {r.text[:200]}")

    threads = [threading.Thread(target=client, args=(payloads[k::clients],)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"uploads failed ({len(errors)} of {len(payloads)}): {errors[0]}")
    return {"images_per_s": len(payloads) / wall, **latency(times)}


def markdown(section: dict[str, Any]) -> list[str]:
    s = section
    lines = [
        "## Writes (a living index)",
        "",
        f"Base: {s['base']:,} unit vectors (dim {DIM}, exact index); a log of {s['replayed_writes']:,} "
        f"writes ({s['writes']:,} adds in batches, single adds, 1 % of the base deleted); searches at "
        f"depth {DEPTH}.",
        "",
        f"- upserts: {s['batch_1000_per_s']:,.0f} embeddings/s in batches of 1,000; "
        f"{s['single_per_s']:,.0f}/s one per durable commit",
        f"- replaying the log at start-up: {s['replay_seconds']:.2f} s",
        "",
    ]
    rows = [
        [name, s[key]["p50_ms"], s[key]["p99_ms"], s[key].get("writes_per_s", "")]
        for name, key in (
            ("base alone", "search_base"),
            ("after the writes", "search_after_writes"),
            ("while 1 writer adds", "search_with_1_writers"),
            ("while 4 writers add", "search_with_4_writers"),
        )
    ]
    lines += table(["search", "p50 ms", "p99 ms", "writes/s meanwhile"], rows)
    rows = [
        [c["factory"], c["vectors"], c["removed"], c["added"], c["seconds"], c["load_seconds"],
         c["imbalance_before"] or "", c["imbalance_with_writes"] or "", c["imbalance_after"] or "",
         "yes" if c["retrained"] else "no"]
        for c in s.get("compaction", [])
    ]  # fmt: skip
    if rows:
        lines += ["", "Compaction (a fresh folder of the live images; then a server's load of it):", ""]
        lines += table(
            [
                "base",
                "vectors",
                "removed",
                "added",
                "seconds",
                "load s",
                "imbalance before",
                "with writes",
                "after",
                "retrained",
            ],
            rows,
        )
    up = s.get("uploads")
    if up is None:
        return lines + ["", "Uploads: not measured (they need the bench's gallery and checkpoint)."]
    lines += [
        "",
        f"Uploads through `POST /v1/images:upload` ({up['images']} PNG images, a real `icr serve`):",
        "",
    ]
    rows = [[n, c["images_per_s"], c["p50_ms"], c["p99_ms"]] for n, c in up["clients"].items()]
    return lines + table(["clients", "images/s", "p50 ms", "p99 ms"], rows)
