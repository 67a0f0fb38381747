"""The service's search core (no HTTP): thresholded, paginated search against a numpy oracle,
the artifact agreement check, and settings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_model import TINY_MODEL

from icr.index.build import build_caption_index, build_image_index
from icr.index.calibration import calibrate_index
from icr.service.config import Settings
from icr.service.loaded_index import NotServable, preflight
from icr.service.retriever import Retriever
from icr.training.config import load_config
from icr.training.data.synthetic.generate import write_dataset

N_DISTRACTORS = 60


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    from icr.training.train import train  # the fixture trains a checkpoint; service/ never imports this

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("retriever")
    data = root / "data"
    write_dataset(data, train=40, val=16, test=16, image_size=32, seed=1)
    config = load_config(
        None,
        [
            f'data.path="{data}"',
            f'train.out="{root / "run"}"',
            "train.batch_size=8",
            "train.epochs=1",
            "train.max_steps=3",
            "data.val_images=16",
            "train.threads=1",
            *TINY_MODEL,
        ],
    )
    train(config, progress=False)
    checkpoint = root / "run" / "last"
    images, captions = root / "images", root / "captions"
    build_image_index(checkpoint, data, distractors=N_DISTRACTORS, out=images, progress=False, gpu="off")
    build_caption_index(checkpoint, data, out=captions, progress=False, gpu="off")
    calibrate_index(images, progress=False)
    return {"data": data, "checkpoint": checkpoint, "images": images, "captions": captions, "root": root}


@pytest.fixture(scope="module")
def retriever(built) -> Retriever:
    return Retriever.load(built["images"], caption_index=built["captions"], gpu="off")


def _oracle(retriever: Retriever, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every stored vector's score, best first (ties broken by id, as any order of ties is valid)."""
    index = retriever.images.index
    vectors = index.reconstruct_n(0, index.ntotal)  # (N, D)
    scores = vectors @ query[0]  # (N,)
    order = np.lexsort((np.arange(len(scores)), -scores))
    return scores[order], order


def _same_up_to_ties(ids: np.ndarray, scores: np.ndarray, oracle_scores: np.ndarray, oracle_ids: np.ndarray):
    np.testing.assert_allclose(scores, oracle_scores[: len(scores)], atol=1e-5)
    # ids may differ only inside a run of tied scores
    for i, (a, b) in enumerate(zip(ids, oracle_ids[: len(ids)], strict=True)):
        if a != b:
            assert abs(float(oracle_scores[i]) - float(scores[i])) < 1e-5


@pytest.mark.parametrize("text", ["a red circle", "a big blue square on a dark background", "star"])
def test_thresholds_and_pages_match_a_numpy_oracle(retriever: Retriever, text: str) -> None:
    query = retriever.encode_text(text)  # (1, D)
    oracle_scores, oracle_ids = _oracle(retriever, query)
    ntotal = len(oracle_scores)
    gap = next(i for i in range(20, ntotal - 1) if oracle_scores[i] - oracle_scores[i + 1] > 1e-4)
    calibration = retriever.images.calibration
    for threshold in (
        {},
        # between two distinct scores: FAISS and numpy may differ in the last bit of a score
        {"min_score": float(oracle_scores[gap] + oracle_scores[gap + 1]) / 2},
        {"min_score": 0.0},
        {"min_relevance": 0.2},
        {"min_relevance": 0.0},
    ):
        for depth, offset, k in ((ntotal, 0, 10), (ntotal, 7, 5), (30, 0, 30), (30, 25, 10)):
            page = retriever.search(
                retriever.images, query, k=k, offset=offset, depth=depth, text=text, timings={}, **threshold
            )
            top = oracle_scores[:depth]
            if "min_score" in threshold:
                keep = top >= threshold["min_score"]
            elif "min_relevance" in threshold:
                keep = calibration.relevance(top, query, text) >= threshold["min_relevance"]
            else:
                keep = np.ones(len(top), bool)
            passed = int(keep.sum())
            assert page.passed == passed and page.searched == depth
            assert page.passed_is_exact == (passed < depth or depth == ntotal)
            want = slice(offset, offset + k)
            _same_up_to_ties(page.ids, page.scores, top[keep][want], oracle_ids[:depth][keep][want])
            # the per-query map reads the whole retrieved list: the page's relevance is its window
            np.testing.assert_allclose(
                page.relevance, calibration.relevance(top, query, text)[keep][want], rtol=1e-5, atol=1e-6
            )
            assert page.calibration == "per_query"
            assert page.expected_relevant == pytest.approx(
                float(calibration.relevance(top, query, text)[keep].sum()), rel=1e-5
            )
            assert [r["id"] for r in page.rows] == page.ids.tolist()


