"""`icr data features`: frozen "pretrained backbone" region features of the embedded benchmark.

One build on the shared tiny benchmark (module fixture, seconds): its precomp layout against the
Karpathy splits, ground truth through the manifest against the Karpathy split's (the oracle), the
held-out attribute metric against a baseline computed here, a precomp training run and its
evaluation (with generated distractors featurised by the kept backbone); and small separate builds
for the cache, the refusals and an interrupted build.
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from icr.training.config import load_config
from icr.training.data.errors import DatasetError
from icr.training.data.precomp import available_precomp_splits, load_precomp
from icr.training.data.synthetic import features as feats
from icr.training.data.synthetic import world
from icr.training.data.synthetic.generate import load_scenes
from icr.training.data.training_data import open_split, synthetic_dir, synthetic_source
from icr.training.evaluation.full_report import EvalOptions, evaluate_checkpoint, ground_truth_relevance

GRID, DIM = 3, 32
# 40 train images make one batch an epoch: 60 steps (~2 s) learn tone, empty cells and some
# shapes and colours (held-out cell mAP 0.23 against 0.08 for guessing).
EPOCHS = 60


def _build(data: Path, out: Path, **kw) -> dict:
    settings = {"grid": GRID, "dim": DIM, "epochs": EPOCHS, "seed": 0, "threads": 1, **kw}
    return feats.build_features(data, out, **settings)


@pytest.fixture(scope="module")
def built(tiny_benchmark: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("features") / "features"
    result = _build(tiny_benchmark, out)
    assert result["cached"] is False
    return out, result["manifest"]


def _small_copy(tiny_benchmark: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny benchmark (tests that move or edit the source)."""
    return Path(shutil.copytree(tiny_benchmark, tmp_path / "data"))


def test_precomp_layout_matches_the_karpathy_splits(built, tiny_benchmark):
    out, manifest = built
    assert available_precomp_splits(out) == ["dev", "test", "train"]
    assert manifest["splits"] == {"train": "train", "dev": "val", "test": "test"}
    assert manifest["source"]["resolved"] == str(tiny_benchmark.resolve())
    assert manifest["source"]["fingerprint"] == feats.source_fingerprint(tiny_benchmark)
    featurise = feats.load_featurizer(out)
    for name, split in manifest["splits"].items():
        precomp = load_precomp(out, name)
        karpathy = open_split(tiny_benchmark, split, preload=False)
        assert precomp.im_div == 5
        assert precomp.images.dtype == np.float32
        assert precomp.images.shape == (karpathy.num_images, GRID * GRID, DIM)
        assert precomp.captions == karpathy.captions  # same strings, same order: the parser applies
        assert manifest["counts"][name] == karpathy.num_images
        assert float(np.min(precomp.images)) >= 0.0  # post-ReLU cells
        # the kept backbone reproduces the rows from the split's images (dev rows = val images)
        pixels = np.stack([np.asarray(karpathy.get_image(i)) for i in range(karpathy.num_images)])
        np.testing.assert_allclose(featurise(pixels), precomp.images, rtol=1e-4, atol=1e-5)


def test_ground_truth_through_the_manifest_equals_the_karpathy_split(built, tiny_benchmark):
    out, _ = built
    for name, split in (("dev", "val"), ("test", "test")):
        precomp = open_split(out, name)
        assert precomp.kind == "precomp" and synthetic_dir(precomp) is None  # no images to read there
        assert synthetic_source(precomp) == (tiny_benchmark, split)
        truth = ground_truth_relevance(precomp)
        oracle = ground_truth_relevance(open_split(tiny_benchmark, split, preload=False))
        assert truth is not None and oracle is not None and truth.dense is not None
        np.testing.assert_array_equal(truth.dense, oracle.dense)
        assert truth.num_pairs() > len(precomp.captions)  # more than the annotations: captions match others


