"""Oracle tests of the four Veit & Wilber softmax losses against naive loops over the batch.

Embeddings are small multiples of 1/4, so every score is exact in floating point: tied scores are
exactly tied in both the loss and the oracle, and the tie-breaking rule (lower index first) is
tested, not left to rounding. Image ids repeat, so masked duplicates are exercised too.
"""

from __future__ import annotations

import math

import pytest
import torch

from icr.training.losses import LOSSES
from icr.training.losses.cross_example_mining import CrossExampleMiningLoss
from icr.training.losses.cross_example_softmax import CrossExampleSoftmaxLoss
from icr.training.losses.sampled_softmax import SampledSoftmaxLoss
from icr.training.losses.snm import StochasticNegativeMiningLoss
from icr.training.losses.softmax_family import kept_count, masked_logsumexp


# --- naive oracle ------------------------------------------------------------------------------
def oracle_loss(
    img, cap, img_ids, name, direction="t2i", scale=20.0, keep_fraction=0.5, k=None, mask_duplicates=True
):
    """The paper's formulas with python loops: -log(e^p / (e^p + sum over the negative set e^n))."""
    n = img.shape[0]
    score = [
        [scale * sum(img[i, d] * cap[j, d] for d in range(img.shape[1])) for j in range(n)] for i in range(n)
    ]
    ids = img_ids.tolist()

    def is_negative(i, j):  # image row i vs caption column j
        return i != j and not (mask_duplicates and ids[i] == ids[j])

    def top(entries, count):  # entries: (score, tie key); the largest first, ties by lower key
        return [s for s, _ in sorted(entries, key=lambda e: (-float(e[0].detach()), e[1]))[:count]]

    def keep(count):
        return count if count == 0 else math.ceil(round(keep_fraction * count, 6))

    shared = [(score[i][j], i * n + j) for i in range(n) for j in range(n) if is_negative(i, j)]
    if name == "cross_example_mining":
        shared = [(s, 0) for s in top(shared, keep(len(shared)))]

    directions = ["i2t", "t2i"] if direction == "both" else [direction]
    total = 0.0
    for d in directions:
        per_query = []
        for q in range(n):
            if name.startswith("cross_example"):
                negatives = [s for s, _ in shared]
            else:
                if d == "i2t":
                    own = [(score[q][j], j) for j in range(n) if is_negative(q, j)]
                else:
                    own = [(score[i][q], i) for i in range(n) if is_negative(i, q)]
                if name == "sampled_softmax":
                    negatives = [s for s, _ in own]
                else:
                    negatives = top(own, keep(len(own)) if k is None else min(k, len(own)))
            positive = torch.exp(score[q][q])
            denominator = positive + sum((torch.exp(s) for s in negatives), torch.zeros(()))
            per_query.append(-torch.log(positive / denominator))
        total = total + sum(per_query) / n
    return total / len(directions)


def make_batch(n, seed, d=4):
    """Quantised embeddings with duplicated vectors (ties) and repeated image ids."""
    g = torch.Generator().manual_seed(seed)
    img = torch.randint(-2, 3, (n, d), generator=g).double() / 4
    cap = torch.randint(-2, 3, (n, d), generator=g).double() / 4
    img_ids = torch.arange(n)
    if n >= 4:
        cap[1] = cap[0]  # tied columns
        img[3] = img[2]  # tied rows
        img_ids[2] = img_ids[1]  # a duplicate image (a second caption of image 1)
    if n >= 7:
        img_ids[6] = img_ids[5] = img_ids[4]  # three captions of one image
    return img.requires_grad_(), cap.requires_grad_(), img_ids


def terms_of(loss, img, cap, img_ids):
    """Float64 route through the hook (the base's forward computes in float32)."""
    pos = img_ids[:, None] == img_ids[None, :]
    if not loss.mask_duplicates:
        pos = torch.eye(len(img_ids), dtype=torch.bool)
    return loss.terms(img @ cap.T, pos)


CASES = [
    (SampledSoftmaxLoss, "sampled_softmax", {}),
    (StochasticNegativeMiningLoss, "snm", {}),
    (StochasticNegativeMiningLoss, "snm", {"keep_fraction": 0.3}),
    (StochasticNegativeMiningLoss, "snm", {"keep_fraction": 1.0}),
    (StochasticNegativeMiningLoss, "snm", {"k": 1}),
    (StochasticNegativeMiningLoss, "snm", {"k": 3}),
    (CrossExampleSoftmaxLoss, "cross_example_softmax", {}),
    (CrossExampleMiningLoss, "cross_example_mining", {}),
    (CrossExampleMiningLoss, "cross_example_mining", {"keep_fraction": 0.1}),
    (CrossExampleMiningLoss, "cross_example_mining", {"keep_fraction": 1.0}),
]


@pytest.mark.parametrize("direction", ["t2i", "i2t", "both"])
@pytest.mark.parametrize(("cls", "name", "params"), CASES)
@pytest.mark.parametrize(("n", "seed", "mask_duplicates"), [(8, 0, True), (7, 1, False), (5, 2, True)])
def test_matches_naive_loop(cls, name, params, direction, n, seed, mask_duplicates):
    img, cap, img_ids = make_batch(n, seed)
    scale = 20.0 if seed != 1 else 7.5
    loss = cls(direction=direction, scale=scale, mask_duplicates=mask_duplicates, **params)
    terms = terms_of(loss, img, cap, img_ids)
    expected_names = {"i2t", "t2i"} if direction == "both" else {direction}
    assert set(terms) == expected_names
    got = sum(terms.values())
    want = oracle_loss(
        img, cap, img_ids, name, direction=direction, scale=scale, mask_duplicates=mask_duplicates, **params
    )
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, (img, cap)), torch.autograd.grad(want, (img, cap)))


