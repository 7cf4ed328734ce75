"""InferenceServer: dynamic batching with min/max/timeout, errors and shutdown."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rlfabric.runtime.inference import InferenceServer
from rlfabric.runtime.stats import IntervalStats


def _server(min_batch=1, max_batch=64, timeout_s=0.05, delay=0.0):
    seen: list[list[int]] = []

    def batch_fn(requests):
        seen.append([len(r["obs"]) for r in requests])
        time.sleep(delay)
        return [r["obs"][:, 0] * 2 for r in requests]

    stats = IntervalStats()
    server = InferenceServer(
        batch_fn, min_batch=min_batch, max_batch=max_batch, timeout_s=timeout_s, stats=stats
    )
    server.start()
    return server, seen, stats


def _call_concurrently(server, sizes):
    results = [None] * len(sizes)

    def call(i, n):
        results[i] = server.infer({"obs": np.full((n, 1), i)})

    threads = [threading.Thread(target=call, args=(i, n)) for i, n in enumerate(sizes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    return results


def test_results_go_back_to_their_callers():
    server, _, _ = _server()
    try:
        results = _call_concurrently(server, [2, 3, 1, 4])
        for i, (res, n) in enumerate(zip(results, [2, 3, 1, 4])):
            np.testing.assert_array_equal(res, np.full(n, 2 * i))
    finally:
        server.stop()


def test_waits_for_min_batch_then_batches_together():
    server, seen, stats = _server(min_batch=8, timeout_s=1.0)
    try:
        _call_concurrently(server, [4, 4])
        assert seen == [[4, 4]]
        means, _ = stats.collect()
        assert means["inference_batch_envs"] == 8
    finally:
        server.stop()


def test_timeout_bounds_the_wait_for_min_batch():
    server, seen, _ = _server(min_batch=100, timeout_s=0.05)
    try:
        start = time.perf_counter()
        _call_concurrently(server, [4])
        assert time.perf_counter() - start < 1.0  # never stalls waiting for absent envs
        assert seen == [[4]]
    finally:
        server.stop()


def test_max_batch_caps_a_forward_pass():
    server, seen, _ = _server(min_batch=1, max_batch=6, delay=0.2)
    try:
        server.infer({"obs": np.zeros((1, 1))})  # occupy the batcher, let requests pile up
        first = threading.Thread(target=server.infer, args=({"obs": np.zeros((1, 1))},))
        first.start()
        time.sleep(0.05)
        _call_concurrently(server, [3, 3, 3])
        first.join(5)
        assert all(sum(batch) <= 6 for batch in seen)
        assert max(len(batch) for batch in seen) >= 2
    finally:
        server.stop()


def test_errors_reach_every_caller_and_server_keeps_serving():
    calls = {"n": 0}

    def batch_fn(requests):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return [np.zeros(len(r["obs"])) for r in requests]

    server = InferenceServer(
        batch_fn, min_batch=1, max_batch=8, timeout_s=0.0, stats=IntervalStats()
    )
    server.start()
    try:
        with pytest.raises(RuntimeError, match="boom"):
            server.infer({"obs": np.zeros((2, 1))})
        assert server.infer({"obs": np.zeros((2, 1))}).shape == (2,)
    finally:
        server.stop()


def test_stop_answers_none():
    server, _, _ = _server()
    server.stop()
    assert server.infer({"obs": np.zeros((1, 1))}) is None
