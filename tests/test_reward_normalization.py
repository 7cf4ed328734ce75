"""Reward normalization (`algo.normalize_reward`): SB3 VecNormalize's running discounted
return, kept by the unroll assembler across unrolls, and the learner's reward scale
from its variance. Under every Ray topology: `test_obs_normalization`'s topology test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sparse_algorithms import CARTPOLE, B, T, batch

from rlfabric.algorithms import ALGORITHMS, Algorithm
from rlfabric.errors import SpecError
from rlfabric.models import ModelConfig, RewardScaler
from rlfabric.platform.spec import ExperimentSpec
from rlfabric.runtime.unrolls import UnrollAssembler

GAMMA = 0.9


def vecnormalize_returns(rewards: np.ndarray, dones: np.ndarray, gamma: float) -> np.ndarray:
    """SB3 `VecNormalize.step_wait`'s `returns` after each step, written as it is there."""
    returns = np.zeros(rewards.shape[1])
    out = []
    for reward, done in zip(rewards, dones):
        returns = returns * gamma + reward
        out.append(returns.copy())
        returns[done] = 0
    return np.array(out)


def request(run_id: str, reward, terminated, truncated, n: int = 2) -> dict[str, np.ndarray]:
    return {
        "run_id": run_id,
        "obs": np.zeros((n, 4), np.float32),
        "is_first": np.zeros(n, bool),
        "reward": np.asarray(reward, np.float32),
        "terminated": np.asarray(terminated, bool),
        "truncated": np.asarray(truncated, bool),
    }


def test_running_return_runs_across_unrolls_and_restarts_where_episodes_end():
    rng = np.random.default_rng(0)
    steps, length = 13, 3
    rewards = rng.normal(size=(steps, 2)).astype(np.float32)
    terminated = np.zeros((steps, 2), bool)
    truncated = np.zeros((steps, 2), bool)
    terminated[4, 0] = True  # inside an unroll
    truncated[5, 1] = True  # at an unroll's last step: the restart carries into the next
    terminated[9, 1] = True
    assembler = UnrollAssembler(length, return_gamma=GAMMA)
    action = np.zeros(2, np.int64)
    assembler.add("k", request("a", [0, 0], [0, 0], [0, 0]), action, {})  # the reset
    unrolls = []
    for t in range(steps):
        done = assembler.add("k", request("a", rewards[t], terminated[t], truncated[t]), action, {})
        unrolls += [done] if done is not None else []
    got = np.concatenate([u["return"] for u in unrolls])
    assert len(unrolls) == steps // length
    expected = vecnormalize_returns(rewards, terminated | truncated, GAMMA)
    np.testing.assert_allclose(got, expected[: len(got)], rtol=1e-5, atol=1e-6)  # float32 sums
    # A restarted runner (new run id) starts its sum from 0, not from the old one's.
    assembler.add("k", request("b", [0, 0], [0, 0], [0, 0]), action, {})
    for _ in range(length):
        done = assembler.add("k", request("b", [1, 2], [0, 0], [0, 0]), action, {})
    np.testing.assert_allclose(
        done["return"][:, 1], [2, 2 + 2 * GAMMA, 2 + GAMMA * (2 + 2 * GAMMA)]
    )


def test_without_a_discount_unrolls_carry_no_return():
    assembler = UnrollAssembler(1)
    action = np.zeros(2, np.int64)
    assembler.add("k", request("a", [0, 0], [0, 0], [0, 0]), action, {})
    assert "return" not in assembler.add("k", request("a", [1, 1], [0, 0], [0, 0]), action, {})


def test_reward_scale_is_the_running_std_of_the_returns_clipped():
    rng = np.random.default_rng(1)
    scaler = RewardScaler(clip=5.0)
    torch.testing.assert_close(scaler(torch.tensor([3.0, -30.0])), torch.tensor([3.0, -5.0]))
    seen = [rng.normal(-40.0, 7.0, size) for size in (1, 50, 9)]
    for returns in seen:
        scaler.update(torch.as_tensor(returns))
    var = np.concatenate(seen).var()
    reward = torch.tensor([-1.0, 20.0, -300.0])
    expected = (reward / np.sqrt(var + 1e-8)).clamp(-5.0, 5.0)  # not centred: -1 stays < 0
    torch.testing.assert_close(scaler(reward), expected.float())


def make(name: str, **algo: object) -> Algorithm:
    torch.manual_seed(0)
    cls = ALGORITHMS[name]
    cfg = cls.config_cls(normalize_reward=True, **algo)
    return cls(cfg, CARTPOLE.observation_space, CARTPOLE.action_space, ModelConfig())


def with_returns(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    out = batch(name, seed)
    out["return"] = np.random.default_rng(seed).normal(-20.0, 4.0, (T, B)).astype(np.float32)
    return out


@pytest.mark.parametrize("name", ["vtrace", "a3c", "ppo"])
def test_batch_rewards_are_scaled_by_the_valid_steps_returns(name: str):
    algorithm = make(name)
    data = with_returns(name)
    b = algorithm.batch_tensors(data)
    valid = ~data["is_first"][1:]  # the autoreset step's return is no return
    assert algorithm.reward_scaler.count.item() == valid.sum() < T * B
    var = data["return"][valid].astype(np.float64).var()
    np.testing.assert_allclose(algorithm.reward_scaler.var.item(), var, rtol=1e-5)
    np.testing.assert_allclose(
        b["reward"].numpy(), np.clip(data["reward"] / np.sqrt(var + 1e-8), -10, 10), rtol=1e-5
    )
    metrics = algorithm.update(with_returns(name, seed=1))  # the loss runs on scaled rewards
    assert np.isfinite(list(metrics.values())).all()


def test_checkpoints_carry_the_statistics_and_refuse_a_mismatch():
    trained = make("a3c")
    trained.update(with_returns("a3c"))
    resumed = make("a3c")
    resumed.load_state_dict(trained.state_dict())
    for key, value in trained.reward_scaler.state_dict().items():
        assert torch.equal(resumed.reward_scaler.state_dict()[key], value)
    plain = ALGORITHMS["a3c"](
        ALGORITHMS["a3c"].config_cls(),
        CARTPOLE.observation_space,
        CARTPOLE.action_space,
        ModelConfig(),
    )
    mismatch = r"normalize_reward={}, this run has algo\.normalize_reward={}"
    with pytest.raises(ValueError, match=mismatch.format("true", "false")):
        plain.load_state_dict(trained.state_dict())
    with pytest.raises(ValueError, match=mismatch.format("false", "true")):
        resumed.load_state_dict(plain.state_dict())


def test_the_field_is_the_on_policy_algorithms_and_says_what_it_takes():
    spec = ExperimentSpec.build({"algo": {"name": "ppo", "normalize_reward": True}})
    assert spec.algo.return_discount() == spec.algo.gamma
    assert ExperimentSpec.build({"algo": "ppo"}).algo.return_discount() is None
    with pytest.raises(SpecError, match="normalize_reward"):
        ExperimentSpec.build({"algo": {"name": "sac", "normalize_reward": True}})
