"""`icr index calibrate --labels`: a user's labels on a real photo index, scored as the service scores
its hits, fitted into a served calibration.json, with every bad labels file named and explained."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from icr import cli
from icr.index.build import build_photo_index
from icr.index.calibration import CALIBRATION_FILE, ServedCalibration
from icr.index.calibration_transfer import transfer_calibration
from icr.index.label_calibration import calibrate_from_labels, read_labels
from icr.training.checkpoint import load_checkpoint
from icr.training.data.karpathy import load_image, load_karpathy
from icr.training.embedding import embed_captions, embed_image_batch
from icr.training.evaluation.metrics.label_bounds import fit_label_map

pytestmark = pytest.mark.usefixtures("faiss_one_thread")


@pytest.fixture(scope="module")
def photo_index(tiny_checkpoint: Path, tiny_benchmark: Path, tmp_path_factory) -> Path:
    """The tiny benchmark's 64 image files indexed as a user's photo folder (no captions, no truth)."""
    out = tmp_path_factory.mktemp("photo-index") / "idx"
    build_photo_index(  # on the CPU, as the test's oracle (a GPU embeds ~1e-4 apart: TF32 convolutions)
        tiny_checkpoint, images=tiny_benchmark / "images", out=out, progress=False, gpu="off", device="cpu"
    )
    return out


def _labels(tiny_benchmark: Path, path: Path) -> tuple[list[dict], dict[str, str]]:
    """Every val/test caption against every val/test image, relevant when it is the image's own
    caption; images named three ways (absolute path, file name, path in the gallery folder)."""
    records = [im for split in ("val", "test") for im in load_karpathy(tiny_benchmark).split(split).images]
    rows, own = [], {}
    for image in records:
        for caption in image.captions:
            own[caption] = image.filename
    for caption, owner in own.items():
        for k, image in enumerate(records):
            name = [str(image.path), image.filename, f"./{image.filename}"][k % 3]
            rows.append({"query": caption, "image": name, "relevant": int(owner == image.filename)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows, own


def test_labels_fit_a_served_lower_bound_map(tiny_checkpoint, tiny_benchmark, photo_index, tmp_path) -> None:
    labels_file = tmp_path / "labels.jsonl"
    rows, _ = _labels(tiny_benchmark, labels_file)
    out = calibrate_from_labels(photo_index, labels_file, device="cpu", progress=False, min_block=20)
    report = out["label_report"]
    assert report["labels"] == report["used"] == len(rows) and report["beyond_depth"] == 0
    # each distinct caption against the 24 val/test images, relevant on its own image
    assert report["relevant"] == sum(r["relevant"] for r in rows) == report["queries"] >= 110
    assert report["images"] == 24

    # oracle: the same map fitted on exact scores computed here (the index is exact: Flat)
    model, _ = load_checkpoint(tiny_checkpoint)
    names = sorted({Path(r["image"]).name for r in rows})
    vectors = embed_image_batch(model, [load_image(tiny_benchmark / "images" / n) for n in names])
    vector_of = dict(zip(names, vectors, strict=True))
    queries = sorted({r["query"] for r in rows})
    text = dict(zip(queries, embed_captions(model, queries), strict=True))
    scores = np.array([float(text[r["query"]] @ vector_of[Path(r["image"]).name]) for r in rows])
    relevant = np.array([bool(r["relevant"]) for r in rows])
    expected, blocks = fit_label_map(scores, relevant, 0.95, 20)
    got = out["global"]
    assert np.allclose(got["y"], expected.y) and np.allclose(got["x"], expected.x, atol=1e-5)
    assert [(b["labels"], b["relevant"]) for b in report["blocks"]] == [(b.n, b.relevant) for b in blocks]
    assert [b["lower_bound"] for b in report["blocks"]] == [round(b.bound, 4) for b in blocks]

    # what the service reads: a global map, the labelled queries' words as evidence
    served = ServedCalibration.read(photo_index / CALIBRATION_FILE)
    assert served.method == "global" and served.info["labels"] == "user"
    assert "Clopper-Pearson" in (served.labels_note or "")
    assert served.evidence is not None
    assert served.evidence.assess(queries[0]).inside and not served.evidence.assess("qwerty zxcvb").inside
    # below every labelled score no promise; above, never more than the labels can back
    assert served.relevance(np.array([scores.min() - 0.5]), None)[0] == 0.0
    top = served.relevance(np.array([scores.max()]), None)[0]
    assert 0 < top <= blocks[-1].relevant / blocks[-1].n
    for t, entry in report["thresholds"].items():
        if entry["reached"]:
            assert entry["precision_above"] >= float(t) and entry["more_labels"] >= 0


def test_the_cli_prints_what_the_labels_support(photo_index, tiny_benchmark, tmp_path) -> None:
    labels_file = tmp_path / "labels.csv"
    rows, _ = _labels(tiny_benchmark, tmp_path / "labels.jsonl")
    labels_file.write_text(
        "query,image,relevant\n" + "".join(f'"{r["query"]}",{r["image"]},{r["relevant"]}\n' for r in rows)
    )
    result = CliRunner().invoke(
        cli.app,
        ["index", "calibrate", str(photo_index), "--labels", str(labels_file), "--device", "cpu", "--quiet"],
    )
    assert result.exit_code == 0, result.output
    assert f"{len(rows):,} of {len(rows):,} labels used" in result.output
    assert "more labels for +-0.05" in result.output and "wrote" in result.output


def test_bad_labels_are_named_with_the_fix(photo_index, tiny_benchmark, tmp_path) -> None:
    def labels(*rows: dict) -> Path:
        path = tmp_path / "bad.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    ok = {"query": "a red circle", "image": 0, "relevant": 1}
    with pytest.raises(ValueError, match=r"row 2: no relevant; every row needs query, image, relevant"):
        read_labels(labels(ok, {"query": "x", "image": 1}))
    with pytest.raises(ValueError, match=r"row 1: relevant must be true/false, 0/1 or a grade"):
        read_labels(labels({**ok, "relevant": "maybe"}))
    with pytest.raises(ValueError, match=r"row 1: query must be non-empty text"):
        read_labels(labels({**ok, "query": "  "}))
    with pytest.raises(ValueError, match="labels must be .jsonl"):
        read_labels(tmp_path / "labels.txt") if (tmp_path / "labels.txt").write_text("x") else None
    # graded labels: relevant from a grade up
    graded = read_labels(labels({**ok, "relevant": 2}, {**ok, "relevant": 1}), relevant_from=2)
    assert [g.relevant for g in graded] == [True, False]
    with pytest.raises(
        ValueError, match=r"1 labelled image\(s\) are not in this index \(row 2: 'nowhere.png'\)"
    ):
        calibrate_from_labels(
            photo_index, labels(ok, {**ok, "image": "nowhere.png"}), device="cpu", progress=False
        )
    with pytest.raises(ValueError, match="none of the 1 labelled pairs is among its query's top 1 hits"):
        far = {"query": "a red circle", "image": 63, "relevant": 1}
        calibrate_from_labels(photo_index, labels(far), depth=1, device="cpu", progress=False)
    # a path relative to wherever the photo folder is (here images/...): the one file ending with it
    relative = calibrate_from_labels(
        photo_index,
        labels({**ok, "image": "images/synth_test_000000.png"}, ok),
        device="cpu",
        progress=False,
    )
    assert relative["label_report"]["used"] == 2
    with pytest.raises(ValueError, match="no labelled hit is relevant"):
        calibrate_from_labels(photo_index, labels({**ok, "relevant": 0}), device="cpu", progress=False)


def test_a_new_collection_gets_a_transferred_calibration_said_so(
    tiny_checkpoint, tiny_benchmark, photo_index, tmp_path
) -> None:
    labels_file = tmp_path / "labels.jsonl"
    _labels(tiny_benchmark, labels_file)
    fitted = calibrate_from_labels(photo_index, labels_file, device="cpu", progress=False)
    fresh = tmp_path / "fresh"
    build_photo_index(tiny_checkpoint, images=tiny_benchmark / "images", out=fresh, progress=False, gpu="off")
    out = transfer_calibration(fresh, photo_index)
    served = ServedCalibration.read(fresh / CALIBRATION_FILE)
    assert served.info["labels"] == "transferred" and "not on this one" in (served.labels_note or "")
    assert out["transferred_from"]["labels"] == "user" and out["global"] == fitted["global"]
    assert "label_report" not in out  # the source's evaluation measured another collection
    # the applicability check comes along: a query unlike the fitted ones still gets nothing
    assert served.evidence is not None and not served.evidence.assess("qwerty zxcvb").inside
    # not empty: the best scores still get a relevance
    assert served.relevance(np.array([max(fitted["global"]["x"])]), None)[0] > 0
    # a transfer of a transfer names the first origin
    again = tmp_path / "again"
    build_photo_index(tiny_checkpoint, images=tiny_benchmark / "images", out=again, progress=False, gpu="off")
    assert (
        transfer_calibration(again, fresh / CALIBRATION_FILE)["transferred_from"] == out["transferred_from"]
    )
    # another checkpoint's calibration does not transfer
    foreign = json.loads((photo_index / CALIBRATION_FILE).read_text()) | {"checkpoint_sha256": "0" * 64}
    (tmp_path / "foreign.json").write_text(json.dumps(foreign))
    with pytest.raises(ValueError, match="only transfers between indices of the same checkpoint"):
        transfer_calibration(fresh, tmp_path / "foreign.json")
    with pytest.raises(FileNotFoundError, match="no calibration to transfer"):
        transfer_calibration(fresh, tmp_path)


def test_feedback_labels_are_kept_per_index_and_refit(photo_index, tiny_benchmark, tmp_path) -> None:
    from icr.index.feedback_labels import FeedbackStore, index_key
    from icr.index.manifest import Manifest

    store = FeedbackStore(tmp_path / "state" / "feedback.sqlite")
    manifest = Manifest.read(photo_index)
    key = index_key(manifest.checkpoint_sha256, manifest.created)
    store.add(key, "a red circle", 3, True, "ana")
    store.add(key, "a red circle", 3, False, "ana")  # ana changes her mind: one verdict, the last
    store.add(key, "a red circle", 4, True, "ana")
    store.add(key, "a red circle", 4, False, "bo")  # a tie between judges: not relevant
    store.add(key, "a blue square", 4, True, "bo")
    store.add("another:index", "a red circle", 5, True, "ana")  # another index's label stays apart
    again = FeedbackStore(tmp_path / "state" / "feedback.sqlite")  # reopened: nothing acknowledged is lost
    assert sorted((x.query, x.image, x.relevant) for x in again.labels(key)) == [
        ("a blue square", 4, True),
        ("a red circle", 3, False),
        ("a red circle", 4, False),
    ]
    counts = again.counts(key)
    assert (counts.judgements, counts.hits, counts.queries, counts.relevant) == (4, 3, 2, 1)

    # labels given on the page's served hits refit the index: the README's labels, given as feedback
    rows, _ = _labels(tiny_benchmark, tmp_path / "labels.jsonl")
    from icr.index.index_folder import load_index_dir

    _, _, metadata = load_index_dir(photo_index)
    with metadata:
        ids = {Path(r["source"]).name: r["id"] for r in metadata.get(range(metadata.count()))}
    fresh = FeedbackStore(tmp_path / "fresh.sqlite")
    for r in rows:
        fresh.add(key, r["query"], ids[Path(r["image"]).name], bool(r["relevant"]), "ana")
    result = CliRunner().invoke(
        cli.app,
        [
            "index",
            "calibrate",
            str(photo_index),
            "--from-feedback",
            str(tmp_path / "fresh.sqlite"),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    written = json.loads((photo_index / CALIBRATION_FILE).read_text())
    assert written["label_report"]["file"] == "feedback" and written["label_report"]["used"] == len(rows)
    both = CliRunner().invoke(
        cli.app,
        [
            "index",
            "calibrate",
            str(photo_index),
            "--from-feedback",
            str(tmp_path / "state" / "feedback.sqlite"),
            "--labels",
            "x.jsonl",
        ],
    )
    assert both.exit_code != 0 and "pick one" in both.output
