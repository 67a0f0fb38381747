"""`evaluate_checkpoint`, `icr evaluate` and `icr analyze compare` on a tiny embedded benchmark.

A 40/12/12-image synthetic dataset and a tiny model trained for a few steps (module fixtures). The
report is checked for its sections (annotations and ground truth, distractors, calibration, PNG
plots), its annotation recalls against ``icr.training.evaluation.retrieval.evaluate_embeddings`` on embeddings
computed here, its distractor recalls against a full-gallery ranking built here, and the CLIs for
JSON output, clean user errors, and resumable loss comparisons that refuse a changed regime.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from tiny_model import TINY_MODEL
from typer.testing import CliRunner

from icr.training.checkpoint import load_checkpoint
from icr.training.data.synthetic.generate import DistractorStream, load_scenes
from icr.training.data.synthetic.ground_truth import relevance_matrix
from icr.training.data.synthetic.scene import SceneTable
from icr.training.data.training_data import open_split
from icr.training.embedding import embed_captions, embed_image_batch, embed_images
from icr.training.evaluation.full_report import (
    FILE_DISTRACTORS_NOTE,
    EvalOptions,
    evaluate_checkpoint,
    ground_truth_relevance,
)
from icr.training.evaluation.metrics.ranking import ranking_metrics
from icr.training.evaluation.metrics.relevant_pairs import Relevance
from icr.training.evaluation.retrieval import evaluate_embeddings

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DISTRACTORS = 10


@pytest.fixture(scope="module")
def tiny(tiny_benchmark, tiny_checkpoint) -> tuple[Path, Path]:
    """(data, checkpoint): the shared tiny benchmark and model (tests/conftest.py)."""
    return tiny_benchmark, tiny_checkpoint


@pytest.fixture(scope="module")
def report(tiny, tmp_path_factory) -> tuple[dict, Path]:
    data, ckpt = tiny
    plots = tmp_path_factory.mktemp("plots")
    options = EvalOptions(distractors=DISTRACTORS, plots_dir=plots, progress=False, batch_size=8)
    return evaluate_checkpoint(ckpt, data, options), plots


@pytest.fixture(scope="module")
def embedded(tiny):
    """The test split and its embeddings, computed here with the plain embedding functions (image
    batches of 8 as in the report, so the floating-point results are the same)."""
    data, ckpt = tiny
    model, _ = load_checkpoint(ckpt)
    split = open_split(data, "test")
    return model, split, embed_images(model, split, batch_size=8), embed_captions(model, split.captions)


def test_report_sections(report):
    rep, _ = report
    assert (rep["format"], rep["format_version"]) == ("icr-evaluation", 1)
    assert rep["data"] == {**rep["data"], "split": "test", "images": 12, "captions": 60, "ground_truth": True}
    for label in ("annotations", "ground_truth"):
        section = rep[label]
        assert section["protocol"] == {"name": "full", "folds": 1}
        assert {"rsum", "i2t_r1", "t2i_map5_ecir", "i2t_rprec", "t2i_map"} <= set(section["retrieval"])
        assert 0.0 <= section["global"]["pr_auc"] <= 1.0 and section["global"]["pairs"] == 12 * 60
        assert section["thresholds"] and "curve" not in section  # the PRCurve object is dropped
        assert "pr_curve_points" in section
        assert all("curves" not in d for d in section["score_distribution"].values())
    assert rep["annotations"]["global"]["relevant_pairs"] == 60
    assert rep["ground_truth"]["global"]["relevant_pairs"] >= rep["annotations"]["global"]["relevant_pairs"]
    assert rep["checkpoint"]["sha256"] and rep["checkpoint"]["objective"]["name"] == "ntxent"
    json.loads(json.dumps(rep))  # JSON-ready as returned


def test_ground_truth_contains_the_annotations(report, embedded):
    rep, _ = report
    _, split, img, cap = embedded
    truth = ground_truth_relevance(split)
    annotations = np.arange(12)[:, None] == split.img_of_cap[None, :]
    assert truth is not None and truth.dense.shape == (12, 60)
    assert not (annotations & ~truth.dense).any()
    assert rep["ground_truth"]["global"]["relevant_pairs"] == truth.num_pairs()
    assert rep["ground_truth"]["retrieval"] == pytest.approx(ranking_metrics(img @ cap.T, truth))


def test_annotation_recalls_equal_evaluate_embeddings(report, embedded):
    rep, _ = report
    _, split, img, cap = embedded
    expected = evaluate_embeddings(img, cap, split.img_of_cap)
    retrieval = rep["annotations"]["retrieval"]
    assert retrieval["rsum"] == pytest.approx(expected["rsum"])
    for key, value in expected.items():
        assert retrieval[key] == pytest.approx(value), key
    assert retrieval == pytest.approx(ranking_metrics(img @ cap.T, Relevance.annotations(split.img_of_cap)))


def test_distractor_section_matches_a_full_gallery_ranking(report, embedded, tiny):
    rep, _ = report
    data, _ = tiny
    model, split, img, cap = embedded
    section = rep["distractors"]
    assert section["count"] == DISTRACTORS and section["source"] == "synthetic generator"
    stream = DistractorStream.for_dataset(data, DISTRACTORS)
    batches = list(stream.batches(8))  # the report's batch size
    dis = np.concatenate([embed_image_batch(model, list(images)) for _, images, _ in batches])  # (N, D)
    scenes = [scene for _, _, batch_scenes in batches for scene in batch_scenes]
    dis_truth = relevance_matrix(split.captions, SceneTable.from_scenes(scenes))  # (N_cap, N)
    gallery = np.concatenate([cap @ img.T, cap @ dis.T], axis=1)  # (N_cap, 12 + N)
    truth = ground_truth_relevance(split).dense.T  # (N_cap, 12)
    annotated = split.img_of_cap[:, None] == np.arange(12)[None, :]
    for label, relevant in (
        ("annotations", np.concatenate([annotated, np.zeros_like(dis_truth)], axis=1)),
        ("ground_truth", np.concatenate([truth, dis_truth], axis=1)),
    ):
        got = section[label]
        assert got["gallery_size"] == 12 + DISTRACTORS
        ranks = []
        for q in range(gallery.shape[0]):
            best = gallery[q][relevant[q]].max()
            ranks.append(1 + int((gallery[q][~relevant[q]] >= best).sum()))  # ties pessimistic
        for k in (1, 5, 10, 100):
            assert got[f"t2i_r{k}"] == pytest.approx(100.0 * np.mean(np.array(ranks) <= k)), (label, k)
    assert section["ground_truth"]["distractors_relevant_to_some_query"] == dis_truth.any(axis=0).sum()
    assert section["annotations"]["distractors_relevant_to_some_query"] == 0


def test_calibration_and_plots(report):
    rep, plots = report
    assert rep["calibration_labels"] == "ground_truth"
    calibration = rep["ground_truth"]["calibration"]
    assert calibration["method"] == "isotonic" and calibration["fit"]["split"] == "val"
    assert calibration["fit"]["labels"] == "ground_truth" and calibration["fit"]["images"] == 12
    assert math.isfinite(calibration["ece"]) and 0.0 <= calibration["ece"] <= 1.0
    assert sum(b["pairs"] for b in calibration["bins"]) == 12 * 60
    assert set(calibration["score_for_relevance"]) == {"0.5", "0.8", "0.9"}
    assert "calibration" not in rep["annotations"]  # fitted on ground-truth labels
    paths = [Path(p) for p in rep["plots"]]
    assert {p.name for p in paths} == {
        "pr-curve.png",
        "scores-annotations.png",
        "scores-ground_truth.png",
        "reliability-ground_truth.png",
        *(f"reliability-kinds-{m}.png" for m in ("per_query", "isotonic_served", "isotonic_all_pairs")),
    }
    for path in paths:
        assert path.parent == plots and path.read_bytes()[:8] == PNG_SIGNATURE


def test_relevance_section_judges_held_out_captions_on_the_distractors(report, tiny, embedded):
    """The threshold-honesty section against hit lists rebuilt here: every test caption's top hits
    over the 12 test images + 10 distractors, judged on the distractors with the generator's truth."""
    from icr.training.data.synthetic.kinds import query_kind
    from icr.training.data.synthetic.parse import parse_caption
    from icr.training.evaluation.metrics.threshold_honesty import HitLists, threshold_honesty

    rep, _ = report
    section = rep["relevance"]
    assert section["labels"] == "ground_truth" and section["note"] is None
    assert section["gallery"] == {"images": 12, "distractors": DISTRACTORS, "judged": "generated distractors"}
    assert section["fit"]["split"] == "val" and section["fit"]["queries"] == 60
    assert set(section["maps"]) == {"per_query", "isotonic_served", "isotonic_all_pairs"}
    data, _ = tiny
    model, split, img, cap = embedded
    stream = DistractorStream.for_dataset(data, DISTRACTORS)
    dis = embed_image_batch(model, [stream.image(k) for k in range(DISTRACTORS)])  # (10, D)
    gallery = np.concatenate([img, dis])  # (22, D)
    scores = cap @ gallery.T  # (60, 22)
    order = np.argsort(-scores, axis=1, kind="stable")
    top = np.take_along_axis(scores, order, 1)
    scenes = SceneTable.concat(
        [SceneTable.from_scenes([load_scenes(data).by_imgid[r] for r in range(52, 64)]), stream.scene_table()]
    )
    truth = relevance_matrix(split.captions, scenes)  # (60, 22)
    relevant = np.take_along_axis(truth, order, 1)
    hits = HitLists(
        top,
        relevant,
        order >= 12,
        truth.sum(1),
        truth[:, 12:].sum(1),
        np.array([query_kind(parse_caption(c)) for c in split.captions]),
    )
    # The maps are fitted inside the evaluation; what is checked here is the hit lists they are
    # judged on (rank figures and judged counts do not depend on a map). The threshold arithmetic
    # has its own oracle in test_threshold_honesty.py.
    served = section["maps"]["isotonic_served"]
    want = threshold_honesty(hits, np.zeros_like(top))  # rank figures only
    assert served["pooled"]["p_at_10"] == pytest.approx(want["pooled"]["p_at_10"])
    assert served["pooled"]["r_precision"] == pytest.approx(want["pooled"]["r_precision"])
    assert served["pooled"]["judged_hits"] == int((order >= 12).sum())
    for kind, group in want["by_kind"].items():
        assert served["by_kind"][kind]["queries"] == group["queries"]
        assert served["by_kind"][kind]["p_at_10"] == pytest.approx(group["p_at_10"])
    # per query: delivered is the share of each caption's top 20 the truth calls relevant
    honesty = section["maps"]["per_query"]["queries"]
    assert honesty["k"] == 20 and honesty["pooled"]["queries"] == 60
    assert honesty["pooled"]["delivered"] == pytest.approx(relevant[:, :20].mean())
    for kind, group in want["by_kind"].items():
        assert honesty["by_kind"][kind]["queries"] == group["queries"]
    # out-of-domain queries: words the tiny model never read get no promise at all
    ood = section["out_of_domain"]
    assert ood["nonsense"]["queries"] == 25 and ood["nonsense"]["withheld"] == 1.0
    assert ood["nonsense"]["passing_any"] == {"0.5": 0.0, "0.9": 0.0}
    assert ood["held_out_kind"]["queries"] == want["by_kind"]["relation"]["queries"]
    assert ood["all"]["queries"] == sum(g["queries"] for name, g in ood.items() if name != "all")


