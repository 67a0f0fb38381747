"""Calibration from a user's labels, measured on the demo index: what min_relevance 0.5 / 0.8 delivers.

Simulated labelling on the embedded benchmark's served index (``icr demo``'s ``index/images``): val
captions of even-numbered images search the index as the service does (depth 1,000, the tuned
nprobe); a "user" labels 10 hits of each of ``labels / 10`` of them, judged by the generator's
ground truth, either the first page (``top10``) or 10 random ranks of the first 100 (``scroll``).
The lower-bound map and the queries' evidence are fitted on those labels exactly as
``icr index calibrate --labels`` fits them. Captions of the odd-numbered val images (nobody labelled
them, and none was written for a gallery image) then search the same index; every hit to depth
1,000 is judged, and per target the table gives the bound the labels report where the threshold
falls, the precision the passed hits deliver (queries inside the evidence), how many pass, and the
out-of-fold figure the report shows the user.

    python -m bench.label_calibration --demo icr-demo --policy top10 --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from icr.index.calibration import search_hits, searchable_index
from icr.index.manifest import Manifest
from icr.training.checkpoint import load_checkpoint
from icr.training.data.synthetic.generate import DistractorStream, split_scene_table
from icr.training.data.synthetic.scene import SceneTable
from icr.training.data.training_data import open_split
from icr.training.embedding import embed_captions
from icr.training.evaluation.calibration_check import synthetic_hits
from icr.training.evaluation.metrics.label_bounds import fit_label_map, out_of_fold
from icr.training.evaluation.metrics.query_evidence import QueryEvidence

TARGETS = (0.5, 0.8)


def run(demo: Path, policy: str, label_counts: tuple[int, ...], seeds: int) -> dict[str, Any]:
    index_dir, data = demo / "index" / "images", demo / "data"
    manifest = Manifest.read(index_dir)
    model, config = load_checkpoint(manifest.checkpoint_path)
    split = open_split(data, "val", captions_per_image=config.captions_per_image)
    captions = split.captions
    scores, ids = search_hits(searchable_index(index_dir, manifest), embed_captions(model, captions), 1000)
    table = SceneTable.concat(
        [
            split_scene_table(data, manifest.data["split"]),
            DistractorStream.for_dataset(data, manifest.distractor_count).scene_table(),
        ]
    )
    hits = synthetic_hits(captions, scores, ids, table, manifest.gallery_count, judge_distractors=False)
    pool = np.flatnonzero(split.img_of_cap % 2 == 0)
    fresh = np.flatnonzero(split.img_of_cap % 2 == 1)
    out: dict[str, Any] = {"policy": policy, "fresh_queries": len(fresh), "runs": {}}
    for n_labels in label_counts:
        runs = []
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            queries = rng.choice(pool, n_labels // 10, replace=False)
            if policy == "top10":
                ranks = np.tile(np.arange(10), (len(queries), 1))
            else:
                ranks = np.stack([rng.choice(100, 10, replace=False) for _ in queries])
            s = np.take_along_axis(scores[queries], ranks, 1).ravel()
            r = np.take_along_axis(hits.relevant[queries], ranks, 1).ravel()
            labelled = np.take_along_axis(ids[queries], ranks, 1).ravel()
            texts = [captions[q] for q in queries for _ in range(10)]
            relevance_map, blocks = fit_label_map(s, r)
            evidence = QueryEvidence.fit([captions[q] for q in queries])
            oof = out_of_fold(texts, labelled.tolist(), s, r, TARGETS)
            inside = np.array([evidence.assess(captions[q]).inside for q in fresh])
            relevance = relevance_map(scores[fresh])  # (F, 1000)
            row: dict[str, Any] = {
                "seed": seed,
                "labels_relevant": float(r.mean()),
                "inside": int(inside.sum()),
            }
            for t in TARGETS:
                reached = [b for b in blocks if b.bound >= t]
                passed = (relevance >= t) & hits.judged[fresh] & inside[:, None]
                row[str(t)] = {
                    "bound": reached[0].bound if reached else None,
                    "passed": int(passed.sum()),
                    "delivered": float(hits.relevant[fresh][passed].mean()) if passed.any() else None,
                    "oof": oof["targets"][str(t)],
                }
            runs.append(row)
            print(n_labels, json.dumps(row), file=sys.stderr)
        out["runs"][str(n_labels)] = runs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--demo", type=Path, default=Path("icr-demo"), help="What `icr demo` wrote.")
    parser.add_argument("--policy", choices=("top10", "scroll"), default="top10")
    parser.add_argument("--labels", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = run(args.demo, args.policy, tuple(args.labels), args.seeds)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
