"""The replay data path: unrolls into buffer streams, the update-to-data ratio, checkpoints."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from rlfabric.envs import EnvConfig, describe_env
from rlfabric.platform.spec import ExperimentSpec
from rlfabric.runtime.env_runner import EnvRunner
from rlfabric.runtime.feeds import ReplayFeed, StreamMap
from rlfabric.runtime.learner import Learner
from rlfabric.runtime.replay import ReplayBuffer
from rlfabric.runtime.unrolls import UnrollAssembler


def _random_run(runner: EnvRunner, steps: int, rng: np.random.Generator):
    """Yield (group, request, action, next request) over `steps` steps of every group."""
    space = describe_env(EnvConfig(id="CartPole-v1", num_envs=2)).action_space
    pending = [runner.reset(g) for g in range(runner.num_groups)]
    for _ in range(steps):
        for group in range(runner.num_groups):
            request = pending[group]
            action = rng.integers(0, space.n, len(request["obs"]))
            pending[group] = runner.step(group, action)
            yield group, request, action, pending[group]


def test_unrolls_store_the_same_transitions_as_step_by_step_adds():
    """CartPole with short episodes: terminations, autoreset steps and T=5 unroll boundaries."""
    cfg = EnvConfig(id="CartPole-v1", num_envs=6)
    info = describe_env(cfg)
    streams = StreamMap(num_runners=1, num_envs=6, num_groups=2)
    direct, via_unrolls = (
        ReplayBuffer.from_spaces(info.observation_space, info.action_space, 6_000, 6)
        for _ in range(2)
    )
    assembler = UnrollAssembler(5)
    runner = EnvRunner(cfg, index=0, seed=3, num_groups=2)
    for group, request, action, after in _random_run(runner, 200, np.random.default_rng(0)):
        direct.add(
            request["obs"],
            action,
            after["reward"],
            after["terminated"],
            after["truncated"],
            after["obs"],
            valid=~after["is_first"],
            streams=streams((0, group)),
        )
        unroll = assembler.add(request["key"], request, action, {})
        if unroll is not None:
            via_unrolls.add_unroll(unroll, streams((0, group)))
    runner.close()
    # The unrolls lag by the partial one per group: compare what both hold.
    stored, expected = via_unrolls.state_dict(), direct.state_dict()
    counts = stored["count"]
    assert counts.sum() > 1_000 and (counts > 0).all()
    for key, array in stored["data"].items():
        for env in range(6):
            n = counts[env]
            np.testing.assert_array_equal(array[env, :n], expected["data"][key][env, :n], key)


def test_streams_map_runner_groups_to_their_envs():
    streams = StreamMap(num_runners=3, num_envs=5, num_groups=2)
    assert streams.num_streams == 15
    assert streams((0, 0)).tolist() == [0, 1, 2]
    assert streams((0, 1)).tolist() == [3, 4]
    assert streams((2, 1)).tolist() == [13, 14]


def test_a_restarted_runner_cuts_its_streams():
    """Folds never run from the old runner's last step into the new runner's first."""
    cfg = EnvConfig(id="CartPole-v1", num_envs=2)
    info = describe_env(cfg)
    buffer = ReplayBuffer.from_spaces(info.observation_space, info.action_space, 1000, 2)
    streams = StreamMap(1, 2, 2)
    rng = np.random.default_rng(0)
    for seed in (0, 1):  # the second runner replaces the first (a new run id)
        assembler = UnrollAssembler(4)
        runner = EnvRunner(cfg, index=0, seed=seed, num_groups=2)
        for group, request, action, _ in _random_run(runner, 6, rng):
            unroll = assembler.add(request["key"], request, action, {})
            if unroll is not None:
                buffer.add_unroll(unroll, streams((0, group)))
        runner.close()
        if seed == 0:
            old_count = buffer.state_dict()["count"].copy()
    end = buffer.state_dict()["data"]["end"]
    for env in range(2):
        assert end[env, old_count[env] - 1], "the old runner's newest step must end folds"


def _spec(**algo) -> ExperimentSpec:
    return ExperimentSpec.build(
        {
            "env": {"id": "Pendulum-v1", "num_envs": 2},
            "arch": "local",
            "algo": {
                "name": "td3",
                "hidden": [16],
                "batch_size": 8,
                "warmup_steps": 20,
                "unroll_length": 4,
                **algo,
            },
        }
    )


def _pendulum_feed(
    buffer_factory: Callable[..., ReplayBuffer] = ReplayBuffer.from_spaces, **algo
) -> tuple[ReplayFeed, Learner, EnvRunner]:
    spec = _spec(**algo)
    info = describe_env(spec.env)
    learner = Learner(spec, info, frame_budget=None)
    streams = StreamMap(1, 2, 2)
    feed = ReplayFeed(learner, spec, info, streams, threading.Lock(), buffer_factory)
    return feed, learner, EnvRunner(spec.env, index=0, seed=0, num_groups=2)


def _unrolls(learner: Learner, runner: EnvRunner, length: int):
    """Yield (key, unroll) from the learner's own policy (random until its first update)."""
    assembler = UnrollAssembler(length)
    pending = [runner.reset(g) for g in range(runner.num_groups)]
    while True:
        for group in range(runner.num_groups):
            request = pending[group]
            action, extras, _ = learner.act(request["obs"])
            unroll = assembler.add(request["key"], request, action, extras)
            pending[group] = runner.step(group, action)
            if unroll is not None:
                yield request["key"], unroll


def _train_on(feed: ReplayFeed, learner: Learner, runner: EnvRunner, unrolls: int) -> None:
    """Store `unrolls` unrolls of the learner's policy, running every update they allow."""
    stop = threading.Event()
    for _, (key, unroll) in zip(range(unrolls), _unrolls(learner, runner, 4)):
        feed.add_unroll(unroll, key, stop)
        while feed.train_step(timeout=0):
            pass


