"""Benchmark of the embedded benchmark's generator (not a test: no assertions on time).

    python -m bench.synth [--repeats 3]

Measures `icr data synth` at 2,000/200/200 images (the foundation target: under 60 s), the
distractor stream (rendered images/s, what a million-distractor index build has to feed) and
scene-only sampling plus vectorised relevance (what ground truth over 1M distractors costs).
Writes bench/results/synth-<host>-<date>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from icr.training.data.synthetic.generate import DistractorStream, write_dataset
from icr.training.data.synthetic.ground_truth import relevance_mask
from icr.training.data.synthetic.parse import parse_caption


def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def run(repeats: int) -> dict:
    rows = []

    def dataset() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            write_dataset(Path(tmp) / "s", train=2000, val=200, test=200)

    t = _timed(dataset, repeats)
    rows.append(("write_dataset 2000/200/200", "s", t, 2400))

    stream = DistractorStream(2000, seed=0)
    t = _timed(lambda: sum(1 for _ in stream.batches(256)), repeats)
    rows.append(("distractor images 2,000 (render, 64 px)", "s", t, 2000))

    scenes = DistractorStream(100_000, seed=0)
    t = _timed(lambda: scenes.scene_table(), repeats)
    rows.append(("distractor scene table 100,000 (no render)", "s", t, 100_000))

    table = scenes.scene_table()
    query = parse_caption("a red circle left of a blue square")
    t = _timed(lambda: relevance_mask(query, table), repeats)
    rows.append(("relevance of 1 relation caption over 100,000 scenes", "s", t, 100_000))

    results = [
        {
            "name": name,
            "unit": unit,
            "median": statistics.median(times),
            "min": min(times),
            "max": max(times),
            "items": items,
            "items_per_s": items / statistics.median(times),
        }
        for name, unit, times, items in rows
    ]
    return {
        "host": socket.gethostname(),
        "date": dt.date.today().isoformat(),
        "python": platform.python_version(),
        "cpu_count": __import__("os").cpu_count(),
        "repeats": repeats,
        "results": results,
    }


def markdown(report: dict) -> str:
    lines = [
        f"Synthetic generator, {report['host']}, {report['date']}, median of {report['repeats']} (min-max)",
        "",
        "| what | median s | min-max s | items/s |",
        "|---|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['name']} | {r['median']:.3f} | {r['min']:.3f}-{r['max']:.3f} | {r['items_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    report = run(args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"synth-{report['host']}-{report['date']}.json"
    path.write_text(json.dumps(report, indent=2))
    print(markdown(report))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