@pytest.mark.parametrize("spec", [{"is_distractor": False}, {"is_distractor": True}])
def test_filtered_search_matches_an_oracle_over_the_matching_items(retriever: Retriever, spec) -> None:
    """Only matching items are searched, thresholded and counted; a hit's relevance is the one the
    unfiltered list gives it (hits below that list: appended to it, so never above its last)."""
    from icr.index.filters import parse_filter

    text = "a red circle"
    query = retriever.encode_text(text)  # (1, D)
    oracle_scores, oracle_ids = _oracle(retriever, query)
    gallery = retriever.images.manifest.gallery_count
    match = (oracle_ids >= gallery) == spec["is_distractor"]  # distractors follow the gallery's ids
    calibration = retriever.images.calibration
    filter_ = parse_filter(spec, [])
    for depth in (retriever.images.manifest.ntotal, 20):
        full = calibration.relevance(oracle_scores[:depth], query, text)  # the unfiltered list's map
        page = retriever.search(
            retriever.images, query, k=1000, offset=0, depth=depth, text=text, filter_=filter_, timings={}
        )
        want = min(depth, int(match.sum()))
        assert page.matched == int(match.sum()) and page.searched == want and page.passed == want
        _same_up_to_ties(page.ids, page.scores, oracle_scores[match][:want], oracle_ids[match][:want])
        in_list = {int(i): r for i, r in zip(oracle_ids[:depth], full, strict=True)}
        for hit, relevance in zip(page.ids, page.relevance, strict=True):
            if int(hit) in in_list:
                assert relevance == pytest.approx(in_list[int(hit)], abs=1e-6)
            else:
                assert relevance <= full[-1] + 1e-9
        assert np.all(np.diff(page.relevance) <= 1e-12)  # non-increasing: min_relevance keeps a prefix
        strict = retriever.search(
            retriever.images, query, k=1000, offset=0, depth=depth, text=text, filter_=filter_,
            min_relevance=0.3, timings={},
        )  # fmt: skip
        assert strict.passed == int((page.relevance >= 0.3).sum()) and np.all(strict.relevance >= 0.3)


@pytest.mark.parametrize("spec", [None, {"is_distractor": False}, {"is_distractor": True}])
def test_a_search_from_a_stored_image_leaves_it_out_and_matches_a_numpy_oracle(
    retriever: Retriever, spec
) -> None:
    """The query is the image's own stored vector; without it, the ranking is numpy's over every
    other stored vector (among those the filter selects), ``depth`` of them still searched."""
    from icr.index.filters import parse_filter

    images = retriever.images
    vectors = images.index.reconstruct_n(0, images.index.ntotal)  # (N, D)
    ntotal, gallery = len(vectors), images.manifest.gallery_count
    filter_ = parse_filter(spec, [])
    for item in (0, 5, ntotal - 1):
        query = retriever.stored_vector(images, item)  # (1, D)
        np.testing.assert_allclose(query[0], vectors[item] / np.linalg.norm(vectors[item]), atol=1e-6)
        scores = vectors @ query[0]  # (N,)
        order = np.lexsort((np.arange(ntotal), -scores))
        selected = np.ones(ntotal, bool) if spec is None else (order >= gallery) == spec["is_distractor"]
        for exclude, depth in ((item, ntotal), (item, 20), (None, 20)):
            keep = selected & (order != exclude)
            want = min(depth, int(keep.sum()))
            page = retriever.search(
                images, query, k=1000, offset=0, depth=depth, calibrated=False, filter_=filter_,
                exclude=exclude, timings={},
            )  # fmt: skip
            assert page.searched == page.passed == want
            if exclude is not None:
                assert item not in page.ids
            assert page.passed_is_exact == (want == int(keep.sum()))
            _same_up_to_ties(page.ids, page.scores, scores[order][keep][:want], order[keep][:want])
    with pytest.raises(KeyError):
        retriever.stored_vector(images, ntotal)


def test_min_relevance_reports_the_equivalent_raw_score(retriever: Retriever) -> None:
    query = retriever.encode_text("a green triangle")
    page = retriever.search(
        retriever.images,
        query,
        k=100,
        offset=0,
        depth=100,
        min_relevance=0.3,
        text="a green triangle",
        timings={},
    )
    # this query's equivalent: the lowest retrieved score that passed (None when none did)
    score = float(page.scores.min()) if page.passed else None
    assert page.threshold == {"kind": "min_relevance", "value": 0.3, "score": score}
    assert page.passed <= 100 and np.all(page.relevance >= 0.3)


