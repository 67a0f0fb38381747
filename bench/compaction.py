"""Compaction of a living index (:mod:`icr.index.live_compact`) timed on its own:

* ``scale``: the ``writes`` section's base of unit vectors with adds in batches and a share of the
  base deleted, compacted as an exact index and as an inverted file over the same vectors, then
  loaded as a server would (the folder, then the log's later writes);
* ``drift``: an inverted file over random unit vectors to which images from a few tight clusters
  are added (one user's new albums): the lists' imbalance with the writes applied, and after the
  retraining it triggers.

    python -m bench.compaction [--base 1000000] [--adds 100000] [--deletes 10000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench import writes


def scale(base: int, adds: int, deletes: int, log: Any) -> list[dict[str, Any]]:
    from icr.index.live_index import LiveIndex
    from icr.index.vector_index import build_index

    with tempfile.TemporaryDirectory(prefix="icr-bench-compaction-") as tmp:
        folder = Path(tmp)
        index, metadata = writes._base(folder, base)
        path = folder / "state" / "writes.sqlite"
        live = LiveIndex(index, metadata, path, "bench")
        rng = np.random.default_rng(1)
        for start in range(0, adds, 1000):
            live.add(writes._images(rng, min(1000, adds - start), f"b{start}-"), "bench")
        live.delete([int(i) for i in rng.choice(base, deletes, replace=False)], "bench")
        live.close()
        log(f"compaction: {base:,} + {adds:,} - {deletes:,}, exact")
        out = [writes._compaction(folder, index, metadata, path, "Flat")]
        nlist = int(4 * np.sqrt(base))
        ivf = build_index(writes._vectors_of(index), writes.DIM, f"IVF{nlist},Flat", gpu="off")
        log(f"compaction: the same as IVF{nlist},Flat")
        out.append(writes._compaction(folder, ivf, metadata, path, f"IVF{nlist},Flat"))
        metadata.close()
    return out


def drift(base: int, adds: int, clusters: int, log: Any) -> dict[str, Any]:
    from icr.index.live_index import LiveIndex
    from icr.index.live_writes import NewImage
    from icr.index.vector_index import build_index

    with tempfile.TemporaryDirectory(prefix="icr-bench-drift-") as tmp:
        folder = Path(tmp)
        flat, metadata = writes._base(folder, base)
        nlist = int(2 * np.sqrt(base))
        ivf = build_index(writes._vectors_of(flat), writes.DIM, f"IVF{nlist},Flat", gpu="off")
        path = folder / "state" / "writes.sqlite"
        live = LiveIndex(ivf, metadata, path, "bench")
        rng = np.random.default_rng(3)
        centres = writes._unit(rng, clusters)
        for start in range(0, adds, 1000):
            v = centres[rng.integers(0, clusters, 1000)] + 0.05 * rng.standard_normal((1000, writes.DIM))
            v = (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)  # (1000, D)
            live.add([NewImage(x, {"source": f"n{start}-{k}.jpg"}) for k, x in enumerate(v)], "bench")
        live.close()
        log(f"compaction: IVF{nlist},Flat over {base:,} + {adds:,} clustered adds")
        out = writes._compaction(folder, ivf, metadata, path, f"IVF{nlist},Flat")
        metadata.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=int, default=1_000_000)
    ap.add_argument("--adds", type=int, default=100_000)
    ap.add_argument("--deletes", type=int, default=10_000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    say = lambda m: print(m, flush=True)  # noqa: E731, T201
    result = {
        "scale": scale(args.base, args.adds, args.deletes, say),
        "drift": drift(args.base // 5, args.adds, 8, say),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)  # noqa: T201


if __name__ == "__main__":
    main()
