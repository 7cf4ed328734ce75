"""Learner-side unroll assembly (time alignment, overlap, restarts) and batch building."""

from __future__ import annotations

import numpy as np

from rlfabric.runtime.unrolls import BatchBuilder, UnrollAssembler


def _request(step: int, n: int, run_id: str = "a") -> dict:
    """Vector step `step`: obs = step, and the outcome of the previous action."""
    return {
        "run_id": run_id,
        "obs": np.full((n, 2), step, np.float32),
        "is_first": np.full(n, step == 0),
        "reward": np.full(n, 10.0 * step, np.float32),  # reward that followed action step-1
        "terminated": np.zeros(n, bool),
        "truncated": np.full(n, step == 3),
    }


def _action(step: int, n: int) -> tuple[np.ndarray, dict]:
    return np.full(n, 100 + step), {"logp": np.full(n, -float(step), np.float32)}


def test_time_alignment_and_one_step_overlap():
    T, n = 3, 2
    assembler = UnrollAssembler(T)
    unrolls = []
    for step in range(7):
        action, extras = _action(step, n)
        out = assembler.add("k", _request(step, n), action, extras)
        if out is not None:
            unrolls.append(out)
    assert len(unrolls) == 2
    first, second = unrolls
    assert first["obs"].shape == (T + 1, n, 2) and first["action"].shape == (T, n)
    np.testing.assert_array_equal(first["obs"][:, 0, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(first["action"][:, 0], [100, 101, 102])
    # reward[t] and done[t] are what followed action[t], i.e. arrived with obs[t+1]
    np.testing.assert_array_equal(first["reward"][:, 0], [10, 20, 30])
    np.testing.assert_array_equal(first["truncated"][:, 0], [False, False, True])
    np.testing.assert_array_equal(first["logp"][:, 0], [0, -1, -2])
    np.testing.assert_array_equal(first["is_first"][:, 0], [True, False, False, False])
    # consecutive unrolls share one observation
    np.testing.assert_array_equal(second["obs"][:, 0, 0], [3, 4, 5, 6])
    np.testing.assert_array_equal(second["action"][:, 0], [103, 104, 105])
    np.testing.assert_array_equal(second["reward"][:, 0], [40, 50, 60])


def test_restarted_runner_drops_its_partial_unroll():
    assembler = UnrollAssembler(4)
    for step in range(3):
        assembler.add("k", _request(step, 2, "old"), *_action(step, 2))
    assert assembler.add("k", _request(0, 2, "new"), *_action(0, 2)) is None
    assert assembler.dropped_unrolls == 1
    out = [assembler.add("k", _request(s, 2, "new"), *_action(s, 2)) for s in range(1, 5)]
    assert out[-1] is not None and out[-1]["obs"][0, 0, 0] == 0


def test_keys_assemble_independently():
    assembler = UnrollAssembler(2)
    outs = []
    for step in range(3):
        for key in ("a", "b"):
            outs.append(assembler.add(key, _request(step, 1), *_action(step, 1)))
    assert [o is not None for o in outs] == [False, False, False, False, True, True]


def test_batch_builder_exact_columns_and_split():
    builder = BatchBuilder(batch_size=3)
    unroll = {"x": np.arange(8).reshape(1, 8).repeat(2, axis=0)}
    batches = builder.add(unroll)
    assert [b["x"].shape for b in batches] == [(2, 3), (2, 3)]
    np.testing.assert_array_equal(batches[1]["x"][0], [3, 4, 5])
    batches = builder.add({"x": np.full((2, 2), 9)})  # 2 left over + 2 new = 1 batch + 1 left
    assert len(batches) == 1
    np.testing.assert_array_equal(batches[0]["x"][0], [6, 7, 9])
    assert builder.add({"x": np.full((2, 2), 5)})[0]["x"][0].tolist() == [9, 5, 5]
