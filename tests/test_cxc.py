"""Crisscrossed Captions: loader, positive rule, metrics against hand-computed values and a naive
oracle, split identity for precomp folders, and `icr evaluate --cxc` end to end.

Fixture: a Karpathy-format COCO with 8 train / 4 val / 4 test images x 5 captions (real JPEGs) and
CxC CSVs in the exact published format (``COCO_val2014:sentid:N`` caption ids, COCO file names).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny_model import TINY_MODEL
from typer.testing import CliRunner

from icr.training.data.cxc import (
    CXC_URL,
    cxc_relevance,
    intramodal_pairs,
    load_cxc,
    split_ids,
)
from icr.training.data.errors import DatasetError
from icr.training.data.karpathy import load_karpathy
from icr.training.evaluation.metrics.intramodal import intramodal_metrics
from icr.training.evaluation.metrics.ranking import ranking_metrics

SPLITS = {"train": 8, "val": 4, "test": 4}
OBJECTS = ["dog", "cat", "bus", "pizza", "horse", "kite", "boat", "train"]
PLACES = ["street", "grass", "table", "beach", "field"]
COLORS = ["red", "blue", "green", "white", "black"]


def sentid(split: str, i: int, j: int) -> int:
    """Karpathy sentids that are NOT the caption's row in the split (the mapping must be used)."""
    return {"train": 100000, "val": 500000, "test": 700000}[split] + 10 * i + j


def filename(split: str, i: int) -> str:
    base = {"train": 9000, "val": 300000, "test": 365320}[split]
    return f"COCO_{'train' if split == 'train' else 'val'}2014_{base + i:012d}.jpg"


def caption_text(split: str, i: int, j: int) -> str:
    k = i + {"train": 0, "val": 3, "test": 5}[split]
    return f"A {COLORS[j]} {OBJECTS[k % len(OBJECTS)]} on the {PLACES[(k + j) % len(PLACES)]}."


def cap_id(sid: int) -> str:
    return f"COCO_val2014:sentid:{sid}"


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> Path:
    """Folder holding dataset_coco.json and train2014/ val2014/ images."""
    root = tmp_path_factory.mktemp("cxc") / "coco"
    rng = np.random.default_rng(0)
    images, imgid = [], 0
    for split, n in SPLITS.items():
        for i in range(n):
            name, folder = filename(split, i), "train2014" if split == "train" else "val2014"
            (root / folder).mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / folder / name)
            sentences = [
                {
                    "raw": caption_text(split, i, j),
                    "tokens": caption_text(split, i, j).lower()[:-1].split(),
                    "imgid": imgid,
                    "sentid": sentid(split, i, j),
                }
                for j in range(5)
            ]
            images.append(
                {
                    "filepath": folder,
                    "filename": name,
                    "cocoid": 10 * imgid + 1,
                    "imgid": imgid,
                    "split": split,
                    "sentids": [s["sentid"] for s in sentences],
                    "sentences": sentences,
                }
            )
            imgid += 1
    (root / "dataset_coco.json").write_text(json.dumps({"dataset": "coco", "images": images}))
    return root


def write_csv(path: Path, header: str, rows: list[tuple]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + "\n" + "".join(",".join(str(v) for v in row) + "\n" for row in rows))
    return path