def _naive_cell_map(scenes) -> float:
    """Mean AP of a guess that ranks every cell alike: each label's prevalence over the 3 x 3 cells
    (at grid 3 an object's centre lies in its scene cell, row and col)."""
    labels = [*world.SHAPES, *world.COLOUR_NAMES, *world.SIZES, "empty"]
    counts = dict.fromkeys(labels, 0)
    cells = 0
    for scene in scenes:
        occupied = {(o.row, o.col): o for o in scene.objects}
        for r in range(3):
            for c in range(3):
                cells += 1
                o = occupied.get((r, c))
                for label in (o.shape, o.colour, o.size) if o else ("empty",):
                    counts[label] += 1
    return float(np.mean([n / cells for n in counts.values() if n]))


def test_backbone_beats_guessing_on_held_out_attributes(built, tiny_benchmark):
    _, manifest = built
    held_out = manifest["pretraining"]["held_out"]
    val = open_split(tiny_benchmark, "val", preload=False)
    from icr.training.data.karpathy import load_karpathy

    records = load_karpathy(tiny_benchmark).split("val").images
    scenes = load_scenes(tiny_benchmark).for_imgids([r.imgid for r in records])
    assert held_out["split"] == "val" and held_out["images"] == val.num_images
    baseline = _naive_cell_map(scenes)
    assert held_out["chance"]["cell_map"] == pytest.approx(baseline, abs=1e-4)
    assert held_out["cell_map"] > baseline + 0.05, (held_out, baseline)
    tones = [s.background.tone for s in scenes]
    majority = max(tones.count(t) for t in set(tones)) / len(tones)
    assert held_out["tone_accuracy"] > majority
    assert manifest["pretraining"]["seconds"] > 0 and manifest["backbone"]["file"] == "backbone.safetensors"


def test_precomp_training_and_evaluation_with_ground_truth_and_distractors(built, tmp_path):
    from icr.training.train import train

    out, _ = built
    run = tmp_path / "run"
    config = load_config(
        "synthetic-ntxent",
        [
            f'data.path="{out}"',
            f'train.out="{run}"',
            'data.val_split="dev"',
            # the whole table: the config's CNN keys (image_size) are not precomp keys
            f'model.image={{kind="precomp", feature_dim={DIM}, pooling="mean"}}',
            "model.embed_dim=32",
            "model.text.word_dim=16",
            "model.text.hidden=32",
            "train.batch_size=20",
            "train.epochs=1",
            "train.threads=1",
            "data.val_images=12",
            # batch positives from the generator's truth, found through the manifest too
            'data.positives="ground_truth"',
        ],
    )
    summary = train(config, progress=False)
    assert summary is not None and summary["epochs_completed"] == 1
    report = evaluate_checkpoint(
        run / "last", out, EvalOptions(distractors=7, progress=False, batch_size=8, relevance_depth=20)
    )
    assert report["data"]["kind"] == "precomp" and report["data"]["ground_truth"] is True
    assert (
        report["ground_truth"]["global"]["relevant_pairs"] > report["annotations"]["global"]["relevant_pairs"]
    )
    assert report["distractors"]["count"] == 7 and "ground_truth" in report["distractors"]
    assert report["relevance"]["labels"] == "ground_truth"
    assert report["relevance"]["gallery"]["distractors"] == 7


def test_cache_reuses_and_refuses_other_settings(tiny_benchmark, tmp_path):
    out = tmp_path / "f"
    first = _build(tiny_benchmark, out, dim=8, epochs=1)
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = _build(tiny_benchmark, out, dim=8, epochs=1)
    assert again["cached"] is True and again["manifest"] == first["manifest"]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp  # nothing rewritten
    with pytest.raises(FileExistsError, match="--force") as info:
        _build(tiny_benchmark, out, dim=8, epochs=2)
    assert "epochs 1 (asked 2)" in str(info.value)
    rebuilt = _build(tiny_benchmark, out, dim=8, epochs=2, force=True)
    assert rebuilt["cached"] is False and rebuilt["manifest"]["epochs"] == 2
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        _build(tiny_benchmark, other, dim=8, epochs=1)
    assert (other / "notes.txt").read_text() == "mine"


