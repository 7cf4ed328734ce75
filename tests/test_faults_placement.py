"""Actors that cannot be placed fail the run naming the resources; default CPU requests fit."""

from __future__ import annotations

import pytest
from test_training import FAST_VTRACE

from rlfabric import Platform
from rlfabric.errors import RLFabricError


def test_an_env_runner_that_cannot_be_placed_fails_naming_the_resources(ray_session, tmp_path):
    platform = Platform(
        arch="seed",
        algo=FAST_VTRACE,
        env={"id": "CartPole-v1", "num_envs": 4},
        resources={"cpus_per_env_runner": 64},
        run={"display": "none", "logdir": str(tmp_path)},
    )
    with pytest.raises(RLFabricError, match=r"each env runner actor asks for \{'CPU': 64"):
        platform.fit()


def test_env_runners_waiting_for_cpus_fail_within_the_start_timeout(ray_session):
    """Feasible but not free: a bounded wait, then the resources asked for and free."""
    from rlfabric.architectures.runner_pool import RunnerPool
    from rlfabric.architectures.seed import SeedEnvRunner

    platform = Platform(
        arch="seed",
        algo=FAST_VTRACE,
        env={"id": "CartPole-v1", "num_envs": 4},
        resources={"cpus_per_env_runner": 1.5},
        run={"start_timeout_s": 1},
    )
    from ray.util.placement_group import placement_group, remove_placement_group

    blocker = placement_group([{"CPU": 1}])  # holds one of the session's two CPUs
    ray_session.get(blocker.ready(), timeout=30)
    try:
        pool = RunnerPool(platform.spec, platform.env_info, SeedEnvRunner, None, seed=0)
        with pytest.raises(RLFabricError) as err:
            pool.wait_started()
    finally:
        remove_placement_group(blocker)
    assert "1 of 1 env runner actor(s) did not start within 1 s" in str(err.value)
    assert "each asks for {'CPU': 1.5}" in str(err.value)
    assert "with {'CPU': 1.0} free" in str(err.value)


def test_two_learners_on_two_cpus_leave_room_for_the_runner(ray_session, tmp_path):
    """`resources.num_learners=2` on 2 cores: learners and runner share the CPUs."""
    from rlfabric.architectures.runner_pool import learner_cpus, runner_cpus

    platform = Platform(
        arch="seed",
        algo=FAST_VTRACE,
        env={"id": "CartPole-v1", "num_envs": 8},
        resources={"num_learners": 2},
        run={
            "display": "none",
            "logdir": str(tmp_path),
            "start_timeout_s": 60,
            "stop": {"env_frames": 2_000},
        },
    )
    spec = platform.spec
    assert 2 * learner_cpus(spec) + runner_cpus(spec) <= 2.0
    result = platform.fit()
    assert result.metrics["env_frames"] >= 2_000
