"""Micro-batching of concurrent searches: queries that arrive while a search runs go together.

A flat (exact) search of one query reads the whole gallery (1 GB at 1M x 256 fp32) and is bound by
memory bandwidth; a batch of Q queries reads it once and does Q times the arithmetic, which is
cheap next to the read until Q is in the tens. So when requests overlap, searching them in one
call multiplies throughput at little cost in latency.

No timer and no dedicated thread: the first caller becomes the *leader* and searches at once (a
lone client waits for nothing). Callers arriving meanwhile queue up; when the leader's batch is
done it hands the lead to the oldest waiter, which searches everything queued so far as one batch.
Every caller runs its own batch or receives its result from another's, so a request never waits
for more than the batch in flight plus its own.

FAISS's OpenMP thread count is per calling thread (an ``omp_set_num_threads`` in the thread that
loaded the index does not reach the server's worker threads), so the leader sets it before every
search: ``single_threads`` for a batch of one (a lone flat query is fastest on one thread on a
small machine: the database-parallel path costs more than it gains) and ``batch_threads`` for more.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

SearchFn = Callable[[np.ndarray, int], tuple[list[np.ndarray], list[np.ndarray]]]


@dataclass
class _Request:
    query: np.ndarray  # (D,)
    k: int
    ready: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # woken to run the next batch rather than with a result
    result: tuple[np.ndarray, np.ndarray] | None = None
    error: BaseException | None = None


class MicroBatcher:
    """Thread-safe ``search(query (1, D), k) -> (scores (n,), ids (n,))`` that merges concurrent
    calls into one call of ``search_fn(queries (Q, D), k) -> ragged lists`` (at most ``max_batch``).

    ``batches`` and ``batched_queries`` count what happened (``/v1/info`` reports them).
    """

    def __init__(
        self,
        search_fn: SearchFn,
        *,
        max_batch: int = 64,
        single_threads: int = 1,
        batch_threads: int = 0,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._search_fn = search_fn
        self.max_batch = max_batch
        self.single_threads = single_threads
        self.batch_threads = batch_threads  # 0: FAISS's default (all cores)
        self._lock = threading.Lock()
        self._queue: list[_Request] = []
        self._busy = False
        self.batches = 0
        self.batched_queries = 0

    def search(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        request = _Request(np.asarray(query, dtype=np.float32).reshape(-1), k)
        with self._lock:
            self._queue.append(request)
            lead = not self._busy
            self._busy = True
        if not lead:
            request.ready.wait()
            lead = request.lead  # handed the lead: this request heads the queue, so it is in the batch
        if lead:
            self._run_batch()
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def _run_batch(self) -> None:
        with self._lock:
            batch = self._queue[: self.max_batch]
            del self._queue[: self.max_batch]
        try:
            self._set_threads(len(batch))
            queries = np.stack([r.query for r in batch])  # (Q, D)
            scores, ids = self._search_fn(queries, max(r.k for r in batch))
            for r, s, i in zip(batch, scores, ids, strict=True):
                r.result = (s[: r.k], i[: r.k])
        except BaseException as err:  # every caller of the batch gets the error, not a hang
            for r in batch:
                r.error = err
        with self._lock:
            self.batches += 1
            self.batched_queries += len(batch)
            if self._queue:
                successor = self._queue[0]
                successor.lead = True
                successor.ready.set()
            else:
                self._busy = False
        for r in batch:
            r.ready.set()

    def _set_threads(self, size: int) -> None:
        import faiss  # noqa: PLC0415 (faiss: only this path needs it)

        threads = self.single_threads if size == 1 else self.batch_threads
        faiss.omp_set_num_threads(threads or len(os.sched_getaffinity(0)))
