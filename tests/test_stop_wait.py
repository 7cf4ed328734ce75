"""A run ends at its frame budget or return target, not up to a report interval later:
the driver's wait between reports (`Learner.wait_for_stop`) ends as the learner counts
the step that meets the condition."""

from __future__ import annotations

import threading
import time

import pytest

from rlfabric import Platform
from rlfabric.envs import describe_env
from rlfabric.platform.spec import ExperimentSpec
from rlfabric.runtime.env_runner import StepTally
from rlfabric.runtime.learner import Learner


def _learner(frame_budget: int | None, window: int = 3) -> Learner:
    spec = ExperimentSpec.build(
        {"arch": "local", "env": {"id": "CartPole-v1", "num_envs": 2},
         "run": {"return_window": window}}
    )  # fmt: skip
    return Learner(spec, describe_env(spec.env), frame_budget=frame_budget)


def _tally(steps: int, returns: list[float]) -> dict:
    tally = StepTally()
    tally.agent_steps, tally.episode_returns = steps, returns
    tally.episode_lengths = [10] * len(returns)
    return tally.take()


def _wait_in_thread(learner: Learner, target: float | None) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(learner.wait_for_stop(60.0, target)))
    thread.start()
    return thread, out


def test_the_wait_ends_when_the_frame_budget_is_counted():
    learner = _learner(frame_budget=100)
    thread, out = _wait_in_thread(learner, None)
    learner.record_steps(_tally(60, []))
    thread.join(0.5)
    assert thread.is_alive()  # 60 of 100 frames: still waiting
    learner.record_steps(_tally(40, []))
    thread.join(10.0)
    assert out == [True]


def test_the_wait_ends_when_the_return_window_is_full_at_the_target():
    learner = _learner(frame_budget=None, window=3)
    thread, out = _wait_in_thread(learner, 10.0)
    learner.record_steps(_tally(30, [20.0, 20.0]))  # at the target, the window not full
    thread.join(0.5)
    assert thread.is_alive()
    learner.record_steps(_tally(30, [20.0]))
    thread.join(10.0)
    assert out == [True]


def test_the_wait_times_out_without_a_stop():
    learner = _learner(frame_budget=None)
    assert learner.wait_for_stop(0.05, None) is False
    learner.record_steps(_tally(30, [1.0, 1.0, 1.0]))
    assert learner.wait_for_stop(0.05, 10.0) is False  # a full window below the target


@pytest.mark.parametrize("arch", ["seed", "local"])
def test_a_run_ends_at_its_budget_not_at_the_next_report(ray_session, tmp_path, arch):
    # A report interval far longer than the run: the driver must not sit it out.
    began = time.perf_counter()
    result = Platform(
        arch=arch,
        env={"id": "CartPole-v1", "num_envs": 8},
        run={"logdir": str(tmp_path), "display": "none", "report_interval_s": 60.0,
             "checkpoint_interval_s": 600.0, "stop": {"env_frames": 2_000}},
    ).fit()  # fmt: skip
    assert result.metrics["env_frames"] >= 2_000
    assert time.perf_counter() - began < 40.0  # the whole run, Ray's actors' start included
