"""The `icr` console script, run as a real process the way users run it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ICR = shutil.which("icr", path=str(Path(sys.executable).parent)) or "icr"


def icr(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ICR, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_help_lists_commands_with_examples() -> None:
    top = icr("--help")
    assert top.returncode == 0
    assert "data" in top.stdout and "demo" in top.stdout
    synth = icr("data", "synth", "--help")
    assert synth.returncode == 0
    assert "Examples" in synth.stdout and "icr data synth --out" in synth.stdout
    for sub in ("stats", "check"):
        assert "Examples" in icr("data", sub, "--help").stdout


def test_synth_stats_check_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "s"
    made = icr("data", "synth", "--out", str(out), "--train", "20", "--val", "5", "--test", "6", "--quiet")
    assert made.returncode == 0, made.stderr
    assert "wrote 31 images" in made.stdout
    stats = icr("data", "stats", str(out), "--json", str(tmp_path / "stats.json"))
    assert stats.returncode == 0, stats.stderr
    assert "ground_truth" in stats.stdout
    result = json.loads((tmp_path / "stats.json").read_text())
    assert (result["splits"]["train"]["images"], result["splits"]["train"]["captions"]) == (20, 100)
    assert result["ground_truth"]["test"]["captions_true_of_own_image"] == 1.0
    assert result["ground_truth"]["test"]["relevant_images_per_caption_mean"] >= 1.0
    checked = icr("data", "check", str(out))
    assert checked.returncode == 0, checked.stderr
    assert "test: 6 images decoded, 30 captions: ok" in checked.stdout


def test_user_errors_exit_2_with_a_message_and_no_traceback(tmp_path: Path) -> None:
    out = tmp_path / "s"
    assert (
        icr(
            "data", "synth", "--out", str(out), "--train", "2", "--val", "1", "--test", "1", "--quiet"
        ).returncode
        == 0
    )
    again = icr("data", "synth", "--out", str(out), "--quiet")
    assert again.returncode == 2
    assert "--force" in again.stderr and "Traceback" not in again.stderr
    missing = icr("data", "stats", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert "nowhere" in missing.stderr and "Traceback" not in missing.stderr
    broken = out / "images" / "synth_test_000000.png"
    broken.write_bytes(b"not a png")
    bad = icr("data", "check", str(out))
    assert bad.returncode == 2
    assert "synth_test_000000.png" in bad.stderr and "Traceback" not in bad.stderr


def test_check_and_stats_on_a_precomp_folder(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    np.save(tmp_path / "test_ims.npy", np.zeros((2, 3, 8), dtype=np.float32))
    (tmp_path / "test_caps.txt").write_text("\n".join(f"caption {i}" for i in range(10)) + "\n")
    checked = icr("data", "check", str(tmp_path))
    assert checked.returncode == 0, checked.stderr
    assert "test: 2 feature rows (3, 8), 10 captions: ok" in checked.stdout
    stats = icr("data", "stats", str(tmp_path))
    assert stats.returncode == 0 and "captions_per_image_row  5" in stats.stdout


def test_demo_builds_every_artifact_then_reuses_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The demo's sizes are fixed (10k/1k/1k, 50k training scenes, 100k distractors, minutes); run it
    # in-process with small ones, without serving (the server itself is exercised by api_tests/).
    from typer.testing import CliRunner

    from icr import cli, demo
    from icr.training.data.synthetic.generate import load_scenes

    monkeypatch.setattr(demo, "DEMO_COUNTS", {"train": 10, "val": 5, "test": 5})
    monkeypatch.setattr(demo, "DEMO_TRAIN_COUNTS", {"train": 16, "val": 5, "test": 0})
    monkeypatch.setattr(
        demo,
        "DEMO_TRAIN",
        [
            "train.epochs=1",
            "train.batch_size=8",
            "model.embed_dim=16",
            "model.image.width=4",
            "model.text.word_dim=8",
            "model.text.hidden=16",
        ],
    )
    runner = CliRunner()
    workdir = tmp_path / "demo"
    args = ["demo", "--workdir", str(workdir), "--distractors", "30", "--no-serve", "--train"]
    first = runner.invoke(cli.app, args)
    assert first.exit_code == 0, first.output
    assert "generating 20 images" in first.output and "captions_true_of_own_image" in first.output
    assert "the model's training scenes: generating 21 images" in first.output
    # the model trains on its own scenes; the benchmark's validation images are the same ones
    trained = json.loads((workdir / "model" / "best" / "config.json").read_text())
    assert trained["train_config"]["data"]["path"] == str(workdir / "train-data")
    # its captions name the background tone more often than the benchmark's; the images are the same
    # and bare counts ("two shapes"), which the benchmark's never are
    assert load_scenes(workdir / "train-data").generator["tone_captions"] == demo.DEMO_TRAIN_TONE
    assert load_scenes(workdir / "train-data").generator["count_captions"] == demo.DEMO_TRAIN_COUNT
    assert "tone_captions" not in load_scenes(workdir / "data").generator
    assert "count_captions" not in load_scenes(workdir / "data").generator
    for split in ("train", "val"):
        extended = sorted(p.name for p in (workdir / "train-data" / "images").glob(f"synth_{split}_*"))
        own = sorted(p.name for p in (workdir / "data" / "images").glob(f"synth_{split}_*"))
        assert extended[: len(own)] == own and len(extended) == {"train": 16, "val": 5}[split]
        for name in own:
            same = (workdir / "train-data" / "images" / name).read_bytes()
            assert same == (workdir / "data" / "images" / name).read_bytes(), name
    for step in ("image index", "caption index"):
        assert f"{step}" in first.output and "building into" in first.output
    assert "calibration: validation captions search the index" in first.output
    assert "icr serve --index" in first.output
    images = json.loads((workdir / "index" / "images" / "manifest.json").read_text())
    assert (images["gallery_count"], images["distractor_count"]) == (5, 30)
    assert images["data"]["path"] == str(workdir / "data")  # absolute: serving works from anywhere
    assert json.loads((workdir / "index" / "captions" / "manifest.json").read_text())["ntotal"] == 25
    assert (workdir / "index" / "images" / "calibration.json").is_file()

    second = runner.invoke(cli.app, args)
    assert second.exit_code == 0, second.output
    for what in (
        "benchmark: cached",
        "training scenes: cached",
        "model: cached",
        "distractors): cached",
        "image->text search): cached",
        "calibration: cached",
    ):
        assert what in second.output
    more = runner.invoke(cli.app, [*args[:3], "--distractors", "40", "--no-serve", "--train"])
    assert "40 distractors): building" in more.output
    assert "image->text search): cached" in more.output
    other_seed = runner.invoke(
        cli.app,
        ["demo", "--workdir", str(workdir), "--seed", "1", "--no-serve", "--distractors", "30", "--train"],
    )
    assert "generating" in other_seed.output and "model: training" in other_seed.output
    assert "image index (1,000 test images + 30 distractors): building" in other_seed.output


def test_the_demo_serves_the_shipped_weights_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Without --train the demo takes the shipped checkpoint, after checking every file's sha256
    against SHIPPED.json, and generates no training scenes; a damaged file is refused by name."""
    import hashlib
    import shutil

    from typer.testing import CliRunner

    from icr import cli, demo
    from icr.training.config import load_config
    from icr.training.data.synthetic.generate import write_dataset
    from icr.training.train import train
    from tests.tiny_model import TINY_MODEL

    write_dataset(tmp_path / "scenes", train=16, val=5, test=0, image_size=64, seed=0)
    run = tmp_path / "run"
    config = load_config(
        None,
        [f'data.path="{tmp_path / "scenes"}"', f'train.out="{run}"', "train.epochs=1", "train.batch_size=8"]
        + [o for o in TINY_MODEL if not o.startswith("model.image.image_size")],
    )
    train(config, progress=False)
    shipped = tmp_path / "demo_weights"
    shutil.copytree(run / "best", shipped)
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(shipped.iterdir())}
    (shipped / demo.SHIPPED_RECORD).write_text(json.dumps({"summary": "a test model", "sha256": digests}))
    monkeypatch.setattr(demo, "SHIPPED_WEIGHTS", shipped)
    monkeypatch.setattr(demo, "DEMO_COUNTS", {"train": 10, "val": 5, "test": 5})

    runner = CliRunner()
    workdir = tmp_path / "demo"
    args = ["demo", "--workdir", str(workdir), "--distractors", "30", "--no-serve"]
    first = runner.invoke(cli.app, args)
    assert first.exit_code == 0, first.output
    assert "model: shipped with icr, checksums verified (a test model)" in first.output
    assert not (workdir / "train-data").exists() and not (workdir / "model").exists()
    manifest = json.loads((workdir / "index" / "images" / "manifest.json").read_text())
    assert manifest["checkpoint_path"] == str(shipped)
    assert (workdir / "index" / "images" / "calibration.json").is_file()

    weights = shipped / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")  # one byte changed
    damaged = runner.invoke(cli.app, args)
    assert damaged.exit_code != 0
    assert f"{weights}: sha256" in damaged.output and "icr demo --train" in damaged.output
    (shipped / demo.SHIPPED_RECORD).write_text("{")
    assert "unreadable record of the shipped weights" in runner.invoke(cli.app, args).output


def test_the_shipped_demo_weights_match_their_record() -> None:
    """The committed weights are the ones SHIPPED.json describes (the loader checks the same)."""
    from icr import demo

    record = json.loads((demo.SHIPPED_WEIGHTS / demo.SHIPPED_RECORD).read_text())
    assert demo.shipped_checkpoint() == demo.SHIPPED_WEIGHTS
    assert set(record["sha256"]) == {"config.json", "model.safetensors"}
    for key in ("commands", "commit", "summary", "training", "measured"):
        assert record[key], key