@pytest.mark.parametrize("ratio", [1.0, 0.5, 2.0])
def test_updates_follow_the_ratio_after_warmup(ratio):
    feed, learner, runner = _pendulum_feed(updates_per_step=ratio)
    stop = threading.Event()
    for _, (key, unroll) in zip(range(30), _unrolls(learner, runner, 4)):
        assert feed.add_unroll(unroll, key, stop)  # never blocks: updates drain below
        while feed.train_step(timeout=0):
            pass
        owed_total = int(max(0, feed.stored - 20) * ratio)
        assert learner.counters["updates"] == owed_total
    assert feed.stored == 30 * 4 - 0  # Pendulum never ends within 60 steps: all valid
    runner.close()


def test_warmup_acts_at_random_then_with_the_policy():
    _, learner, runner = _pendulum_feed()
    obs = np.zeros((64, 3), np.float32)
    random_actions = learner.act(obs)[0]
    assert random_actions.std() > 0.5  # uniform over [-2, 2]: std 1.15
    assert set(learner.act(obs)[1]) == {"policy_action", "policy_version"}
    learner.counters["updates"] = 1
    action, extras, _ = learner.act(obs)
    assert np.allclose(extras["policy_action"], extras["policy_action"][0])  # mu(s): one s
    assert action.std() < 0.5  # mu plus 0.1 half ranges of noise
    runner.close()


def test_producers_wait_for_trainers_one_unroll_ahead():
    feed, learner, runner = _pendulum_feed()
    stop = threading.Event()
    unrolls = _unrolls(learner, runner, 4)
    while feed.stored < 20 + 8:  # past the warm-up: 4 transitions per unroll owe 4 updates
        key, unroll = next(unrolls)
        feed.add_unroll(unroll, key, stop)
    key, unroll = next(unrolls)
    assert feed.owed() > 4
    added = []
    thread = threading.Thread(target=lambda: added.append(feed.add_unroll(unroll, key, stop)))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive() and not added  # blocked: the trainers are more than 4 behind
    while feed.owed() > 4:
        assert feed.train_step(timeout=0)
    thread.join(timeout=5)
    assert added == [True]
    stop.set()
    runner.close()


@pytest.mark.parametrize("contents", [True, False])
def test_checkpoint_round_trip_with_and_without_contents(contents):
    feed, learner, runner = _pendulum_feed(dynamic_buffer=True, buffer_min_capacity=16)
    _train_on(feed, learner, runner, 20)
    stop = threading.Event()
    state = {"learner": learner.state_dict(), "replay": feed.state_dict(2**30 if contents else 0)}
    stream = io.BytesIO()
    torch.save(state, stream)
    stream.seek(0)
    loaded = torch.load(stream, weights_only=True)

    fresh, fresh_learner, fresh_runner = _pendulum_feed(dynamic_buffer=True, buffer_min_capacity=16)
    fresh_learner.load_state_dict(loaded["learner"])
    fresh.load_state_dict(loaded["replay"])
    assert fresh.stored == feed.stored == 80
    assert fresh.owed() == 0  # a resume starts level
    if contents:
        assert len(fresh.buffer) == len(feed.buffer)
        a, b = fresh.buffer.sample(32), feed.buffer.sample(32)  # same RNG state, same data
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    else:
        assert len(fresh.buffer) == 0
        # The buffer warms up again before updates resume.
        for _, (key, unroll) in zip(range(5), _unrolls(fresh_learner, fresh_runner, 4)):
            fresh.add_unroll(unroll, key, stop)
        assert fresh.owed() == 0
        for _, (key, unroll) in zip(range(2), _unrolls(fresh_learner, fresh_runner, 4)):
            fresh.add_unroll(unroll, key, stop)
        assert fresh.owed() > 0
    runner.close()
    fresh_runner.close()


def test_the_trainer_runs_rlx2_capacity_checks():
    """A tiny threshold: every check finds the policy moved, so the buffer shrinks to its floor."""
    feed, learner, runner = _pendulum_feed(
        dynamic_buffer=True,
        buffer_capacity=1_000,
        buffer_min_capacity=40,
        buffer_check_every=8,
        buffer_threshold=1e-9,
    )
    stop = threading.Event()
    for _, (key, unroll) in zip(range(40), _unrolls(learner, runner, 4)):
        feed.add_unroll(unroll, key, stop)
        while feed.train_step(timeout=0):
            pass
    metrics = feed.metrics()
    assert np.isfinite(metrics["policy_distance"]) and metrics["policy_distance"] > 1e-9
    assert 40 <= metrics["replay_capacity"] < 1_000
    assert metrics["replay_size"] <= metrics["replay_capacity"]
    runner.close()


@pytest.mark.parametrize(("name", "intermediate"), [("sac", True), ("td3", False)])
def test_feed_hands_sac_the_folds_inner_observations(name, intermediate):
    """SAC's soft n-step target needs the entropy at a fold's inner states; TD3's does not."""
    feed, learner, runner = _pendulum_feed(name=name, n_step=3)
    seen: list[dict[str, np.ndarray]] = []
    update = learner.algorithm.update
    learner.algorithm.update = lambda batch: seen.append(batch) or update(batch)
    _train_on(feed, learner, runner, 7)
    runner.close()
    assert seen
    for batch in seen:
        assert ("mid_obs" in batch) == intermediate
        if intermediate:
            assert batch["mid_obs"].shape == (8, 2, 3) and batch["mid_discount"].shape == (8, 2)