T = [[sentid("test", i, j) for j in range(5)] for i in range(4)]  # T[i][j]: sentid of test caption 5i+j
TI = [filename("test", i) for i in range(4)]
SITS_ROWS = [
    (cap_id(T[0][0]), TI[1], 3.0, "c2i_intrasim"),  # boundary: 3.0 counts -> (img 1, caption 0)
    (cap_id(T[0][1]), TI[2], 2.99, "c2i_intrasim"),  # below -> not a positive
    (cap_id(T[0][0]), TI[0], 4.6, "c2i_original"),  # original pair: already positive
    (cap_id(sentid("val", 0, 0)), TI[3], 4.0, "c2i_intrasim"),  # caption not in the test split
    (cap_id(T[2][0]), filename("val", 1), 4.5, "c2i_intrasim"),  # image not in the test split
    (cap_id(sentid("val", 1, 1)), filename("val", 2), 5.0, "c2i_original"),  # neither
]
STS_ROWS = [
    (cap_id(T[0][0]), cap_id(T[1][0]), 3.2, "c2c_isim"),  # t2t positive across images
    (cap_id(T[0][2]), cap_id(T[0][3]), 4.0, "c2c_cocaption"),  # same image: positive anyway
    (cap_id(T[1][2]), cap_id(T[2][2]), 1.0, "c2c_isim"),  # below
    (cap_id(T[3][4]), cap_id(sentid("val", 3, 0)), 4.0, "c2c_isim"),  # outside the split
]
SIS_ROWS = [
    (TI[0], TI[3], 3.5, "i2i_csim"),
    (TI[1], TI[2], 2.0, "i2i_csim"),
    (TI[2], filename("val", 0), 4.0, "i2i_csim"),  # outside
]


@pytest.fixture(scope="module")
def cxc_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cxc_data") / "data"
    write_csv(d / "sits_test.csv", "caption,image,agg_score,sampling_method", SITS_ROWS)
    write_csv(d / "sts_test.csv", "caption1,caption2,agg_score,sampling_method", STS_ROWS)
    write_csv(d / "sis_test.csv", "image1,image2,agg_score,sampling_method", SIS_ROWS)
    (d / "sits_test_raw.csv").write_text("not,read\nat,all\n")  # per-annotator files are ignored
    return d


def ids_of(coco) -> tuple[list[str], list[int], np.ndarray]:
    split = load_karpathy(coco, check_images=False).split("test")
    return (
        [r.filename for r in split.images],
        [s for r in split.images for s in r.sentids],
        np.arange(20) // 5,
    )


# --------------------------------------------------------------------------- loader


def test_load_cxc_reads_the_three_tables(cxc_dir):
    cxc = load_cxc(cxc_dir, "test")
    assert (len(cxc.sits), len(cxc.sts), len(cxc.sis)) == (6, 4, 3)
    assert cxc.sits.left.dtype == np.int64 and cxc.sits.left[0] == T[0][0] and cxc.sits.right[0] == TI[1]
    assert cxc.sts.right.dtype == np.int64 and cxc.sis.left[0] == TI[0]
    np.testing.assert_array_equal(cxc.sits.score, [3.0, 2.99, 4.6, 4.0, 4.5, 5.0])
    assert list(cxc.sits.method[:3]) == ["c2i_intrasim", "c2i_intrasim", "c2i_original"]


def test_missing_files_name_the_files_and_the_source(tmp_path):
    write_csv(tmp_path / "sits_test.csv", "caption,image,agg_score,sampling_method", [])
    with pytest.raises(DatasetError) as err:
        load_cxc(tmp_path, "test")
    msg = str(err.value)
    assert "sts_test.csv" in msg and "sis_test.csv" in msg and "sits_test.csv, sts_test.csv" in msg
    assert CXC_URL in msg
    with pytest.raises(ValueError, match="'val' and 'test'"):
        load_cxc(tmp_path, "train")


@pytest.mark.parametrize(
    "header, row, problem, line",
    [
        ("caption,img,agg_score,sampling_method", None, "bad header", 1),
        (None, "COCO_val2014:sentid:1,x.jpg,3.0", "3 fields, expected 4", 3),
        (None, "COCO_val2014:sentid:1,x.jpg,high,c2i_intrasim", "agg_score 'high' is not a number", 3),
        (None, "COCO_val2014:sentid:1,x.jpg,5.5,c2i_intrasim", "outside [0, 5]", 3),
        (None, "COCO_val2014:sentid:1,x.jpg,-0.1,c2i_intrasim", "outside [0, 5]", 3),
        (None, "COCO_val2014:sentid:1,x.jpg,nan,c2i_intrasim", "outside [0, 5]", 3),
        (None, "732091,x.jpg,3.0,c2i_intrasim", "not of the form COCO_val2014:sentid:N", 3),
        (None, "COCO_val2014:sentid:1,,3.0,c2i_intrasim", "empty image file name", 3),
    ],
)
def test_broken_sits_file_names_file_and_line(cxc_dir, tmp_path, header, row, problem, line):
    for name in ("sts_test.csv", "sis_test.csv"):
        (tmp_path / name).write_bytes((cxc_dir / name).read_bytes())
    good = f"{cap_id(T[0][0])},{TI[1]},3.0,c2i_intrasim"
    text = (header or "caption,image,agg_score,sampling_method") + "\n" + good + "\n" + (row or good) + "\n"
    (tmp_path / "sits_test.csv").write_text(text)
    with pytest.raises(DatasetError) as err:
        load_cxc(tmp_path, "test")
    assert f"sits_test.csv:{line}:" in str(err.value) and problem in str(err.value)