def test_distractor_embeddings_file(tiny, embedded, tmp_path):
    data, ckpt = tiny
    _, split, img, cap = embedded
    rng = np.random.default_rng(0)
    dis = rng.normal(size=(7, img.shape[1])).astype(np.float32)
    dis /= np.linalg.norm(dis, axis=1, keepdims=True)
    np.save(tmp_path / "dis.npy", dis)
    # memory-mapped read-only, in batches of 16 x 8 = 128 rows: one batch
    options = EvalOptions(distractor_embeddings=tmp_path / "dis.npy", progress=False, batch_size=8)
    rep = evaluate_checkpoint(ckpt, data, options)
    section = rep["distractors"]
    # the file's vectors have no ground truth: threshold honesty stays on the split's own images
    assert rep["relevance"]["gallery"]["distractors"] == 0
    assert rep["relevance"]["note"] == FILE_DISTRACTORS_NOTE
    assert section["source"] == str(tmp_path / "dis.npy") and section["gallery_size"] == 12 + 7
    gallery = np.concatenate([cap @ img.T, cap @ dis.T], axis=1)  # (N_cap, 19)
    best = gallery[np.arange(60), split.img_of_cap]  # every distractor is non-relevant
    ranks = (gallery >= best[:, None]).sum(axis=1)  # the relevant image itself counts once
    for k in (1, 5, 10):
        assert section[f"t2i_r{k}"] == pytest.approx(100.0 * np.mean(ranks <= k)), k
    np.save(tmp_path / "wrong.npy", dis[:, :5])
    with pytest.raises(ValueError, match=r"must be a float \(N, 32\) array"):
        evaluate_checkpoint(
            ckpt,
            data,
            EvalOptions(distractor_embeddings=tmp_path / "wrong.npy", calibration_split=None, progress=False),
        )


