"""Fault paths: NaN/inf losses are skipped and, in a row, stop the run with intact weights."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from test_training import FAST_VTRACE

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS
from rlfabric.models import ModelConfig
from rlfabric.platform.checkpoint import load_checkpoint
from rlfabric.platform.errors import RLFabricError


class NaNRewardCartPole(gym.Wrapper):
    """CartPole whose rewards turn NaN after `good_steps` steps (a broken env or reward)."""

    def __init__(self, good_steps: int = 3_000) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.good_steps = good_steps
        self.steps = 0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        return (
            obs,
            reward if self.steps < self.good_steps else float("nan"),
            terminated,
            truncated,
            info,
        )


gym.register("NaNRewardCartPole-v0", entry_point=NaNRewardCartPole, max_episode_steps=500)


def test_a_nan_batch_skips_the_step_and_leaves_weights_alone():
    cls = ALGORITHMS["td3"]
    env = gym.make("Pendulum-v1")
    algo = cls(cls.config_cls(hidden=[16]), env.observation_space, env.action_space, ModelConfig())
    before = {k: v.clone() for k, v in algo.q1.state_dict().items()}
    batch = {
        "obs": np.zeros((8, 3), np.float32),
        "action": np.zeros((8, 1), np.float32),
        "reward": np.full(8, np.nan, np.float32),
        "next_obs": np.zeros((8, 3), np.float32),
        "discount": np.full(8, 0.99, np.float32),
    }
    metrics = algo.update(batch)
    assert not np.isfinite(metrics["critic_loss"])
    assert algo.nonfinite_steps == 1
    for key, value in algo.q1.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_nan_losses_in_a_row_stop_the_run_with_a_clear_error(tmp_path):
    run = {
        "stop": {"env_frames": 200_000},
        "display": "none",
        "logdir": str(tmp_path),
        "name": "nan",
        "max_nonfinite_updates": 5,
    }
    platform = Platform(
        arch="local",
        algo=FAST_VTRACE,
        env={"id": "NaNRewardCartPole-v0", "num_envs": 4, "vectorization": "sync"},
        run=run,
    )
    with pytest.raises(RLFabricError, match=r"5 updates in a row had a NaN or inf loss"):
        platform.fit()
    checkpoint = sorted((tmp_path / "nan" / "checkpoints").glob("ckpt_*.pt"))[-1]
    state = load_checkpoint(Path(checkpoint))
    assert state["counters"]["skipped_updates"] == 5
    for value in state["algorithm"]["model"].values():
        assert torch.isfinite(value).all()