# --------------------------------------------------------------------------- positive rule


def test_positive_rule_threshold_and_skipped_rows(coco, cxc_dir):
    names, sids, img_of_cap = ids_of(coco)
    rel, stats = cxc_relevance(load_cxc(cxc_dir), names, sids, img_of_cap, threshold=3.0)
    expected = img_of_cap[None, :] == np.arange(4)[:, None]  # (4, 20) the COCO pairs
    expected[1, 0] = True  # SITS 3.0 included; (2, 1) at 2.99 is not
    np.testing.assert_array_equal(rel.dense, expected)
    assert stats["sits_rows"] == 6 and stats["sits_rows_in_split"] == 3 and stats["sits_rows_skipped"] == 3
    assert stats["sits_skipped_caption_not_in_split"] == 1
    assert stats["sits_skipped_image_not_in_split"] == 1
    assert stats["sits_skipped_both_not_in_split"] == 1
    assert stats["sits_rows_at_or_above_threshold"] == 2 and stats["sits_rows_original_pair"] == 1
    assert (stats["annotated_pairs"], stats["positives_added"], stats["positive_pairs"]) == (20, 1, 21)
    assert stats["i2t_positives_per_query"]["histogram"] == {"5": 3, "6": 1}
    assert stats["t2i_positives_per_query"]["histogram"] == {"1": 19, "2": 1}
    rel299, stats299 = cxc_relevance(load_cxc(cxc_dir), names, sids, img_of_cap, threshold=2.99)
    assert rel299.dense[2, 1] and rel299.dense[1, 0] and stats299["positives_added"] == 2


def hand_sim() -> np.ndarray:
    """Own pairs 0.5, everything else 0, except image 1 -> caption 0 and image 2 -> caption 1 at 0.9."""
    sim = np.where(np.arange(20)[None, :] // 5 == np.arange(4)[:, None], 0.5, 0.0)
    sim[1, 0] = 0.9
    sim[2, 1] = 0.9
    return sim


def test_hand_computed_metrics(coco, cxc_dir):
    names, sids, img_of_cap = ids_of(coco)
    sim = hand_sim()
    # Annotations only. t2i: captions 0 and 1 rank their image 2nd (0.9 elsewhere) -> R@1 18/20 = 90,
    # R-P (R = 1) 18/20 = 0.9. i2t: images 1 and 2 see a foreign caption at 0.9 first -> R@1 2/4 = 50;
    # their top 5 hold 4 of 5 own captions -> R-P (1 + 0.8 + 0.8 + 1) / 4 = 0.9. rsum 50+100+100+90+100+100.
    ann = ranking_metrics(sim, cxc_relevance(load_cxc(cxc_dir), names, sids, img_of_cap, 5.0)[0])
    assert (ann["t2i_r1"], ann["t2i_rprec"], ann["i2t_r1"], ann["i2t_rprec"]) == pytest.approx(
        (90, 0.9, 50, 0.9)
    )
    assert ann["rsum"] == pytest.approx(540)
    # CxC at 3.0 adds (image 1, caption 0). t2i caption 0: positives images 0 and 1 (R = 2), image 1
    # first -> rank 1, top 2 = {1, 0} -> R-P 1; caption 1 unchanged -> R@1 19/20 = 95, R-P 0.95.
    # i2t image 1: positives caption 0 + its own 5 (R = 6) all in the top 6 -> rank 1, R-P 1; image 2
    # unchanged -> R@1 3/4 = 75, R-P (1 + 1 + 0.8 + 1) / 4 = 0.95. rsum 75+100+100+95+100+100 = 570.
    cxc = ranking_metrics(sim, cxc_relevance(load_cxc(cxc_dir), names, sids, img_of_cap, 3.0)[0])
    assert (cxc["t2i_r1"], cxc["t2i_rprec"], cxc["i2t_r1"], cxc["i2t_rprec"]) == pytest.approx(
        (95, 0.95, 75, 0.95)
    )
    assert cxc["rsum"] == pytest.approx(570) and cxc["t2i_r5"] == 100 and cxc["i2t_medr"] == 1
    # At 2.99 (image 2, caption 1) joins too: every query ranks a positive first, R-P 1.
    low = ranking_metrics(sim, cxc_relevance(load_cxc(cxc_dir), names, sids, img_of_cap, 2.99)[0])
    assert (low["t2i_r1"], low["i2t_r1"], low["t2i_rprec"], low["i2t_rprec"]) == pytest.approx(
        (100, 100, 1, 1)
    )


def naive(scores: np.ndarray, relevant: np.ndarray) -> tuple[int, float]:
    """(1-based rank of the best positive, R-precision): sort by score, non-relevant first on ties."""
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], bool(relevant[j])))
    hits = [bool(relevant[j]) for j in order]
    r = sum(hits)
    return hits.index(True) + 1, sum(hits[:r]) / r