# --- icr evaluate ----------------------------------------------------------------------------------
def test_cli_evaluate_writes_json(tiny, tmp_path):
    from icr.cli import app

    data, ckpt = tiny
    out = tmp_path / "eval.json"
    ood = tmp_path / "ood.txt"
    ood.write_text("a purple giraffe\n\nthe moon\nqwerty\n")
    run = CliRunner().invoke(
        app,
        [
            "evaluate",
            "--checkpoint",
            str(ckpt),
            "--data",
            str(data),
            "--json",
            str(out),
            "--quiet",
            "--distractors",
            "3",
            "--threshold",
            "0.25",
            "--calibration-method",
            "platt",
            "--ood-queries",
            str(ood),
        ],
    )
    assert run.exit_code == 0, run.output
    assert "out-of-domain queries" in run.output and "per query, top 20" in run.output
    assert "rsum" in run.output and "PR-AUC" in run.output and "t2i with distractors" in run.output
    rep = json.loads(out.read_text())
    assert rep["relevance"]["out_of_domain"]["given"]["queries"] == 3  # the file's, in place of the built-in
    assert rep["distractors"]["annotations"]["gallery_size"] == 15
    assert rep["ground_truth"]["calibration"]["method"] == "platt"
    assert 0.25 in [row["threshold"] for row in rep["annotations"]["thresholds"]]
    plots = [Path(p) for p in rep["plots"]]
    assert plots and all(p.parent == tmp_path / "eval-plots" for p in plots)  # default: beside --json
    assert all(p.read_bytes()[:8] == PNG_SIGNATURE for p in plots)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--protocol", "10k"], "Invalid value for '--protocol'"),  # the choices follow, wrapped
        (["--device", "tpu"], "Invalid value for '--device'"),
        (["--calibration-method", "beta"], "--calibration-method must be one of"),
        (["--protocol", "5k"], "5,000-image"),
    ],
)
def test_cli_evaluate_user_errors_exit_2(tiny, tmp_path, args, message):
    from icr.cli import app

    data, ckpt = tiny
    out = tmp_path / "eval.json"
    run = CliRunner().invoke(
        app,
        [
            "evaluate",
            "-m",
            str(ckpt),
            "-d",
            str(data),
            "--quiet",
            "--calibration-split",
            "none",
            "--json",
            str(out),
            *args,
        ],
    )
    assert run.exit_code == 2, run.output
    # our one-line "error: ..." or, for an option's fixed choices, the CLI parser's "Invalid value"
    assert ("error:" in run.output or "Invalid value" in run.output) and message in run.output
    assert "Traceback" not in run.output and not out.exists()


