"""Retrieval ranks and recall metrics against naive per-query oracles written here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from icr.training.evaluation.retrieval import (
    evaluate_embeddings,
    recall_metrics,
    retrieval_ranks,
    similarity,
)


# --- naive oracles: one Python loop per query --------------------------------------------------
def _argsort_ranks(sim: np.ndarray, img_of_cap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The seeds' procedure: sort each query's scores, 1-based position of the first GT."""
    n_img, n_cap = sim.shape
    i2t = []
    for i in range(n_img):
        order = np.argsort(-sim[i], kind="stable")
        i2t.append(next(p for p, c in enumerate(order) if img_of_cap[c] == i) + 1)
    t2i = []
    for c in range(n_cap):
        order = np.argsort(-sim[:, c], kind="stable")
        t2i.append(int(np.flatnonzero(order == img_of_cap[c])[0]) + 1)
    return np.array(i2t), np.array(t2i)


def _pessimistic_ranks(sim: np.ndarray, img_of_cap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each query with ties broken against the positives; 1-based position of the first GT."""
    n_img, n_cap = sim.shape
    i2t = []
    for i in range(n_img):
        # Primary key: score, descending; secondary: positives after negatives of equal score.
        order = sorted(range(n_cap), key=lambda c: (-sim[i, c], img_of_cap[c] == i))
        i2t.append(next(p for p, c in enumerate(order) if img_of_cap[c] == i) + 1)
    t2i = []
    for c in range(n_cap):
        order = sorted(range(n_img), key=lambda i: (-sim[i, c], i == img_of_cap[c]))
        t2i.append(order.index(int(img_of_cap[c])) + 1)
    return np.array(i2t), np.array(t2i)


def _naive_metrics(i2t: np.ndarray, t2i: np.ndarray) -> dict[str, float]:
    """The seeds' formulas on 0-based ranks: R@K = 100 * #(r < K) / n, medr = floor(median)+1."""
    out = {}
    for name, ranks in (("i2t", i2t), ("t2i", t2i)):
        zero_based = [int(r) - 1 for r in ranks]
        for k in (1, 5, 10):
            out[f"{name}_r{k}"] = 100.0 * sum(r < k for r in zero_based) / len(zero_based)
        out[f"{name}_medr"] = math.floor(float(np.median(zero_based))) + 1
        out[f"{name}_meanr"] = sum(zero_based) / len(zero_based) + 1
    return out


def _five_per_image(n_img: int) -> np.ndarray:
    return np.arange(5 * n_img) // 5


def _uneven_layout(rng: np.random.Generator, n_img: int) -> np.ndarray:
    """1-7 captions per image, shuffled so captions of one image are not contiguous."""
    layout = np.repeat(np.arange(n_img), rng.integers(1, 8, size=n_img))
    return rng.permutation(layout)


# --- ranks ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout_kind", ["five", "uneven"])
@pytest.mark.parametrize("block_rows", [None, 1, 7])
def test_ranks_match_argsort_oracle_without_ties(layout_kind: str, block_rows: int | None) -> None:
    rng = np.random.default_rng(0)
    n_img = 40
    layout = _five_per_image(n_img) if layout_kind == "five" else _uneven_layout(rng, n_img)
    # Correlated embeddings so ranks spread over the whole range, not just near the top.
    img = rng.standard_normal((n_img, 16)).astype(np.float32)
    cap = img[layout] + 1.5 * rng.standard_normal((layout.size, 16)).astype(np.float32)
    sim = similarity(img, cap)
    assert np.unique(sim).size == sim.size  # no ties: every tie-breaking rule agrees
    i2t, t2i = retrieval_ranks(sim, layout, block_rows=block_rows)
    want_i2t, want_t2i = _argsort_ranks(sim, layout)
    np.testing.assert_array_equal(i2t, want_i2t)
    np.testing.assert_array_equal(t2i, want_t2i)
    assert i2t.shape == (n_img,) and t2i.shape == (layout.size,)
    assert (i2t > 1).any() and (t2i > 10).any()  # the data exercises more than the top rank


@pytest.mark.parametrize("block_rows", [None, 1, 4])
def test_ranks_match_pessimistic_oracle_with_ties_and_duplicate_images(block_rows: int | None) -> None:
    rng = np.random.default_rng(1)
    n_img = 12
    layout = _uneven_layout(rng, n_img)
    sim = rng.integers(0, 4, size=(n_img, layout.size)).astype(np.float32)  # many ties
    sim[5] = sim[2]  # images 2 and 5 are duplicates: identical scores against every caption
    i2t, t2i = retrieval_ranks(sim, layout, block_rows=block_rows)
    want_i2t, want_t2i = _pessimistic_ranks(sim, layout)
    np.testing.assert_array_equal(i2t, want_i2t)
    np.testing.assert_array_equal(t2i, want_t2i)


def test_hand_made_ties_rank_pessimistically() -> None:
    # 3 images; captions 0,1 -> image 0, caption 2 -> image 1, caption 3 -> image 2.
    layout = np.array([0, 0, 1, 2])
    sim = np.array(
        [
            [0.5, 0.9, 0.9, 0.1],  # image 0: best GT 0.9 tied with caption 2 -> rank 2
            [0.2, 0.2, 0.2, 0.2],  # image 1: all equal -> behind the 3 negatives -> rank 4
            [0.3, 0.0, 0.1, 0.3],  # image 2: GT 0.3 tied with caption 0 -> rank 2
        ],
        dtype=np.float32,
    )
    i2t, t2i = retrieval_ranks(sim, layout)
    np.testing.assert_array_equal(i2t, [2, 4, 2])
    # t2i columns: caption 0 GT 0.5 vs 0.2, 0.3 -> 1; caption 1 GT 0.9 -> 1;
    # caption 2 GT 0.2 behind 0.9 -> 2; caption 3 GT 0.3 vs 0.1, 0.2 -> 1.
    np.testing.assert_array_equal(t2i, [1, 1, 2, 1])
    # Only the best-ranked positive counts for i2t; the other positive tied with it is not a competitor.
    i2t_two_pos, _ = retrieval_ranks(np.array([[0.7, 0.7, 0.7]], np.float32), np.array([0, 0, 0]))
    np.testing.assert_array_equal(i2t_two_pos, [1])


@pytest.mark.parametrize("layout_kind", ["five", "uneven"])
def test_collapsed_embeddings_get_the_worst_ranks(layout_kind: str) -> None:
    rng = np.random.default_rng(2)
    n_img = 30
    layout = _five_per_image(n_img) if layout_kind == "five" else _uneven_layout(rng, n_img)
    same = np.ones((1, 8), np.float32) / np.sqrt(8)
    img, cap = np.repeat(same, n_img, 0), np.repeat(same, layout.size, 0)  # a collapsed model
    i2t, t2i = retrieval_ranks(similarity(img, cap), layout)
    per_image = np.bincount(layout, minlength=n_img)
    np.testing.assert_array_equal(i2t, layout.size - per_image + 1)  # behind every other caption
    np.testing.assert_array_equal(t2i, np.full(layout.size, n_img))  # behind every other image
    metrics = recall_metrics(i2t, t2i)
    assert metrics["t2i_r1"] == 0.0 and metrics["i2t_r1"] == 0.0 and metrics["rsum"] == 0.0


def test_nan_scores_count_against_the_query() -> None:
    layout = np.array([0, 1, 2])
    sim = np.eye(3, dtype=np.float32)  # perfect retrieval
    sim[0, 1] = np.nan  # NaN negative for image 0 (i2t) and for caption 1 (t2i)
    sim[2, 2] = np.nan  # NaN positive of image 2 / caption 2
    i2t, t2i = retrieval_ranks(sim, layout)
    np.testing.assert_array_equal(i2t, [2, 1, 3])
    np.testing.assert_array_equal(t2i, [1, 2, 3])


def test_similarity_accepts_tensors_and_arrays() -> None:
    rng = np.random.default_rng(3)
    img, cap = rng.standard_normal((4, 6)), rng.standard_normal((9, 6))
    want = img.astype(np.float32) @ cap.astype(np.float32).T
    for a, b in [(img, cap), (torch.from_numpy(img), torch.from_numpy(cap)), (torch.from_numpy(img), cap)]:
        got = similarity(a, b)
        assert got.dtype == np.float32 and got.shape == (4, 9)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    img_t = torch.from_numpy(img).requires_grad_()
    assert similarity(img_t, torch.from_numpy(cap)).shape == (4, 9)  # no "requires grad" error


def test_invalid_inputs_raise_value_error() -> None:
    sim = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match="images \\[2\\]"):
        retrieval_ranks(sim, np.array([0, 0, 1, 1]))  # image 2 has no caption
    with pytest.raises(ValueError, match="\\[0, 3\\)"):
        retrieval_ranks(sim, np.array([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="one entry per caption"):
        retrieval_ranks(sim, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="integer"):
        retrieval_ranks(sim, np.array([0.0, 1.0, 2.0, 2.0]))
    with pytest.raises(ValueError, match="2-D"):
        retrieval_ranks(np.zeros(4, np.float32), np.array([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="same embedding size"):
        similarity(np.zeros((2, 3)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="1-based"):
        recall_metrics(np.array([0, 1]), np.array([1, 2]))
    with pytest.raises(ValueError, match="non-empty"):
        recall_metrics(np.array([], dtype=np.int64), np.array([1]))


# --- metrics --------------------------------------------------------------------------------------
def test_recall_metrics_hand_computed() -> None:
    metrics = recall_metrics(np.array([1, 2, 6, 11]), np.array([1, 2, 3, 4, 5, 10, 10, 30]))
    assert metrics == {
        "i2t_r1": 25.0, "i2t_r5": 50.0, "i2t_r10": 75.0, "i2t_medr": 4.0, "i2t_meanr": 5.0,
        "t2i_r1": 12.5, "t2i_r5": 62.5, "t2i_r10": 87.5, "t2i_medr": 4.0, "t2i_meanr": 8.125,
        "rsum": 25.0 + 50.0 + 75.0 + 12.5 + 62.5 + 87.5,
    }  # fmt: skip
    assert all(type(v) is float for v in metrics.values())
    # Even-length median between two ranks: floor, as the seeds do on 0-based ranks.
    assert recall_metrics(np.array([1, 2]), np.array([2, 3]))["i2t_medr"] == 1.0


@pytest.mark.parametrize("layout_kind", ["five", "uneven"])
def test_evaluate_embeddings_matches_oracle_metrics(layout_kind: str) -> None:
    rng = np.random.default_rng(4)
    n_img = 25
    layout = _five_per_image(n_img) if layout_kind == "five" else _uneven_layout(rng, n_img)
    img = rng.standard_normal((n_img, 8)).astype(np.float32)
    cap = img[layout] + rng.standard_normal((layout.size, 8)).astype(np.float32)
    metrics = evaluate_embeddings(torch.from_numpy(img), torch.from_numpy(cap), torch.from_numpy(layout))
    want = _naive_metrics(*_argsort_ranks(similarity(img, cap), layout))
    assert metrics.keys() == {*want, "rsum"}
    for key, value in want.items():
        assert metrics[key] == pytest.approx(value, abs=1e-9), key
    six = [metrics[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10)]
    assert metrics["rsum"] == pytest.approx(sum(six), abs=1e-9)
    assert 0 < metrics["rsum"] < 600  # neither trivial nor perfect


@pytest.mark.slow
def test_coco_5k_scale_runs_blockwise() -> None:
    # Full COCO 5K size: 5,000 images x 25,000 captions must work in bounded memory.
    rng = np.random.default_rng(5)
    sim = rng.random((5000, 25000), dtype=np.float32)
    layout = _five_per_image(5000)
    i2t, t2i = retrieval_ranks(sim, layout)
    # Spot-check a few queries against a direct count.
    for i in (0, 1234, 4999):
        own = sim[i, 5 * i : 5 * i + 5]
        assert i2t[i] == np.count_nonzero(sim[i] >= own.max()) - np.count_nonzero(own >= own.max()) + 1
    for c in (0, 7777, 24999):
        assert t2i[c] == np.count_nonzero(sim[:, c] >= sim[c // 5, c])