@pytest.mark.parametrize("seed", range(6))
def test_metrics_match_a_naive_loop_oracle(coco, seed, tmp_path):
    names, sids, img_of_cap = ids_of(coco)
    rng = np.random.default_rng(seed)
    sim = rng.normal(size=(4, 20))
    if seed % 2:
        sim = np.round(sim, 0)  # many ties
    n_rows = 25
    captions = [*sids, sentid("val", 0, 0), sentid("val", 2, 3)]
    images = [*names, filename("val", 1)]
    rows = [
        (
            cap_id(int(rng.choice(captions))),
            str(rng.choice(images)),
            round(float(rng.uniform(0, 5)), 1),
            "c2i_intrasim",
        )
        for _ in range(n_rows)
    ]
    d = tmp_path / "cxc"
    write_csv(d / "sits_test.csv", "caption,image,agg_score,sampling_method", rows)
    write_csv(d / "sts_test.csv", "caption1,caption2,agg_score,sampling_method", [])
    write_csv(d / "sis_test.csv", "image1,image2,agg_score,sampling_method", [])
    threshold = [3.0, 2.0, 4.0][seed % 3]
    rel, stats = cxc_relevance(load_cxc(d, "test"), names, sids, img_of_cap, threshold)
    # Oracle relevance from the definition, one pair at a time.
    truth = np.zeros((4, 20), dtype=bool)
    for i in range(4):
        for c in range(20):
            truth[i, c] = img_of_cap[c] == i or any(
                cap == cap_id(sids[c]) and im == names[i] and score >= threshold for cap, im, score, _ in rows
            )
    np.testing.assert_array_equal(rel.dense, truth)
    inside = sum(int(cap.split(":")[-1]) in sids and im in names for cap, im, _, _ in rows)
    assert stats["sits_rows_skipped"] == n_rows - inside
    got = ranking_metrics(sim, rel)
    for d_name, scores, relevant in (("i2t", sim, truth), ("t2i", sim.T, truth.T)):
        ranks, rprec = zip(*(naive(scores[q], relevant[q]) for q in range(len(scores))), strict=True)
        for k in (1, 5, 10):
            assert got[f"{d_name}_r{k}"] == pytest.approx(100 * np.mean(np.array(ranks) <= k))
        assert got[f"{d_name}_rprec"] == pytest.approx(np.mean(rprec))
        assert got[f"{d_name}_medr"] == np.floor(np.median(ranks))


# --------------------------------------------------------------------------- intramodal


