"""Threshold honesty after a living index changes: the calibration fitted on the index as built,
served unchanged while 50 % more images are added and while 50 % of them are deleted (issue 41).

The model is the same, so the map from score to relevance stays; what moves is each query's score
list (its per-query features), which the gallery's size and content shape. On an embedded-benchmark
index with generated distractors (the `icr demo` index) every image has a ground truth: the added
images are further generated distractors (rendered and embedded by the index's checkpoint, added
through the write log), the deleted ones a random half of the build. The held-out test captions
search the live index as the service does (depth 1,000) and the served map's promises are judged:
precision delivered at each ``min_relevance``, and per query the mean relevance of the top 20
against the share of them that is relevant.

    python -m bench.live_honesty INDEX_DIR [--fraction 0.5] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

BATCH = 512


def run(
    index_dir: Path, log: Callable[[str], None], fraction: float = 0.5, depth: int = 1000
) -> dict[str, Any]:
    from icr.index.calibration import CALIBRATION_FILE, ServedCalibration, searchable_index
    from icr.index.live_index import LiveIndex
    from icr.index.live_writes import NewImage
    from icr.index.manifest import Manifest
    from icr.index.metadata import MetadataStore
    from icr.training.checkpoint import load_checkpoint
    from icr.training.data.synthetic.generate import DistractorStream, split_scene_table
    from icr.training.data.synthetic.ground_truth import relevance_mask
    from icr.training.data.synthetic.parse import parse_caption
    from icr.training.data.synthetic.scene import SceneTable
    from icr.training.data.training_data import open_split
    from icr.training.embedding import embed_captions, embed_image_batch
    from icr.training.evaluation.calibration_check import honesty_report, synthetic_hits

    manifest = Manifest.read(index_dir)
    data = Path(manifest.data["path"])
    if manifest.data.get("distractor_source") not in (None, "generator") or not manifest.distractor_count:
        raise ValueError(
            f"{index_dir}: needs an embedded-benchmark index with generated distractors (icr demo)"
        )
    served = ServedCalibration.read(index_dir / CALIBRATION_FILE)
    model, config = load_checkpoint(Path(manifest.checkpoint_path), "cpu")
    index = searchable_index(index_dir, manifest)
    metadata = MetadataStore.open(index_dir / "metadata.sqlite")
    n, g, d = index.ntotal, manifest.gallery_count, manifest.distractor_count
    extra = int(round(fraction * n))
    stream = DistractorStream.for_dataset(data, d + extra)  # distractor k is the same image whatever n is
    table = SceneTable.concat([split_scene_table(data, manifest.data["split"]), stream.scene_table()])
    split = open_split(data, manifest.data["split"], captions_per_image=config.captions_per_image)
    texts = split.captions
    emb = embed_captions(model, texts, progress=False)  # (Q, D)
    unknown = [model.unknown_words(t) for t in texts]
    maps = {"per_query": served.per_query, "global": served.global_map}

    parsed = [parse_caption(t) for t in texts]

    def judged(live: LiveIndex, present: np.ndarray) -> dict[str, Any]:
        """The served map judged on ``live``'s searches; ``present`` (rows of ``table``) the images
        it holds, for each query's count of relevant images (deleted or not yet added: not counted)."""
        state = live.refresh()
        scores = np.full((len(texts), depth), -1.0, np.float32)
        ids = np.full((len(texts), depth), -1, np.int64)
        for q in range(len(texts)):
            s, i = live.search(emb[q : q + 1], depth, state)
            scores[q, : len(s)], ids[q, : len(i)] = s, i
            scores[q, len(s) :] = s[-1] if len(s) else -1.0
        hits = synthetic_hits(texts, scores, ids, table, g, judge_distractors=True)
        masks = [relevance_mask(query, table) & present for query in parsed]  # (M,) each
        hits = dataclasses.replace(
            hits,
            n_relevant=np.array([m.sum() for m in masks]),
            n_relevant_judged=np.array([m[g:].sum() for m in masks]),
        )
        report = honesty_report(hits, emb, texts, maps, served.evidence, unknown)
        return {"images": state.size, **{name: _pooled(r) for name, r in report.items()}}

    out: dict[str, Any] = {"index": index_dir.name, "images": n, "queries": len(texts), "depth": depth}
    log(f"live honesty: {n:,} images as built, {len(texts):,} held-out captions")
    present = np.arange(len(table)) < n
    out["as_built"] = judged(LiveIndex(index, metadata, None, "as-built"), present)
    with tempfile.TemporaryDirectory() as tmp:
        live = LiveIndex(index, metadata, Path(tmp) / "plus.sqlite", "plus")
        t0 = time.perf_counter()
        for ks, images, _ in stream.batches(BATCH, start=d):
            vectors = embed_image_batch(model, images)  # (b, D)
            live.add(
                [NewImage(v, {"source": f"distractor:{int(k)}"}) for k, v in zip(ks, vectors, strict=True)],
                "bench",
            )
        log(f"live honesty: {extra:,} generated images added in {time.perf_counter() - t0:.1f} s")
        out["added"] = {"images_added": extra, **judged(live, np.ones(len(table), bool))}
        live.close()
        live = LiveIndex(index, metadata, Path(tmp) / "minus.sqlite", "minus")
        gone = np.random.default_rng(0).choice(n, size=int(round(fraction * n)), replace=False)
        for start in range(0, len(gone), 10_000):
            live.delete([int(i) for i in gone[start : start + 10_000]], "bench")
        present[gone] = False
        out["deleted"] = {"images_deleted": len(gone), **judged(live, present)}
        live.close()
    metadata.close()
    return out


def _pooled(report: dict[str, Any]) -> dict[str, Any]:
    """Pooled and per kind: precision delivered at each min_relevance (``threshold``) and per-query
    promised-vs-delivered at the top 20 (``queries``)."""
    queries = report["queries"]
    return {
        "threshold": report["pooled"],
        "queries": queries["pooled"],
        "by_kind": {
            k: {"threshold": v, "queries": queries["by_kind"].get(k)} for k, v in report["by_kind"].items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("index", type=Path)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = run(args.index, lambda m: print(m, flush=True), args.fraction)  # noqa: T201
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)  # noqa: T201


if __name__ == "__main__":
    main()
