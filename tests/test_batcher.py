"""The micro-batcher: concurrent searches merged into one FAISS call give each caller exactly what a
search of its own query would, errors reach every caller of the batch, and a lone caller waits for
nothing."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np
import pytest

from icr.index.vector_index import search
from icr.service.batcher import MicroBatcher


@pytest.fixture(scope="module")
def flat() -> tuple[faiss.Index, np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((2000, 16), dtype=np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    index = faiss.IndexFlatIP(16)
    index.add(base)
    queries = rng.standard_normal((64, 16), dtype=np.float32)
    return index, queries / np.linalg.norm(queries, axis=1, keepdims=True)


def _slow(index: faiss.Index, calls: list[int], delay: float = 0.02):
    def run(queries: np.ndarray, k: int):
        calls.append(len(queries))
        time.sleep(delay)  # long enough for the other callers to queue up
        return search(index, queries, k)

    return run


def test_concurrent_callers_get_their_own_exact_results_from_fewer_calls(flat) -> None:
    index, queries = flat
    calls: list[int] = []
    batcher = MicroBatcher(_slow(index, calls), max_batch=8)
    ks = [1 + (i * 7) % 50 for i in range(len(queries))]  # every caller asks for its own depth
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: batcher.search(queries[i : i + 1], ks[i]), range(len(queries))))
    for i, (scores, ids) in enumerate(got):
        # oracle: brute force in numpy, this query alone
        exact = index.reconstruct_n(0, index.ntotal) @ queries[i]
        order = np.argsort(-exact, kind="stable")[: ks[i]]
        assert len(ids) == ks[i]
        np.testing.assert_allclose(scores, exact[order], rtol=1e-5, atol=1e-6)
        assert ids.tolist() == order.tolist()  # continuous random scores: no ties
    assert sum(calls) == len(queries) == batcher.batched_queries
    assert len(calls) == batcher.batches < len(queries)  # merged
    assert max(calls) <= 8


def test_a_lone_caller_searches_at_once_alone(flat) -> None:
    index, queries = flat
    calls: list[int] = []
    batcher = MicroBatcher(_slow(index, calls, delay=0.0))
    for i in range(5):
        scores, ids = batcher.search(queries[i], 3)
        assert len(ids) == 3
    assert calls == [1] * 5


def test_an_error_reaches_every_caller_of_the_batch_and_the_next_batch_still_runs(flat) -> None:
    index, queries = flat
    state = {"fail": True}
    started = threading.Event()

    def flaky(q: np.ndarray, k: int):
        started.set()
        time.sleep(0.05)
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("disk on fire")
        return search(index, q, k)

    batcher = MicroBatcher(flaky)
    outcomes: list[str] = []

    def call(i: int) -> None:
        try:
            batcher.search(queries[i], 2)
            outcomes.append("ok")
        except RuntimeError as err:
            outcomes.append(str(err))

    first = threading.Thread(target=call, args=(0,))
    first.start()
    started.wait()
    others = [threading.Thread(target=call, args=(i,)) for i in range(1, 4)]
    for t in others:
        t.start()
    for t in [first, *others]:
        t.join(timeout=10)
    assert outcomes.count("disk on fire") == 1  # the first batch (the lone first caller) failed
    assert outcomes.count("ok") == 3  # the queued callers were searched together afterwards
    assert batcher.batches == 2 and not batcher._busy


def test_thread_counts_are_set_in_the_searching_thread(flat) -> None:
    index, queries = flat
    seen: list[tuple[int, int]] = []

    def record(q: np.ndarray, k: int):
        seen.append((len(q), faiss.omp_get_max_threads()))
        time.sleep(0.02)
        return search(index, q, k)

    batcher = MicroBatcher(record, single_threads=1, batch_threads=2)
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: batcher.search(queries[i], 2), range(12)))
    assert all(threads == (1 if size == 1 else 2) for size, threads in seen)
    assert any(size > 1 for size, _ in seen)


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        MicroBatcher(lambda _q, _k: ([], []), max_batch=0)