@pytest.mark.parametrize(("cls", "name", "params"), CASES)
def test_forward_through_the_base(cls, name, params):
    """The public forward (float32 similarity, positives from ids) agrees with the oracle too."""
    img, cap, img_ids = make_batch(8, 3)
    out = cls(**params)(img.float(), cap.float(), img_ids, img_ids)
    want = oracle_loss(img, cap, img_ids, name, **params)
    torch.testing.assert_close(out["loss"], want.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["loss"], out["t2i"])


@pytest.mark.parametrize(("cls", "name", "params"), CASES)
@pytest.mark.parametrize("direction", ["t2i", "both"])
def test_nothing_to_contrast_gives_zero_and_finite_gradients(cls, name, params, direction):
    for n, img_ids in [(1, torch.tensor([7])), (3, torch.tensor([4, 4, 4]))]:  # batch of 1; all duplicates
        img, cap, _ = make_batch(n, 4)
        loss = cls(direction=direction, **params)
        value = sum(terms_of(loss, img, cap, img_ids).values())
        grads = torch.autograd.grad(value, (img, cap))
        assert float(value.detach()) == 0.0
        assert all(bool(torch.isfinite(g).all()) for g in grads)
        out = loss(img.float(), cap.float(), img_ids, img_ids)  # also through the float32 forward
        assert float(out["loss"].detach()) == 0.0


def test_single_negative_keeps_its_gradient():
    """Batch of 2: one negative per query; the loss is softplus(scale*(s_neg - s_pos)) exactly."""
    img, cap, img_ids = make_batch(2, 5)
    for cls in (SampledSoftmaxLoss, StochasticNegativeMiningLoss):  # (mining shares its one kept negative)
        value = sum(terms_of(cls(direction="i2t"), img, cap, img_ids).values())
        s = img @ cap.T
        want = (
            torch.nn.functional.softplus(20 * (s[0, 1] - s[0, 0]))
            + torch.nn.functional.softplus(20 * (s[1, 0] - s[1, 1]))
        ) / 2
        torch.testing.assert_close(value, want)
        torch.testing.assert_close(
            torch.autograd.grad(value, (img, cap)), torch.autograd.grad(want, (img, cap))
        )


def test_cross_example_penalises_another_query_s_negative():
    """The defining difference: a hard negative in another query's row raises every query's loss."""
    sim = torch.eye(3, dtype=torch.float64) * 0.5
    pos = torch.eye(3, dtype=torch.bool)
    harder = sim.clone()
    harder[0, 1] = 0.9  # only image 0 / caption 1 gets harder
    for cls, moves in [(SampledSoftmaxLoss, False), (CrossExampleSoftmaxLoss, True)]:
        loss = cls(direction="t2i")
        before = torch.nn.functional.softplus(loss.negative_lse(20 * sim, ~pos, "t2i") - 10).tolist()
        after = torch.nn.functional.softplus(loss.negative_lse(20 * harder, ~pos, "t2i") - 10).tolist()
        assert (after[2] > before[2]) is moves  # caption 2's query never sees S[0, 1] in sampled softmax


def test_masked_logsumexp_on_empty_and_full_sets():
    x = torch.tensor([[1.0, 2.0, 3.0], [5.0, -1.0, 0.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, True], [False, False, False]])
    lse = masked_logsumexp(x, mask, dim=1)
    torch.testing.assert_close(lse[0], torch.logsumexp(x[0], dim=0))
    assert lse[1] == float("-inf")
    (grad,) = torch.autograd.grad(torch.nn.functional.softplus(lse - 1).sum(), x)
    assert bool(torch.isfinite(grad).all()) and bool((grad[1] == 0).all())


def test_registered_names_and_defaults():
    assert LOSSES["sampled_softmax"] is SampledSoftmaxLoss
    assert LOSSES["snm"] is StochasticNegativeMiningLoss
    assert LOSSES["cross_example_softmax"] is CrossExampleSoftmaxLoss
    assert LOSSES["cross_example_mining"] is CrossExampleMiningLoss
    assert StochasticNegativeMiningLoss.defaults() == {
        "mask_duplicates": True,
        "scale": 20.0,
        "direction": "t2i",
        "keep_fraction": 0.5,
        "k": None,
    }
    assert CrossExampleMiningLoss(keep_fraction=0.25, direction="both").params()["keep_fraction"] == 0.25
    assert all(cls.sampling == "caption" for cls in (SampledSoftmaxLoss, CrossExampleSoftmaxLoss))


@pytest.mark.parametrize(
    ("cls", "params", "message"),
    [
        (SampledSoftmaxLoss, {"direction": "text"}, "direction"),
        (SampledSoftmaxLoss, {"scale": 0.0}, "scale"),
        (CrossExampleSoftmaxLoss, {"scale": float("nan")}, "scale"),
        (StochasticNegativeMiningLoss, {"keep_fraction": 0.0}, "keep_fraction"),
        (StochasticNegativeMiningLoss, {"k": 0}, "k must be"),
        (StochasticNegativeMiningLoss, {"k": True}, "k must be"),
        (CrossExampleMiningLoss, {"keep_fraction": 1.5}, "keep_fraction"),
    ],
)
def test_bad_parameters_raise(cls, params, message):
    with pytest.raises(ValueError, match=message):
        cls(**params)


def test_kept_count_is_the_ceiling_without_float_noise():
    n = torch.tensor([0, 1, 2, 3, 10, 511])
    assert kept_count(n, 0.5).tolist() == [0, 1, 1, 2, 5, 256]
    assert kept_count(torch.tensor([100, 50]), 0.07).tolist() == [7, 4]  # 0.07 * 100 = 7.000000000000001
