"""The training loop on a tiny embedded benchmark: every objective runs, resume is exact, runs are
deterministic, and two gloo processes train exactly like one process with the global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_model import TINY_MODEL

from icr.training.checkpoint import load_checkpoint
from icr.training.config import OptimSection, TrainConfig, load_config, shipped_configs
from icr.training.losses import load_all
from icr.training.train import Trainer, train


@pytest.fixture(scope="module")
def data(tiny_benchmark) -> Path:
    return tiny_benchmark


def tiny_config(data: Path, out: Path, *extra: str) -> TrainConfig:
    return load_config(
        None,
        [
            f'data.path="{data}"',
            f'train.out="{out}"',
            "train.batch_size=8",
            "train.epochs=2",
            "data.val_images=12",
            "train.log_every=1",
            "optim.lr=1e-3",
            "train.threads=1",
            *TINY_MODEL,
            *extra,
        ],
    )


def weights(run: Path, which: str = "last") -> dict[str, torch.Tensor]:
    return load_file(str(run / which / "model.safetensors"))


@pytest.mark.parametrize("name", sorted(load_all()))
def test_every_objective_trains_a_few_steps(data, tmp_path, name):
    cfg = tiny_config(data, tmp_path / "run", f'loss.name="{name}"', "train.max_steps=3", "train.epochs=1")
    if load_all()[name].sampling == "image":
        cfg.train.batch_size = 4  # image-level batches: 4 images x 5 captions
    before = {k: v.cpu().clone() for k, v in Trainer(cfg, progress=False).model.state_dict().items()}
    summary = train(cfg, progress=False)
    assert summary["steps"] == 3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["event"] == "train"]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    model, config = load_checkpoint(tmp_path / "run" / "last")
    assert config.objective["name"] == name
    after = model.state_dict()
    changed = {k.split(".")[0] for k in before if not torch.equal(before[k], after[k])}
    assert {"image_encoder", "text_encoder"} <= changed  # the objective's gradient reached both towers


@pytest.mark.parametrize(
    "decoding",
    [
        ['decoding.kind="ltd"', 'decoding.mode="dual"'],
        ['decoding.kind="ltd"', 'decoding.mode="constraint"'],
        ['decoding.kind="itd"', 'decoding.mode="constraint"'],
    ],
)
def test_target_decoding_trains(data, tmp_path, decoding):
    cfg = tiny_config(
        data,
        tmp_path / "run",
        "train.max_steps=3",
        "train.epochs=1",
        f'data.cache_dir="{tmp_path / "cache"}"',
        *decoding,
    )
    train(cfg, progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["event"] == "train"]
    assert all(any(k.startswith("rec") or "/rec" in k for k in r) for r in train_records)
    if "constraint" in decoding[1]:
        assert all("lambda" in r for r in train_records)


def test_resume_equals_uninterrupted_run(data, tmp_path):
    # 40 images x 5 captions / batch 8 = 25 steps per epoch: stop inside epoch 1, finish in epoch 2
    full = tiny_config(data, tmp_path / "full", "train.max_steps=30")
    train(full, progress=False)
    part = tiny_config(data, tmp_path / "part", "train.max_steps=3")  # stops mid-epoch 1
    train(part, progress=False)
    with pytest.raises(FileExistsError):
        train(part, progress=False)  # a second start without --resume must not overwrite the run
    rest = tiny_config(data, tmp_path / "part", "train.max_steps=30")
    summary = train(rest, resume=True, progress=False)
    assert summary["steps"] == 30
    a, b = weights(tmp_path / "full"), weights(tmp_path / "part")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    log = lambda run: [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    strip = lambda rs: [{k: v for k, v in r.items() if k != "samples_per_s"} for r in rs]  # noqa: E731
    assert strip(log(tmp_path / "full")) == strip(log(tmp_path / "part"))


def test_resume_refuses_a_different_config(data, tmp_path):
    train(tiny_config(data, tmp_path / "run", "train.max_steps=2"), progress=False)
    with pytest.raises(ValueError, match="different config"):
        train(
            tiny_config(data, tmp_path / "run", "train.max_steps=4", "optim.lr=0.5"),
            resume=True,
            progress=False,
        )


def test_same_seed_same_weights_and_validation_selects_best(data, tmp_path):
    for run in ("a", "b"):
        train(tiny_config(data, tmp_path / run), progress=False)
    a, b = weights(tmp_path / "a", "best"), weights(tmp_path / "b", "best")
    assert all(torch.equal(a[k], b[k]) for k in a)
    vals = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in vals if r["event"] == "val"]
    assert [r["epoch"] for r in vals] == [1, 2]
    _, config = load_checkpoint(tmp_path / "a" / "best")
    assert config.val_metrics["rsum"] == max(r["rsum"] for r in vals)
    assert config.data["fingerprint"] and config.step in (25, 50)


def test_swa_averages_the_snapshots_of_the_epoch_end(data, tmp_path):
    # 25 steps per epoch; swa_fraction 0.16 -> the last 4 steps, 2 snapshots: after steps 22 and 24
    swa = tiny_config(
        data,
        tmp_path / "swa",
        "train.epochs=1",
        "train.swa=true",
        "train.swa_fraction=0.16",
        "train.swa_snapshots=2",
    )
    train(swa, progress=False)
    for steps in (22, 24):
        train(tiny_config(data, tmp_path / f"plain{steps}", f"train.max_steps={steps}"), progress=False)
    averaged, a, b = weights(tmp_path / "swa"), weights(tmp_path / "plain22"), weights(tmp_path / "plain24")
    for key in averaged:
        torch.testing.assert_close(averaged[key], (a[key] + b[key]) / 2, msg=key)


@pytest.mark.slow
def test_two_gloo_processes_match_one_process_with_the_global_batch(data, tmp_path):
    args = [
        "--set",
        f'data.path="{data}"',
        "--set",
        "train.batch_size=8",
        "--set",
        "train.epochs=1",
        "--set",
        "train.max_steps=3",
        "--set",
        "train.val_every=0",
        "--set",
        "optim.lr=1e-3",
        "--set",
        "train.threads=1",
        "--set",
        'train.device="cpu"',
        "--quiet",
    ]  # gloo, also beside a GPU
    for item in TINY_MODEL:
        args += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = [sys.executable, "-m", "icr.cli", "train", "--config", "synthetic-ntxent"]
    subprocess.run(
        [*one, *args, "--set", f'train.out="{tmp_path / "one"}"'],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    two = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "icr.cli",
        "train",
        "--config",
        "synthetic-ntxent",
    ]
    result = subprocess.run(
        [*two, *args, "--set", f'train.out="{tmp_path / "two"}"'],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def test_every_shipped_config_resolves(tmp_path):
    from icr.training.losses import build_loss
    from icr.training.models import normalize_model_config

    names = shipped_configs()
    assert {"synthetic-ntxent"} <= set(names)
    for name in names:
        cfg = load_config(name)
        normalize_model_config(cfg.model)
        build_loss(cfg.loss.name, **cfg.loss.params())


def test_the_config_is_a_typed_value_with_its_defaults():
    from pydantic import ValidationError

    cfg = load_config(None, ["train.epochs=3"])
    assert isinstance(cfg, TrainConfig) and cfg.train.epochs == 3
    # every other value is the model's default
    defaults = TrainConfig().as_dict()
    got = cfg.as_dict()
    assert got["train"].pop("epochs") == 3 and defaults["train"].pop("epochs") == 30
    assert got == defaults
    # the JSON form round-trips (it is what checkpoints and train_state.pt record)
    assert TrainConfig.model_validate(cfg.as_dict()) == cfg
    # changed in code, a config is held to the same types as a file
    with pytest.raises(ValidationError, match="batch_size"):
        cfg.train.batch_size = 0
    with pytest.raises(ValidationError, match="schedule"):
        cfg.optim.schedule = "linearly"


def test_config_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="unknown config key 'train.epochz'"):
        load_config(None, ["train.epochz=3"])
    with pytest.raises(FileNotFoundError, match="shipped configs"):
        load_config("no-such-config")
    with pytest.raises(ValueError, match="key=value"):
        load_config(None, ["train.epochs"])
    assert load_config(None, ["train.out=runs/x"]).train.out == "runs/x"  # bare words are strings
    assert load_config(None, ["optim.lr=3e-4"]).optim.lr == 3e-4
    with pytest.raises(ValueError, match="not an objective"):
        load_config(None, ["loss.name=tripletz"])
    with pytest.raises(ValueError, match="one parameter table per objective"):
        load_config(None, ["loss.temperature=0.05"])
    # each section is typed: the message names the section, every bad key and how to fix it
    with pytest.raises(ValueError) as err:
        load_config(None, ['train.epochs="3"', "train.batch_size=0"])
    assert str(err.value) == (
        "config (overrides only): invalid [train]: epochs: Input should be a valid integer; batch_size: "
        "Input should be greater than or equal to 1. Fix it in the TOML file or with --set train.KEY=VALUE"
    )
    with pytest.raises(ValueError, match=r"invalid \[optim\]: schedule: Input should be 'step'"):
        load_config(None, ['optim.schedule="linearly"'])
    # parameters are kept per objective: switching the name does not inherit another one's
    cfg = load_config("synthetic-ntxent", ["loss.name=triplet"])
    assert cfg.loss.params() == {} and cfg.as_dict()["loss"]["ntxent"] == {"temperature": 0.1}


def test_ground_truth_positives_reach_the_objective(data, tmp_path):
    """data.positives=ground_truth: the loss gets every pair of the batch the generator says is relevant."""
    from icr.training.data.synthetic.generate import load_scenes
    from icr.training.data.synthetic.ground_truth import is_relevant
    from icr.training.data.training_data import plan_epoch
    from icr.training.losses.base import ContrastiveLoss

    cfg = tiny_config(
        data,
        tmp_path / "run",
        'data.positives="ground_truth"',
        'loss.name="ntxent_multi"',
        "train.max_steps=2",
        "train.epochs=1",
        "train.val_every=0",
    )
    trainer = Trainer(cfg, progress=False)
    seen = []
    forward = ContrastiveLoss.forward

    def spy(self, img, cap, img_ids, cap_img_ids, relevant=None):
        seen.append((img_ids.clone(), cap_img_ids.clone(), relevant))
        return forward(self, img, cap, img_ids, cap_img_ids, relevant)

    trainer.loss_fn.forward = spy.__get__(trainer.loss_fn)
    trainer.fit()
    assert len(seen) == 2
    scenes = load_scenes(data).by_imgid  # training images are imgids 0..39 (train is written first)
    plans = plan_epoch(trainer.train_data, "image", 8, 0, 0)
    for (img_ids, _, relevant), plan in zip(seen, plans, strict=False):
        assert relevant is not None and relevant.dtype == torch.bool
        want = [
            [is_relevant(trainer.train_data.captions[c], scenes[int(i)]) for c in plan.cap_idx]
            for i in img_ids
        ]
        assert relevant.tolist() == want
        # the annotated pairs are among them (every caption is true of its own image)
        assert all(
            relevant[r, c]
            for r, i in enumerate(img_ids)
            for c, cap in enumerate(plan.cap_idx)
            if trainer.train_data.img_of_cap[cap] == i
        )


def test_ground_truth_positives_need_the_embedded_benchmark(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 4), ("dev", 2)):
        np.save(tmp_path / f"{split}_ims.npy", rng.standard_normal((n, 3, 8)).astype(np.float32))
        (tmp_path / f"{split}_caps.txt").write_text("\n".join(["a red dog"] * 5 * n) + "\n")
    cfg = load_config(
        None,
        [
            f'data.path="{tmp_path}"',
            'data.positives="ground_truth"',
            'data.val_split="dev"',
            'model.image.kind="precomp"',
            "model.image.feature_dim=8",
        ],
    )
    with pytest.raises(ValueError, match="data.positives=ground_truth needs the embedded benchmark"):
        Trainer(cfg, progress=False)
    with pytest.raises(
        ValueError, match=r"invalid \[data\]: positives: Input should be 'annotations' or 'ground_truth'"
    ):
        load_config(None, ['data.positives="cxc"'])


def test_validation_also_runs_after_the_last_epoch(data, tmp_path):
    train(tiny_config(data, tmp_path / "run", "train.epochs=3", "train.val_every=2"), progress=False)
    vals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in vals if r["event"] == "val"] == [2, 3]


def test_precomp_region_features_train(tmp_path):
    rng = np.random.default_rng(0)
    words = ["a", "red", "blue", "dog", "cat", "on", "grass"]
    for split, n in (("train", 12), ("dev", 4)):
        np.save(tmp_path / f"{split}_ims.npy", rng.standard_normal((n, 6, 16)).astype(np.float32))
        lines = [" ".join(rng.choice(words, size=5)) for _ in range(5 * n)]
        (tmp_path / f"{split}_caps.txt").write_text("\n".join(lines) + "\n")
    overrides = [
        f'data.path="{tmp_path}"',
        'data.val_split="dev"',
        f'train.out="{tmp_path / "run"}"',
        "train.batch_size=10",
        "train.epochs=2",
        "model.embed_dim=16",
        'model.image.kind="precomp"',
        "model.image.feature_dim=16",
        "model.text.word_dim=8",
        "model.text.hidden=16",
    ]
    summary = train(load_config(None, overrides), progress=False)
    assert summary["steps"] == 12 and summary["best_rsum"] is not None  # 60 captions / 10 x 2 epochs
    model, config = load_checkpoint(tmp_path / "run" / "best")
    assert config.data["kind"] == "precomp" and model.config["image"]["kind"] == "precomp"


def test_epoch_plans_are_pure_functions_of_seed_and_epoch(data):
    from icr.training.data.training_data import open_split, plan_epoch

    split = open_split(data, "train", preload=False)
    order = lambda plans: [p.cap_idx.tolist() for p in plans]  # noqa: E731
    a = plan_epoch(split, "caption", 8, 0, 1)
    assert order(a) == order(plan_epoch(split, "caption", 8, 0, 1))
    assert order(a) != order(plan_epoch(split, "caption", 8, 0, 2))
    used = np.concatenate([p.cap_idx for p in a])
    assert len(a) == 200 // 8 and len(set(used.tolist())) == len(used)  # each caption at most once
    assert all((p.img_idx == split.img_of_cap[p.cap_idx]).all() for p in a)
    images = plan_epoch(split, "image", 4, 0, 0)
    assert len(images) == 10
    for p in images:  # image-level batches: 4 distinct images, each with all 5 of its captions
        assert len(set(p.img_idx.tolist())) == 4
        assert sorted(split.img_of_cap[p.cap_idx].tolist()) == sorted(np.repeat(p.img_idx, 5).tolist())


def test_patience_stops_when_validation_stops_improving_and_resume_keeps_it(data, tmp_path):
    # lr ~ 0: validation rsum never beats epoch 1, so patience 2 stops after epoch 3 of 10
    out = tmp_path / "run"
    cfg = tiny_config(data, out, "train.epochs=10", "train.patience=2", "optim.lr=1e-12")
    summary = train(cfg, progress=False)
    assert summary is not None
    stopped = (summary["best_epoch"], summary["epochs_completed"], summary["stopped_by_patience"])
    assert stopped == (1, 3, True)
    vals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [v["epoch"] for v in vals if v["event"] == "val"] == [1, 2, 3]
    again = train(cfg, resume=True, progress=False)  # resuming a stopped run trains nothing more
    assert again is not None and again["epochs_completed"] == 3 and again["steps"] == summary["steps"]


def test_min_epochs_holds_patience_back(data, tmp_path):
    # the same flat run as above: patience 2 alone would stop after epoch 3; min_epochs 5 runs 5
    cfg = tiny_config(
        data, tmp_path / "run", "train.epochs=10", "train.patience=2", "train.min_epochs=5", "optim.lr=1e-12"
    )
    summary = train(cfg, progress=False)
    assert summary is not None
    assert (summary["best_epoch"], summary["epochs_completed"], summary["stopped_by_patience"]) == (
        1,
        5,
        True,
    )


def test_learning_rate_schedules_against_their_formulas():
    import math

    from icr.training.train import learning_rate

    base = OptimSection(lr=0.1, gamma=0.5, lr_update=2, warmup_steps=0)
    epochs, per_epoch = 4, 10
    total = epochs * per_epoch
    for step in range(total):
        epoch = step // per_epoch
        expected = {
            "constant": 0.1,
            "step": 0.1 * 0.5 ** (epoch // 2),
            "cosine": 0.1 * 0.5 * (1 + math.cos(math.pi * epoch / epochs)),
            "cosine_step": 0.1 * 0.5 * (1 + math.cos(math.pi * step / total)),
            "linear": 0.1 * (1 - step / total),
        }
        for schedule, want in expected.items():
            got = learning_rate(base.model_copy(update={"schedule": schedule}), epochs, epoch, step, total)
            assert got == pytest.approx(want, abs=1e-12), (schedule, step)
    # cosine_step falls within every epoch, where cosine holds one value per epoch
    cosine_step = base.model_copy(update={"schedule": "cosine_step"})
    cos_step = [learning_rate(cosine_step, epochs, s // per_epoch, s, total) for s in range(total)]
    assert all(a > b for a, b in zip(cos_step, cos_step[1:], strict=False)) and cos_step[-1] < 0.001
    # a linear warm-up scales the first steps of any schedule
    warm = base.model_copy(update={"schedule": "cosine_step", "warmup_steps": 4})
    assert learning_rate(warm, epochs, 0, 0, total) == pytest.approx(0.25 * 0.1)
    assert learning_rate(warm, epochs, 0, 4, total) == pytest.approx(cos_step[4])
