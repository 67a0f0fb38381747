"""What query filters cost: selecting the ids (SQL over the metadata + a FAISS bitmap), and a filtered
search at the service's depth against the unfiltered one.

* **select**: a metadata store of N rows with user fields (``album``: one of 10, ``year``: 2000-2024,
  ``rating``: 0-5) like a photo folder's; per filter, the cold cost (SQLite scan with
  ``json_extract``, then the bitmap) and a cached repeat, with how many ids it selects.
* **search**: the benchmark's ANN index through :class:`service.retriever.Retriever`, one query at a
  time, unfiltered and with ``is_distractor`` filters selecting about 1 % (the test images) and
  99 % (the distractors); p50/p99 of the search stage (filtered: unfiltered search for the
  calibration's list + filtered search + relevance).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.markdown import table
from bench.stats import latency

SELECT_FILTERS: dict[str, dict[str, Any]] = {
    "album = one of 10 (~10 %)": {"album": "a3"},
    "year in a 5-year range (~20 %)": {"year": {"gte": 2010, "lt": 2015}},
    "album in 3 values + rating > 2.5 (~15 %)": {"album": {"in": ["a1", "a2", "a3"]}, "rating": {"gt": 2.5}},
    "is_distractor = false (built-in column, ~0.1 %)": {"is_distractor": False},
}


def _store(path: Path, n: int) -> None:
    from icr.index.metadata import MetadataStore

    rng = np.random.default_rng(0)
    albums, years, ratings = rng.integers(0, 10, n), rng.integers(2000, 2025, n), rng.random(n) * 5

    def rows() -> Any:
        for i in range(n):
            yield {
                "id": i,
                "source": f"photos/{i:08d}.jpg",
                "is_distractor": i >= n // 1000,
                "fields": {
                    "album": f"a{albums[i]}",
                    "year": int(years[i]),
                    "rating": round(float(ratings[i]), 2),
                },
            }

    with MetadataStore.create(path) as store:
        store.add(rows())


def select(workdir: Path, n: int, log: Any) -> dict[str, Any]:
    from icr.index.filters import FilterCache, parse_filter
    from icr.index.metadata import MetadataStore

    path = workdir / f"filter-metadata-{n}.sqlite"
    if not path.is_file():
        log(f"filters: writing a metadata store of {n:,} rows with user fields")
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        _store(tmp, n)
        tmp.rename(path)
    out = {}
    with MetadataStore.open(path) as store:
        for name, spec in SELECT_FILTERS.items():
            cache = FilterCache(store, n)
            parsed = parse_filter(spec, ["album", "year", "rating"])
            assert parsed is not None
            t0 = time.perf_counter()
            selection, _ = cache.select(parsed)
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            cache.select(parsed)
            warm = time.perf_counter() - t0
            out[name] = {"selected": len(selection.ids), "cold_ms": cold * 1e3, "cached_ms": warm * 1e3}
    return {"rows": n, "filters": out}


def search(checkpoint: Path, index_dir: Path, captions: list[str], depth: int, log: Any) -> dict[str, Any]:
    from icr.index.filters import parse_filter
    from icr.service.retriever import Retriever

    log(f"filters: filtered search at depth {depth} on {index_dir.name}")
    retriever = Retriever.load(index_dir, checkpoint, gpu="off")
    target = retriever.images
    queries = [(retriever.encode_text(c), c) for c in captions]
    out: dict[str, Any] = {"depth": depth, "queries": len(queries), "ntotal": target.manifest.ntotal}
    for name, spec in (
        ("none", None),
        ("test images only", {"is_distractor": False}),
        ("distractors only", {"is_distractor": True}),
    ):
        parsed = parse_filter(spec, [])
        times, matched = [], None
        for query, text in queries:
            timings: dict[str, float] = {}
            page = retriever.search(
                target, query, k=10, offset=0, depth=depth, text=text, filter_=parsed, timings=timings
            )
            times.append((timings["search_ms"] + timings["filter_ms"]) / 1e3)
            matched = page.matched
        out[name] = {"matched": matched, "latency": latency(times[1:])}  # the first pays the selection
    return out


def markdown(section: dict[str, Any]) -> list[str]:
    select, found = section["select"], section["search"]
    lines = [f"## Query filters: selecting ids in a metadata store of {select['rows']:,} rows", ""]
    lines += table(
        ["filter", "ids selected", "cold ms (SQL + bitmap)", "cached ms"],
        [[name, r["selected"], r["cold_ms"], r["cached_ms"]] for name, r in select["filters"].items()],
    )
    lines += [
        f"Search stage at depth {found['depth']} over {found['ntotal']:,} vectors, {found['queries']} "
        "caption queries, one at a time (filtered: the unfiltered list for the calibration, then FAISS over "
        "the selected ids):",
        "",
    ]
    rows = [
        [name, "-" if r["matched"] is None else r["matched"], r["latency"]["p50_ms"], r["latency"]["p99_ms"]]
        for name, r in found.items()
        if isinstance(r, dict)
    ]
    return lines + table(["filter", "matched", "p50 ms", "p99 ms"], rows)
