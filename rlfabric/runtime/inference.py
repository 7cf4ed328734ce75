"""InferenceServer: dynamic batching of policy requests from many callers.

Callers block in `infer()`; a batcher thread waits for the first request,
then keeps collecting until `min_batch` envs are in or `timeout_s` has passed
since the first, then drains whatever else is already waiting up to
`max_batch` envs, and runs one forward pass for all of them. A fixed batch
size (SEED RL's `inference_batch_size`) stalls when fewer envs are live; the
timeout is IMPALA's dynamic batcher's answer (min 1, max 1024, 100 ms) and
TorchRL's InferenceServer's (max 64, 10 ms). Several batcher threads may
serve one queue: GA3C's predictor threads.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rlfabric.observations import batch_len
from rlfabric.runtime.stats import IntervalStats
from rlfabric.runtime.workers import ThreadPool

Request = dict[str, Any]
#: Runs one forward pass for a list of requests; returns one action array each.
BatchFn = Callable[[list[Request]], list[np.ndarray]]


class _Pending:
    __slots__ = ("done", "request", "result")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.result: np.ndarray | BaseException | None = None
        self.done = threading.Event()


class InferenceServer:
    """Batches `infer` calls from any number of threads into calls of `batch_fn`."""

    def __init__(
        self,
        batch_fn: BatchFn,
        *,
        min_batch: int,
        max_batch: int,
        timeout_s: float,
        stats: IntervalStats,
        num_threads: int = 1,
    ) -> None:
        self.batch_fn = batch_fn
        self.min_batch = min_batch
        self.max_batch = max_batch
        self.timeout_s = timeout_s
        self.stats = stats
        self.num_threads = num_threads
        self._requests: queue.Queue[_Pending] = queue.Queue()
        self._stopping = threading.Event()
        self.batchers = ThreadPool(self._serve_one_batch, "inference-batcher")

    def start(self) -> None:
        self.batchers.resize(self.num_threads)

    def stop(self) -> None:
        """Answer every waiting and later caller with None and end the batchers."""
        self._stopping.set()
        self.batchers.stop()
        while True:
            try:
                pending = self._requests.get_nowait()
            except queue.Empty:
                break
            pending.done.set()

    def infer(self, request: Request) -> np.ndarray | None:
        """Block until the batch holding `request` ran; None once the server stops."""
        if self._stopping.is_set():
            return None
        pending = _Pending(request)
        self._requests.put(pending)
        while not pending.done.wait(0.5):
            if self._stopping.is_set() and not self.batchers.size:
                return None
        if isinstance(pending.result, BaseException):
            raise pending.result
        return pending.result

    def _collect(self) -> list[_Pending]:
        try:
            first = self._requests.get(timeout=0.1)
        except queue.Empty:
            return []
        batch, envs = [first], batch_len(first.request["obs"])
        deadline = time.perf_counter() + self.timeout_s
        while envs < self.max_batch:
            wait = deadline - time.perf_counter() if envs < self.min_batch else 0.0
            try:
                item = self._requests.get(timeout=wait) if wait > 0 else self._requests.get_nowait()
            except queue.Empty:
                break
            batch.append(item)
            envs += batch_len(item.request["obs"])
        return batch

    def _serve_one_batch(self) -> None:
        batch = self._collect()
        if batch:
            start = time.perf_counter()
            try:
                results: list[Any] = self.batch_fn([p.request for p in batch])
            except BaseException as err:  # hand the error to every caller, keep serving
                results = [err] * len(batch)
            elapsed = time.perf_counter() - start
            self.stats.add_many(
                {
                    "inference_batch_envs": sum(batch_len(p.request["obs"]) for p in batch),
                    "inference_batch_requests": len(batch),
                    "inference_ms": 1000.0 * elapsed,
                }
            )
            for pending, result in zip(batch, results):
                pending.result = result
                pending.done.set()
