"""LSTM policies: the state carried at acting time equals the learner's recomputation.

Up to float rounding: the learner runs the torso once over T x B rows where
acting ran it over B rows at a time, and on some CPUs the matmul kernels
chosen for the two shapes round differently (one ulp, seen on this project's
CI machine). A wrong state, a missed reset or a shifted step differs by
orders of magnitude more than `ULPS`.
"""

from __future__ import annotations

import itertools

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS
from rlfabric.algorithms.trajectory import evaluate
from rlfabric.envs import EnvConfig
from rlfabric.models import ActorCritic, ModelConfig
from rlfabric.runtime.acting import RecurrentStates, act_on_requests
from rlfabric.runtime.env_runner import EnvRunner
from rlfabric.runtime.unrolls import UnrollAssembler

#: A few float32 ulps around 1: the rounding that row-count-dependent kernels allow.
ULPS = 1e-6


def _collect(algo_name: str, steps: int, T: int = 8):
    """Act with the policy and its carried state, exactly as an env runner group does."""
    torch.manual_seed(0)
    runner = EnvRunner(EnvConfig(id="CartPole-v1", num_envs=6), index=0, seed=0, num_groups=1)
    cls = ALGORITHMS[algo_name]
    algo = cls(
        cls.config_cls(unroll_length=T),
        runner.envs[0].single_observation_space,
        runner.envs[0].single_action_space,
        ModelConfig(lstm=16, hidden=[32]),
    )
    states = RecurrentStates(algo.initial_state)
    assembler = UnrollAssembler(T)
    request, unrolls = runner.reset(0), []
    for _ in range(steps):
        (acted,) = act_on_requests(algo.act, states, [request])
        unroll = assembler.add(request["key"], request, acted.action, acted.extras, acted.state)
        if unroll is not None:
            unrolls.append(unroll)
        request = runner.step(0, acted.action)
    return algo, unrolls


@pytest.mark.parametrize("algo_name", ["vtrace", "a3c", "ppo"])
def test_learner_recomputes_the_actors_policy(algo_name):
    algo, unrolls = _collect(algo_name, steps=60)
    assert len(unrolls) >= 5
    assert any(u["is_first"][1:].any() for u in unrolls)  # episodes ended inside unrolls
    for unroll in unrolls:
        batch = {k: torch.as_tensor(v) for k, v in unroll.items()}
        with torch.no_grad():
            logp, _, _ = evaluate(algo.model, batch)
        torch.testing.assert_close(logp, batch["logp"], rtol=0, atol=ULPS)


def test_state_at_unroll_start_equals_state_carried_through_the_previous_unroll():
    algo, unrolls = _collect("vtrace", steps=40)
    for prev, nxt in itertools.pairwise(unrolls):
        with torch.no_grad():
            _, _, state = algo.model.unroll(
                torch.as_tensor(prev["obs"][:-1]),
                torch.as_tensor(prev["is_first"][:-1]),
                torch.as_tensor(prev["state"][0]),
            )
        torch.testing.assert_close(state, torch.as_tensor(nxt["state"][0]), rtol=0, atol=ULPS)


def test_state_resets_where_an_episode_starts():
    torch.manual_seed(0)
    model = ActorCritic(
        gym.spaces.Box(-1, 1, (3,), np.float32),
        gym.spaces.Discrete(2),
        ModelConfig(lstm=8, hidden=[8]),
    )
    obs = torch.randn(4, 2, 3)
    first = torch.tensor([[False, False], [False, True], [False, False], [False, False]])
    state = torch.randn(2, 2, 8)
    with torch.no_grad():
        params, _, _ = model.unroll(obs, first, state)
        fresh, _, _ = model.unroll(obs[1:, 1:], None, None)  # env 1 restarted at t=1
        carried, _, _ = model.unroll(obs[1:, 1:], None, state[1:])
    torch.testing.assert_close(params[1:, 1:], fresh)
    assert not torch.allclose(params[1:, 1:], carried)


def test_restarted_runner_starts_from_a_fresh_state():
    states = RecurrentStates(lambda n: np.zeros((n, 2, 4), np.float32))
    request = {"key": (0, 0), "run_id": "a", "obs": np.zeros((3, 1))}
    states.put(request, np.ones((3, 2, 4), np.float32))
    assert states.get(request).sum() == 24
    assert states.get({**request, "run_id": "b"}).sum() == 0


@pytest.mark.parametrize("arch", ["seed", "impala", "ga3c", "local"])
def test_lstm_runs_under_every_architecture(ray_session, tmp_path, arch):
    result = Platform(
        arch=arch,
        algo={"name": "vtrace", "unroll_length": 8, "batch_size": 8},
        env={"id": "CartPole-v1", "num_envs": 8},
        model={"lstm": 16},
        run={"stop": {"env_frames": 3000}, "display": "none", "logdir": str(tmp_path)},
    ).fit()
    assert result.metrics["updates"] >= 1 and np.isfinite(result.metrics["loss"])