def test_changed_or_moved_source_is_an_error_not_wrong_truth(tiny_benchmark, tmp_path):
    data = _small_copy(tiny_benchmark, tmp_path)
    out = tmp_path / "f"
    _build(data, out, dim=8, epochs=1)
    test = open_split(out, "test")
    assert synthetic_source(test) == (data, "test")
    # both moved together: found through the path relative to the features folder
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(data, moved / "data")
    shutil.move(out, moved / "f")
    assert synthetic_source(open_split(moved / "f", "test"))[1] == "test"
    # the source alone gone: a clear error naming the rebuild
    shutil.move(moved / "data", tmp_path / "elsewhere")
    with pytest.raises(DatasetError, match="not found"):
        ground_truth_relevance(open_split(moved / "f", "test"))
    # the source changed (regenerated with another seed): an error, and the cache refuses it too
    shutil.move(tmp_path / "elsewhere", moved / "data")
    scenes = json.loads((moved / "data" / "scenes.json").read_text())
    scenes["scenes"][0]["background"]["tone"] = (
        "dark" if scenes["scenes"][0]["background"]["tone"] == "light" else "light"
    )
    (moved / "data" / "scenes.json").write_text(json.dumps(scenes))
    with pytest.raises(DatasetError, match="changed") as info:
        ground_truth_relevance(open_split(moved / "f", "test"))
    assert "--force" in str(info.value)
    with pytest.raises(FileExistsError, match="source dataset changed"):
        _build(moved / "data", moved / "f", dim=8, epochs=1)


def test_interrupted_build_leaves_no_half_folder(tiny_benchmark, tmp_path, monkeypatch):
    real = feats._write_split

    def crash_on_test(tmp, name, *args, **kwargs):
        if name == "test":
            raise KeyboardInterrupt  # e.g. Ctrl-C during the last split
        return real(tmp, name, *args, **kwargs)

    monkeypatch.setattr(feats, "_write_split", crash_on_test)
    out = tmp_path / "f"
    with pytest.raises(KeyboardInterrupt):
        _build(tiny_benchmark, out, dim=8, epochs=1)
    assert list(tmp_path.iterdir()) == []  # no out, no hidden partial folder
    monkeypatch.setattr(feats, "_write_split", real)
    _build(tiny_benchmark, out, dim=8, epochs=1)
    before = (out / "features.json").read_text()
    monkeypatch.setattr(feats, "_write_split", crash_on_test)
    with pytest.raises(KeyboardInterrupt):
        _build(tiny_benchmark, out, dim=8, epochs=2, force=True)
    assert (out / "features.json").read_text() == before  # the old build is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_cli_builds_caches_and_refuses(tiny_benchmark, tmp_path):
    from icr.cli import app
    from icr.training.cli.data import features

    assert inspect.signature(features).parameters["epochs"].default == feats.DEFAULT_EPOCHS
    runner = CliRunner()
    helped = runner.invoke(app, ["data", "features", "--help"])
    assert (
        helped.exit_code == 0 and "Examples" in helped.output and "icr data features --data" in helped.output
    )
    out = tmp_path / "f"
    args = ["data", "features", "--data", str(tiny_benchmark), "--out", str(out), "--quiet", "--threads", "1"]
    small = ["--grid", "2", "--dim", "8", "--epochs", "1"]
    made = runner.invoke(app, [*args, *small])
    assert made.exit_code == 0, made.output
    assert (
        "held-out (val) attributes: cell mAP" in made.output and "wrote 4 x 8 region features" in made.output
    )
    cached = runner.invoke(app, [*args, *small])
    assert cached.exit_code == 0 and cached.output.startswith("cached:"), cached.output
    refused = runner.invoke(app, [*args, "--grid", "3", "--dim", "8", "--epochs", "1"])
    assert refused.exit_code == 2 and "--force" in refused.output and "Traceback" not in refused.output
    too_fine = runner.invoke(app, [*args, "--grid", "5", "--force"])  # 32 px images: at most 4 x 4
    assert too_fine.exit_code == 2 and "--grid" in too_fine.output
    not_synthetic = runner.invoke(app, ["data", "features", "--data", str(out), "--out", str(tmp_path / "g")])
    assert not_synthetic.exit_code == 2 and "not a synthetic dataset" in not_synthetic.output


