"""The running top-k shared by the exact kernel and ``icr evaluate``'s distractor pass, against
naive loops written here: streamed blocks of any size, ties by lower id, rows grouped at any
number of queries (the 16-bit radix-sort key and the wider one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icr.core import top_k
from icr.core.top_k import SAMPLE, RunningTopK, grouped_by_row, padded_queries


@pytest.mark.parametrize("q", [3, 70_000])  # up to 65,536 queries the sort key is 16 bits wide
def test_grouped_by_row_matches_a_loop(q: int) -> None:
    rng = np.random.default_rng(q)
    n = 500
    rows = rng.integers(0, q, n) if q < 100 else rng.choice([0, 7, 65_535, 65_536, 69_999], n)
    scores = rng.random(n).astype(np.float32)
    ids = rng.integers(0, 10**6, n)
    pad_s, pad_i = grouped_by_row(rows, scores, ids, q)
    width = max(np.bincount(rows, minlength=q))
    assert pad_s.shape == pad_i.shape == (q, width)
    for row in set(rows.tolist()):
        mine = [(s, i) for r, s, i in zip(rows, scores, ids, strict=True) if r == row]  # arrival order
        assert pad_s[row, : len(mine)].tolist() == [s for s, _ in mine]
        assert pad_i[row, : len(mine)].tolist() == [i for _, i in mine]
        assert (pad_i[row, len(mine) :] == -1).all() and np.isneginf(pad_s[row, len(mine) :]).all()
    assert grouped_by_row(rows[:0], scores[:0], ids[:0], q)[0].shape == (q, 0)


@pytest.mark.parametrize("seed", range(6))
def test_streamed_blocks_keep_the_exact_top_k(seed: int) -> None:
    rng = np.random.default_rng(seed)
    q, n, k = int(rng.integers(1, 20)), int(rng.integers(1, 300)), int(rng.integers(1, 40))
    scores = rng.integers(-3, 4, size=(n, q)).astype(np.float32)  # few values: many ties
    top = RunningTopK(q, k, None)
    padded_width = len(padded_queries(np.zeros((q, 1), np.float32)))
    start = 0
    while start < n:
        b = int(rng.integers(1, 50))
        block = np.full((min(b, n - start), padded_width), 99.0, np.float32)  # padding columns never count
        block[:, :q] = scores[start : start + b]
        top.offer(torch.from_numpy(block), start)
        start += b
    got_s, got_i = top.result()
    for i in range(q):
        ranked = sorted(range(n), key=lambda j: (-scores[j, i], j))[:k]
        assert got_i[i].tolist() == ranked
        assert got_s[i].tolist() == scores[ranked, i].tolist()


@pytest.mark.parametrize("seed", range(6))
def test_a_first_block_without_a_tie_at_its_cut_is_taken_whole(seed: int) -> None:
    """Distinct scores: the first block's exact top k become the running k best with no comparison
    pass (nothing pending), and later blocks still compete; the result is the naive loop's."""
    rng = np.random.default_rng(seed)
    q, k = int(rng.integers(1, 12)), int(rng.integers(1, 30))
    n = int(rng.integers(k + 1, 400))
    scores = rng.standard_normal((n, q)).astype(np.float32)  # distinct with probability one
    padded_width = len(padded_queries(np.zeros((q, 1), np.float32)))
    blocks = np.full((n, padded_width), 99.0, np.float32)  # padding columns never count
    blocks[:, :q] = scores
    top = RunningTopK(q, k, None)
    first = int(rng.integers(k + 1, n + 1))
    top.offer(torch.from_numpy(blocks[:first]), 0)
    assert not top._pending and top.ids.shape == (q, k)  # taken outright
    for start in range(first, n, 37):
        top.offer(torch.from_numpy(blocks[start : start + 37]), start)
    got_s, got_i = top.result()
    for i in range(q):
        ranked = sorted(range(n), key=lambda j: (-scores[j, i], j))[:k]
        assert got_i[i].tolist() == ranked
        assert got_s[i].tolist() == scores[ranked, i].tolist()


def test_a_tie_at_the_first_blocks_cut_goes_to_the_lower_id() -> None:
    """k = 2 over 5, 4, 4 (ids 0, 1, 2), then 4 again (id 3): the tie at the cut keeps id 1."""
    top = RunningTopK(1, 2, None)
    top.offer(torch.tensor([[5.0], [4.0], [4.0]]), 0)
    top.offer(torch.tensor([[4.0], [3.0]]), 3)
    scores, ids = top.result()
    assert ids.tolist() == [[0, 1]] and scores.tolist() == [[5.0, 4.0]]


def whole_block_topks(monkeypatch, rows: int) -> list:
    """The shapes of the torch.topk calls from now on that rank every one of a block's ``rows``."""
    whole = []
    real_topk = torch.topk

    def spy(values, *args, **kwargs):
        if values.shape[0] == rows:
            whole.append(values.shape)
        return real_topk(values, *args, **kwargs)

    monkeypatch.setattr(torch, "topk", spy)
    return whole