def test_caption_index_borrows_the_image_calibration(retriever: Retriever) -> None:
    assert retriever.captions.calibration is retriever.images.calibration
    query = retriever.encode_image(retriever.gallery.image(0))  # (1, D)
    page = retriever.search(retriever.captions, query, k=5, offset=0, depth=80, timings={})
    assert page.searched == 80 and all(r["captions"] for r in page.rows)
    # image queries: the global map (the per-query map is fitted on text queries)
    assert page.calibration == "global"
    np.testing.assert_allclose(page.relevance, retriever.images.calibration.global_map(page.scores))


def test_images_come_from_files_and_the_distractor_generator(retriever: Retriever, built) -> None:
    first = np.asarray(retriever.gallery.image(0))
    assert first.shape == (32, 32, 3)
    distractor = retriever.gallery.image(16)  # id 16: distractor 0
    assert np.asarray(distractor).shape == (32, 32, 3)
    with pytest.raises(KeyError):
        retriever.gallery.image(16 + N_DISTRACTORS)


def test_preflight_names_what_does_not_belong_together(built, tmp_path) -> None:
    checkpoint, config = preflight(built["images"], None, built["captions"])
    assert checkpoint == built["checkpoint"] and config.embed_dim == 32
    other = tmp_path / "other"
    shutil.copytree(built["checkpoint"], other)
    meta = json.loads((other / "config.json").read_text())
    meta["weights_sha256"] = "f" * 64
    (other / "config.json").write_text(json.dumps(meta))
    with pytest.raises(NotServable, match="icr index build"):
        preflight(built["images"], other, None)
    with pytest.raises(NotServable, match="--caption-index"):
        preflight(built["captions"], None, None)
    with pytest.raises(NotServable, match="expected text"):
        preflight(built["images"], None, built["images"])
    stale = tmp_path / "stale"
    shutil.copytree(built["images"], stale)
    calibration = json.loads((stale / "calibration.json").read_text())
    calibration["checkpoint_sha256"] = "0" * 64
    (stale / "calibration.json").write_text(json.dumps(calibration))
    with pytest.raises(NotServable, match="icr index calibrate"):
        Retriever.load(stale, gpu="off")
    for garbage in ("{not json", "[]", json.dumps({"format_version": 2})):
        (stale / "calibration.json").write_text(garbage)
        with pytest.raises(NotServable, match=rf"calibration.json.*icr index calibrate {stale}"):
            Retriever.load(stale, gpu="off")


def test_settings_come_from_the_environment_and_name_known_datasets(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ICR_INDEX", "/idx")
    monkeypatch.setenv("ICR_MAX_K", "7")
    monkeypatch.setenv("ICR_DATASETS", '{"coco": "/data/coco"}')
    settings = Settings()
    assert (settings.index, settings.max_k, settings.datasets) == (
        Path("/idx"),
        7,
        {"coco": Path("/data/coco")},
    )
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert settings.jobs_path == tmp_path / "state" / "icr" / "jobs.sqlite"  # never inside the index folder
    monkeypatch.setenv("ICR_STATE_DIR", "/srv/icr")
    assert Settings().jobs_path == Path("/srv/icr/jobs.sqlite")
    env_file = tmp_path / "icr.env"
    env_file.write_text("ICR_PORT=9001\nICR_API_KEY=k\n")
    from_file = Settings(_env_file=env_file)
    assert (from_file.port, from_file.api_key) == (9001, "k")
    monkeypatch.setenv("ICR_DATASETS", '{"imagenet": "/x"}')
    with pytest.raises(ValueError, match="flickr30k, coco, synthetic"):
        Settings()


def test_thumbnails_come_from_a_size_bounded_cache(retriever: Retriever) -> None:
    from icr.service.gallery_images import BytesLRU

    cache = BytesLRU(10)
    cache.put("a", b"1234")
    cache.put("b", b"5678")
    assert cache.get("a") == b"1234"  # now the most recent
    cache.put("c", b"90ab")  # 12 bytes > 10: the least recent ("b") goes
    assert cache.get("b") is None and cache.get("a") == b"1234" and cache.get("c") == b"90ab"
    cache.put("huge", b"x" * 11)  # larger than the whole cache: never stored
    assert cache.get("huge") is None and cache.size == 8

    gallery = retriever.gallery
    first = gallery.png(3, 16)
    assert gallery._thumbs.get((3, 16)) == first and gallery.png(3, 16) is first  # served from the cache
    assert gallery.png(3, None) != first  # full size is never cached
