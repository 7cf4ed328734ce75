"""GA3C pieces: the dynamic adjuster, resizable thread pools, predictor batching."""

from __future__ import annotations

import threading
import time

import numpy as np

from rlfabric.runtime.autotune import DynamicAdjuster
from rlfabric.runtime.inference import InferenceServer
from rlfabric.runtime.stats import IntervalStats
from rlfabric.runtime.workers import ThreadPool

KNOBS = {"env_runners": [1, 2, 3, 4], "predictors": [1, 2, 3], "trainers": [1, 2, 3]}
START = {"env_runners": 2, "predictors": 2, "trainers": 2}


def test_adjuster_stays_within_bounds_and_moves_both_ways():
    adjuster = DynamicAdjuster(KNOBS, START, seed=1)
    seen = {name: set() for name in KNOBS}
    throughput = 0.0
    for _ in range(300):
        throughput += 1.0  # always better: every change is kept, the walk roams
        setting = adjuster.step(throughput)
        for name, value in setting.items():
            assert value in KNOBS[name]
            seen[name].add(value)
    for name, values in KNOBS.items():
        assert seen[name] == set(values), name  # reached both bounds
    assert all(d.startswith("kept") for d in adjuster.decisions)


def test_adjuster_reverts_a_change_that_lowered_throughput():
    def fake_throughput(setting):  # more runners is better, nothing else matters
        return 100.0 * setting["env_runners"]

    adjuster = DynamicAdjuster(KNOBS, START, seed=0)
    setting = adjuster.step(fake_throughput(START))
    reverted = 0
    for _ in range(60):
        before = adjuster._before
        new = adjuster.step(fake_throughput(setting))
        if adjuster.decisions[-1].startswith("reverted"):
            reverted += 1
            # the trial setting was dropped: the walk restarted from the one before it
            assert adjuster._before == before
        setting = new
    assert reverted > 0
    assert adjuster.baseline == 400.0  # it found the best number of runners


def test_thread_pool_resizes_up_and_down():
    calls = []
    lock = threading.Lock()

    def step():
        with lock:
            calls.append(threading.current_thread().name)
        time.sleep(0.01)

    pool = ThreadPool(step, "worker")
    pool.resize(3)
    time.sleep(0.1)
    assert pool.size == 3
    assert {"worker-0", "worker-1", "worker-2"} <= set(calls)
    pool.resize(1)
    time.sleep(0.1)
    calls.clear()
    time.sleep(0.1)
    assert set(calls) == {"worker-0"}
    pool.stop()
    assert pool.size == 0


def test_several_predictors_serve_one_queue_and_respect_max_batch():
    sizes: list[int] = []

    def predict(requests):
        sizes.append(sum(len(r["obs"]) for r in requests))
        time.sleep(0.02)
        return [r["obs"][:, 0] + 1 for r in requests]

    server = InferenceServer(
        predict, min_batch=1, max_batch=8, timeout_s=0.0, stats=IntervalStats(), num_threads=3
    )
    server.start()
    try:
        results = {}

        def call(i):
            results[i] = server.infer({"obs": np.full((4, 1), i)})

        threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        assert all(np.array_equal(results[i], np.full(4, i + 1)) for i in range(12))
        assert max(sizes) <= 8
        assert server.batchers.size == 3
    finally:
        server.stop()