@pytest.mark.parametrize("layout", ["distinct", "sampled_rows_best", "ties", "too_many_queries"])
def test_a_long_first_blocks_top_k_is_found_above_a_sampled_cut(layout: str, monkeypatch) -> None:
    """A first block of at least 2 x SAMPLE x (k + 1) rows: its top k are looked for above a cut
    from every SAMPLE-th row (no top-k over the whole block), unless the cut lets too few through
    (the sampled rows hold the best scores) or a tie sits at the k-th (then the comparison path).
    Every case gives the naive loop's answer. Past SAMPLED_MAX wanted pairs (a large evaluation's
    thousands of queries) the block is ranked whole: the passing triples would take gigabytes."""
    rng = np.random.default_rng(7)
    q, k = 5, 20
    n = 2 * SAMPLE * (k + 1) + 37
    if layout == "too_many_queries":  # more (query, rank) pairs than SAMPLED_MAX: ranked whole
        monkeypatch.setattr(top_k, "SAMPLED_MAX", q * (k + 1) - 1)
    if layout == "ties":
        scores = rng.integers(-3, 4, size=(n, q)).astype(np.float32)
    else:
        scores = rng.standard_normal((n, q)).astype(np.float32)
    if layout == "sampled_rows_best":  # every sampled row beats every other: the cut is too high
        scores[::SAMPLE] += 100
    padded_width = len(padded_queries(np.zeros((q, 1), np.float32)))
    block = np.full((n, padded_width), 99.0, np.float32)
    block[:, :q] = scores
    whole = whole_block_topks(monkeypatch, n)
    top = RunningTopK(q, k, None)
    top.offer(torch.from_numpy(block), 0)
    # a tie at the k-th: the comparison path's provisional cut is the sampled top-k's k-th
    assert bool(whole) == (layout in ("sampled_rows_best", "too_many_queries"))
    got_s, got_i = top.result()
    for i in range(q):
        ranked = sorted(range(n), key=lambda j: (-scores[j, i], j))[:k]
        assert got_i[i].tolist() == ranked
        assert got_s[i].tolist() == scores[ranked, i].tolist()


@pytest.mark.parametrize("layout", ["distinct", "sampled_rows_best", "ties"])
def test_a_window_keeps_everything_within_it_of_the_k_th_best(layout: str, monkeypatch) -> None:
    """With a window (the bf16 scans' candidates), a long first block's provisional cut comes from
    its sampled top k (no top-k over the whole block unless the sample misleads) and later blocks
    compete: the candidates are exactly the ids whose score is within the window of the k-th best."""
    rng = np.random.default_rng(3)
    q, k = 4, 20
    first = 2 * SAMPLE * (k + 1) + 11
    n = first + 500
    if layout == "ties":
        scores = rng.integers(-6, 7, size=(n, q)).astype(np.float32) / 4
    else:
        scores = rng.standard_normal((n, q)).astype(np.float32)
    if layout == "sampled_rows_best":
        scores[:first:SAMPLE] += 100
    window = np.array([0.0, 0.05, 0.25, 1.0], np.float32)  # (Q,)
    padded_width = len(padded_queries(np.zeros((q, 1), np.float32)))
    whole = whole_block_topks(monkeypatch, first)
    top = RunningTopK(q, k, window)
    for start, stop in ((0, first), (first, n)):
        block = np.full((stop - start, padded_width), 99.0, np.float32)
        block[:, :q] = scores[start:stop]
        top.offer(torch.from_numpy(block), start)
    assert bool(whole) == (layout == "sampled_rows_best")
    got = top.candidates()
    for i in range(q):
        kth = sorted(scores[:, i].tolist(), reverse=True)[k - 1]
        want = {j for j in range(n) if scores[j, i] >= np.float32(kth - window[i])}
        assert set(got[i][got[i] >= 0].tolist()) == want


@pytest.mark.parametrize("seed", range(8))
def test_a_floor_offers_only_what_reaches_it_and_says_where_it_was_too_high(seed: int) -> None:
    """Scores below the floor are never kept; a query is unsure exactly when fewer than k reach the
    floor, or (with a window) when its k-th best less the window is below it. A sure query's answer
    is the naive loop's."""
    rng = np.random.default_rng(seed)
    q, k, n = 6, int(rng.integers(1, 30)), int(rng.integers(40, 400))
    scores = rng.integers(-8, 9, size=(n, q)).astype(np.float32)  # ties at the floor and the k-th
    floor = rng.integers(-8, 9, size=q).astype(np.float32)
    for window in (None, np.full(q, 2.0, np.float32)):
        top = RunningTopK(q, k, window, floor)
        padded_width = len(padded_queries(np.zeros((q, 1), np.float32)))
        for start in range(0, n, 37):
            block = np.full((min(37, n - start), padded_width), 99.0, np.float32)
            block[:, :q] = scores[start : start + 37]
            top.offer(torch.from_numpy(block), start)
        unsure = top.unsure()
        got = top.result() if window is None else (None, top.candidates())
        for i in range(q):
            ranked = sorted(range(n), key=lambda j: (-scores[j, i], j))
            kth = scores[ranked[k - 1], i]
            reaching = (scores[:, i] >= floor[i]).sum()
            short = reaching < k or (window is not None and kth - window[i] < floor[i])
            assert unsure[i] == short
            kept = got[1][i][got[1][i] >= 0]
            assert all(scores[j, i] >= floor[i] for j in kept)
            if short:
                continue
            if window is None:
                assert kept.tolist() == ranked[:k]
            else:
                assert set(kept.tolist()) == {j for j in range(n) if scores[j, i] >= kth - window[i]}