def test_intramodal_pairs_and_metrics(coco, cxc_dir):
    names, sids, img_of_cap = ids_of(coco)
    cxc = load_cxc(cxc_dir)
    sts, sts_stats = intramodal_pairs(cxc.sts, sids, 3.0, groups=img_of_cap)
    assert sorted(map(tuple, sts.tolist())) == [(0, 5), (2, 3), (3, 2), (5, 0)]
    assert sts_stats["rows_skipped_not_in_split"] == 1 and sts_stats["positive_pairs_beyond_same_image"] == 1
    sis, sis_stats = intramodal_pairs(cxc.sis, names, 3.0)
    assert sorted(map(tuple, sis.tolist())) == [(0, 3), (3, 0)] and sis_stats["positive_pairs"] == 1
    # i2i by hand: image 0 has image 3 (R = 1), image 3 has image 0; images 1, 2 have none.
    emb = np.array([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [0.6, 0.8]])  # image 0 ranks 1 (0.8) before 3 (0.6)
    m = intramodal_metrics(emb, sis, "i2i")
    assert m["i2i_queries"] == 4 and m["i2i_queries_without_relevant"] == 2
    # Image 0 scores image 1 0.8, image 3 0.6 -> rank 2, R-P 0. Image 3 scores image 1 0.96, image 2
    # 0.8, image 0 0.6 -> rank 3, R-P 0. R@1 0, R@5 100, medr floor(median(2, 3)) = 2.
    assert (m["i2i_r1"], m["i2i_r5"], m["i2i_rprec"], m["i2i_medr"]) == pytest.approx((0.0, 100.0, 0.0, 2.0))


@pytest.mark.parametrize("seed", range(4))
def test_intramodal_matches_a_naive_loop_oracle(seed):
    rng = np.random.default_rng(seed)
    n = 17
    emb = rng.normal(size=(n, 3))
    if seed % 2:
        emb = np.round(emb)  # ties
    groups = rng.integers(0, 5, n)
    raw = rng.integers(0, n, (8, 2))
    pairs = np.unique(np.concatenate([raw, raw[:, ::-1]]), axis=0)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    got = intramodal_metrics(emb, pairs, "t2t", groups=groups, block_rows=5)
    ranks, rprecs = [], []
    for q in range(n):
        others = [j for j in range(n) if j != q]
        rel = [groups[j] == groups[q] or (q, j) in set(map(tuple, pairs.tolist())) for j in others]
        if any(rel):
            r, p = naive(emb[others] @ emb[q], rel)
            ranks.append(r)
            rprecs.append(p)
    assert got["t2t_queries_without_relevant"] == n - len(ranks)
    for k in (1, 5, 10):
        assert got[f"t2t_r{k}"] == pytest.approx(100 * np.mean(np.array(ranks) <= k))
    assert got["t2t_rprec"] == pytest.approx(np.mean(rprecs))


# --------------------------------------------------------------------------- split identity


def precomp_folder(coco: Path, name: str, captions: list[str] | None = None, n_img: int = 4) -> Path:
    """A precomp folder inside the COCO folder (dataset_coco.json in its parent)."""
    folder = coco / name
    folder.mkdir(exist_ok=True)
    np.save(folder / "testall_ims.npy", np.zeros((n_img, 6), dtype=np.float32))
    caps = captions or [
        caption_text("test", i, j).lower().rstrip(".") + " ." for i in range(4) for j in range(5)
    ]
    (folder / "testall_caps.txt").write_text("\n".join(caps[: 5 * n_img]) + "\n")
    return folder


def test_split_ids_for_precomp(coco):
    from icr.training.data.training_data import open_split

    folder = precomp_folder(coco, "precomp")
    data = open_split(folder, "testall")
    ids = split_ids(data.kind, data.source, "testall", data.captions, data.img_of_cap, data.num_images)
    assert ids.karpathy_split == "test" and ids.karpathy_json == coco / "dataset_coco.json"
    assert ids.filenames == TI and ids.sentids == [s for row in T for s in row]

    bad = precomp_folder(
        coco, "reversed", captions=[caption_text("test", i, j) for i in range(4) for j in range(5)][::-1]
    )
    data = open_split(bad, "testall")
    with pytest.raises(DatasetError, match="caption 0 of the evaluated split .* differs from caption 0"):
        split_ids(data.kind, data.source, "testall", data.captions, data.img_of_cap, data.num_images)

    short = precomp_folder(coco, "short", n_img=3)
    data = open_split(short, "testall")
    with pytest.raises(DatasetError, match="has 4 images but the evaluated split 'testall' has 3"):
        split_ids(data.kind, data.source, "testall", data.captions, data.img_of_cap, data.num_images)


