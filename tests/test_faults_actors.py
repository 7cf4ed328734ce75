"""Faults inside actors: each ends the run (or not) with the error named at its source.

The faulty envs are registered in this process only (`faulty_envs`); the env
runners get their registration from the driver, as for any user's own env.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import faulty_envs  # noqa: F401 - registers the faulty env ids
import pytest
from test_training import FAST_VTRACE

from rlfabric import Platform
from rlfabric.errors import ActorError
from rlfabric.platform.checkpoint import load_checkpoint, save_checkpoint


def _platform(tmp_path: Path, env: str, arch: str = "seed", **run) -> Platform:
    return Platform(
        arch=arch,
        algo=FAST_VTRACE,
        env={"id": env, "num_envs": 4},
        run={"display": "none", "logdir": str(tmp_path), "report_interval_s": 0.5, **run},
    )


@pytest.mark.parametrize("arch", ["seed", "ga3c"])
def test_a_learner_error_in_inference_ends_the_run_with_the_learners_message(
    ray_session, tmp_path, arch
):
    """NaN observations make the learner's inference raise: not a runner crash."""
    platform = _platform(tmp_path, "NaNObsCartPole-v0", arch, stop={"env_frames": 100_000})
    with pytest.raises(ActorError) as err:
        platform.fit()
    assert err.value.actor == "the learner"
    assert str(err.value).startswith("the learner raised RuntimeError: ")
    assert "env runner" not in str(err.value)


def test_an_env_that_raises_on_every_step_stops_after_a_few_identical_failures(
    ray_session, tmp_path
):
    platform = _platform(tmp_path, "BrokenStepCartPole-v0", stop={"env_frames": 100_000})
    start = time.monotonic()
    with pytest.raises(ActorError) as err:
        platform.fit()
    message = str(err.value)
    assert "raised ValueError: the physics engine is not installed" in message
    assert "failed 3 times in a row with this same error" in message
    assert time.monotonic() - start < 60


def test_a_dead_data_parallel_learner_ends_the_run_naming_it(ray_session, tmp_path):
    from rlfabric.architectures.seed import SeedArchitecture

    platform = Platform(
        arch="seed",
        algo=FAST_VTRACE,
        env={"id": "CartPole-v1", "num_envs": 8},
        resources={"num_learners": 2},
        run={"report_interval_s": 0.5, "logdir": str(tmp_path), "actor_timeout_s": 5},
    )
    arch = SeedArchitecture(platform.spec, platform.env_info, platform.spec.run.stop)
    try:  # a start that fails half-way leaves actors for stop() to end
        arch.start()
        metrics = arch.step()
        while metrics["updates"] < 3:
            metrics = arch.step()
        state = arch.get_state()
        path = save_checkpoint(tmp_path, state, state["counters"]["env_frames"], keep=3)
        os.kill(ray_session.get(arch.workers[0].pid.remote()), signal.SIGKILL)
        with pytest.raises(ActorError, match=r"^data-parallel learner 1 died"):
            for _ in range(20):
                arch.step()
        start = time.monotonic()
        try:  # learner 0 may still be in the all-reduce: bounded either way
            arch.get_state()
        except ActorError as err:
            assert err.actor == "the learner"
        assert time.monotonic() - start < 5 + 10
    finally:
        arch.stop()
    assert load_checkpoint(Path(path))["counters"] == state["counters"]


def test_a_wedged_env_is_replaced_after_the_runner_timeout(ray_session, tmp_path, caplog):
    from rlfabric.architectures.seed import SeedArchitecture

    platform = _platform(tmp_path, "WedgedCartPole-v0", runner_timeout_s=2)
    arch = SeedArchitecture(platform.spec, platform.env_info, platform.spec.run.stop)
    try:  # a start that fails half-way leaves actors for stop() to end
        arch.start()
        metrics = arch.step()
        for _ in range(40):  # 0.5 s each: the wedge comes after 100 steps, the timeout 2 s later
            if metrics["runner_restarts"]:
                break
            metrics = arch.step()
        assert metrics["runner_restarts"] >= 1
        assert "env runner 0 completed no env step for" in caplog.text
        assert metrics["env_frames"] > 0
    finally:
        arch.stop()


def test_warnings_inside_actors_reach_the_runs_log(ray_session, tmp_path):
    """Skipped non-finite updates are logged in the learner actor (log_to_driver=False)."""
    platform = _platform(
        tmp_path,
        "NaNRewardSoonCartPole-v0",
        name="warned",
        max_nonfinite_updates=10_000,
        stop={"env_frames": 2_000},
    )
    result = platform.fit()
    m = result.metrics
    assert m["skipped_updates"] > 0
    # Rewards turn NaN at each env's 20th real step, and stay NaN. Which update first
    # holds one is not fixed: an episode that ends early puts an autoreset step (no env
    # step) into the first unrolls, so the first batch (20 steps of each env) can hold
    # only good rewards. From the first batch with a NaN on, every batch has one: the
    # skips are the run's last updates, and the first of them must be in the log.
    first = int(m["updates"] - m["skipped_updates"]) + 1
    run_log = (tmp_path / "warned" / "run.log").read_text()
    assert f"the learner: rlfabric.runtime.learner: update {first} skipped: non-finite" in run_log