def test_paper_suite_quick_path_end_to_end(built, tmp_path):
    """`icr analyze paper --quick` on the features: both encoders' comparisons, then the findings."""
    from icr.cli import app

    out, _ = built
    runs, docs, findings = tmp_path / "runs", tmp_path / "docs", tmp_path / "paper-findings.md"
    args = ["analyze", "paper", "--quick", "--features", str(out), "--batch-size", "8", "--quiet"]
    args += ["--runs", str(runs), "--docs", str(docs), "--out", str(findings)]
    args += ["--set", f"model.image.feature_dim={DIM}", "--set", "data.val_images=12"]
    args += ["--set", "train.max_steps=0"]  # whole (25-step) epochs: validation picks a best epoch
    run = CliRunner().invoke(app, args)
    assert run.exit_code == 0, run.output
    for encoder, variants in (("vsepp", ["triplet_hardest", "ntxent"]), ("gpo", ["triplet_hardest"])):
        report = json.loads((docs / encoder / "report.json").read_text())
        assert set(variants) <= set(report["variants"])
        assert report["regime"]["distractors"] == (16 if encoder == "vsepp" else 0)
        assert report["regime"]["patience"] == 1
        calibration = report["variants"]["triplet_hardest"]["calibration"]
        assert (calibration["t2i R@10 +distractors (annot.)"] is not None) == (encoder == "vsepp")
        assert report["variants"]["triplet_hardest"]["best_epoch"] is not None
    data = json.loads(findings.with_suffix(".json").read_text())
    verdicts = [f["verdict"] for f in data["findings"]]
    assert "not run" in verdicts and any(v != "not run" for v in verdicts)
    assert "## What differs in the regime" in findings.read_text()
    # the runs' cost from their own CPU seconds, 3 quick runs finished, the rest projected from them
    cost = data["cost"]["encoders"]
    assert cost["vsepp"]["variants"]["ntxent"]["finished"] == 1
    assert cost["vsepp"]["variants"]["ntxent"]["seconds_per_run"] > 0
    assert cost["vsepp"]["variants"]["snm"]["projected_per_run"] == cost["vsepp"]["median_run_seconds"]
    assert data["cost"]["projected_core_hours"] > 0

    bad = CliRunner().invoke(app, [*args, "--variants", "no_such_loss"])
    assert bad.exit_code == 2 and "in no encoder's suite" in bad.output

    # --report-only trains nothing: a run without result.json drops out of the report
    missing = next((runs / "vsepp").glob("ntxent/seed0/result.json"))
    missing.unlink()
    partial = CliRunner().invoke(app, [*args, "--report-only"])
    assert partial.exit_code == 0, partial.output
    assert "ntxent seed 0: not run, left out of the report" in partial.output
    assert not missing.exists()
    report = json.loads((docs / "vsepp" / "report.json").read_text())
    assert list(report["variants"]) == ["triplet_hardest"]
    assert report["variants"]["triplet_hardest"]["runs"] == 1
    empty = CliRunner().invoke(app, [*args, "--report-only", "--runs", str(tmp_path / "none")])
    assert empty.exit_code == 0, empty.output
    assert "no finished runs" in empty.output and (docs / "gpo" / "report.json").is_file()