def test_split_ids_without_a_karpathy_json(tmp_path):
    (tmp_path / "p").mkdir()
    with pytest.raises(DatasetError, match="--cxc-karpathy"):
        split_ids("precomp", tmp_path / "p", "testall", ["a"] * 5, np.zeros(5, dtype=np.int64), 1)


# --------------------------------------------------------------------------- icr evaluate --cxc


@pytest.fixture(scope="module")
def checkpoint(coco, tmp_path_factory) -> Path:
    from icr.training.config import load_config
    from icr.training.train import train

    run = tmp_path_factory.mktemp("cxc_run") / "run"
    cfg = load_config(
        None,
        [
            f'data.path="{coco}"',
            f'train.out="{run}"',
            "train.batch_size=8",
            "train.epochs=1",
            "train.max_steps=3",
            "data.val_images=4",
            "train.threads=1",
            *TINY_MODEL,
        ],
    )
    train(cfg, progress=False)
    return run / "last"


def test_cli_evaluate_cxc_section_equals_direct_metrics(coco, cxc_dir, checkpoint, tmp_path):
    from icr.cli import app
    from icr.training.checkpoint import load_checkpoint
    from icr.training.data.training_data import open_split
    from icr.training.embedding import embed_captions, embed_images

    out = tmp_path / "eval.json"
    run = CliRunner().invoke(
        app,
        [
            "evaluate",
            "-m",
            str(checkpoint),
            "-d",
            str(coco),
            "--quiet",
            "--calibration-split",
            "none",
            "--cxc",
            str(cxc_dir),
            "--cxc-threshold",
            "3.0",
            "--json",
            str(out),
        ],
    )
    assert run.exit_code == 0, run.output
    assert "CxC test" in run.output and "i2t R@1" in run.output and "R-P" in run.output
    rep = json.loads(out.read_text())
    section = rep["cxc"]
    assert section["split"] == "test" and section["threshold"] == 3.0
    assert section["stats"]["positives_added"] == 1 and section["stats"]["sits_rows_skipped"] == 3

    model, _ = load_checkpoint(checkpoint)
    split = open_split(coco, "test")
    img, cap = embed_images(model, split, batch_size=256), embed_captions(model, split.captions)
    names, sids, img_of_cap = ids_of(coco)
    rel, stats = cxc_relevance(load_cxc(cxc_dir), names, sids, img_of_cap, 3.0)
    direct = ranking_metrics(img @ cap.T, rel)
    assert section["retrieval"].keys() == direct.keys()
    for key, value in direct.items():
        assert section["retrieval"][key] == pytest.approx(value, abs=1e-9), key
    assert section["stats"] == json.loads(json.dumps(stats))
    sts, _ = intramodal_pairs(load_cxc(cxc_dir).sts, sids, 3.0)
    t2t = intramodal_metrics(cap, sts, "t2t", groups=img_of_cap)
    assert section["intramodal"]["t2t"] == pytest.approx(t2t)
    assert "i2i" in section["intramodal"]


def test_cli_evaluate_cxc_user_errors(coco, checkpoint, tmp_path):
    from icr.cli import app

    base = ["evaluate", "-m", str(checkpoint), "-d", str(coco), "--quiet", "--calibration-split", "none"]
    run = CliRunner().invoke(app, [*base, "--cxc", str(tmp_path)])
    assert run.exit_code == 2 and "sits_test.csv" in run.output and "Traceback" not in run.output
    run = CliRunner().invoke(app, [*base, "--cxc", str(tmp_path), "--cxc-threshold", "7"])
    assert run.exit_code == 2 and "--cxc-threshold" in run.output
    run = CliRunner().invoke(app, [*base, "--cxc", str(tmp_path), "--split", "train"])
    assert run.exit_code == 2 and "'val' and 'test'" in run.output