# --- icr analyze compare ---------------------------------------------------------------------------
def compare_args(data: Path, runs: Path, report: Path, epochs: int = 1) -> list[str]:
    sets = ["train.max_steps=2", "train.threads=1", "data.val_images=12", *TINY_MODEL]
    return [
        "analyze",
        "compare",
        "--data",
        str(data),
        "--variants",
        "ntxent",
        "--seeds",
        "0",
        "--epochs",
        str(epochs),
        "--batch-size",
        "100",
        "--distractors",
        "3",
        "--cocos-batches",
        "1",
        "--runs",
        str(runs),
        "--report",
        str(report),
        "--quiet",
        *[arg for s in sets for arg in ("--set", s)],
    ]


def test_cli_compare_writes_a_report_and_resumes(tiny, tmp_path):
    from icr.cli import app

    data, _ = tiny
    runs, out = tmp_path / "runs", tmp_path / "report"
    run = CliRunner().invoke(app, compare_args(data, runs, out))
    assert run.exit_code == 0, run.output
    result_path = runs / "ntxent" / "seed0" / "result.json"
    result = json.loads(result_path.read_text())
    assert (result["variant"], result["seed"], result["epochs"]) == ("ntxent", 0, 1)
    assert result["eval"]["distractors"]["annotations"]["gallery_size"] == 12 + 3
    assert "| ntxent |" in (out / "report.md").read_text()
    summary = json.loads((out / "report.json").read_text())
    assert summary["variants"]["ntxent"]["runs"] == 1 and summary["regime"]["epochs"] == 1
    assert summary["regime"]["overrides"][0] == "train.max_steps=2"
    assert all((out / p).read_bytes()[:8] == PNG_SIGNATURE for p in summary["plots"])

    stamp = result_path.stat().st_mtime_ns
    weights = runs / "ntxent" / "seed0" / "best" / "model.safetensors"
    weights_stamp = weights.stat().st_mtime_ns
    again = CliRunner().invoke(app, compare_args(data, runs, out))
    assert again.exit_code == 0, again.output
    assert result_path.stat().st_mtime_ns == stamp  # reused, not retrained or re-evaluated
    assert weights.stat().st_mtime_ns == weights_stamp

    changed = CliRunner().invoke(app, compare_args(data, runs, out, epochs=2))
    assert changed.exit_code == 2, changed.output
    assert "another regime" in changed.output
    assert result_path.stat().st_mtime_ns == stamp


def test_cli_compare_with_max_steps_inside_the_first_epoch(tiny, tmp_path):
    # batch 8: 25 steps an epoch, so train.max_steps=2 stops before the first validation and no
    # best/ checkpoint is written. The comparison must still evaluate the run (e.g. its last/
    # checkpoint), or refuse the regime before spending the training time; not train and then fail.
    from icr.cli import app

    data, _ = tiny
    runs = tmp_path / "runs"
    args = compare_args(data, runs, tmp_path / "report")
    args[args.index("--batch-size") + 1] = "8"
    run = CliRunner().invoke(app, args)
    seed_dir = runs / "ntxent" / "seed0"
    if run.exit_code == 0:
        assert json.loads((seed_dir / "result.json").read_text())["variant"] == "ntxent"
    else:
        assert run.exit_code == 2 and "error:" in run.output
        assert not (seed_dir / "last").exists(), f"refused only after training: {run.output}"


def test_variant_specs_with_objective_parameters():
    from icr.training.analysis.compare import Variant
    from icr.training.analysis.variants import split_variants
    from icr.training.config import load_config

    specs = split_variants("triplet, goal[triplet_weight=cir,pair_weight=sig_ms] ,ntxent+itd:constraint,")
    assert specs == ["triplet", "goal[triplet_weight=cir,pair_weight=sig_ms]", "ntxent+itd:constraint"]
    goal = Variant.parse(specs[1])
    assert goal.name == specs[1] and goal.slug == "goal-triplet_weight-cir-pair_weight-sig_ms"
    loss = load_config("synthetic-ntxent", goal.overrides()).as_dict()["loss"]
    assert loss["name"] == "goal" and loss["goal"] == {"triplet_weight": "cir", "pair_weight": "sig_ms"}
    both = Variant.parse("goal[pair_weight=lin]+ltd:dual")
    assert (both.decoder, both.mode, both.params) == ("ltd", "dual", (("pair_weight", "lin"),))
    assert Variant.parse("ntxent+ltd:dual").slug == "ntxent-ltd-dual"  # older run folders still found
    for bad in ("goal[triplet_weight]", "goal[a=1", "nope[a=1]", "goal[a=[1]]", "ntxent+ltd:both"):
        with pytest.raises(ValueError):
            Variant.parse(bad)
