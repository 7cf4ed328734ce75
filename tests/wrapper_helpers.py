"""Gymnasium wrappers that `env.wrappers` names by import path in tests/test_env_wrappers.py.

Env runners import this module by the path alone (the `ray_session` fixture puts tests/ on
the workers' path), so nothing here may depend on the test module.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class PaddedObservation(gym.ObservationWrapper):
    """Appends `extra` copies of `value` to a flat Box observation: [4] -> [4 + extra]."""

    def __init__(self, env: gym.Env, extra: int = 1, value: float = 0.0) -> None:
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, spaces.Box) or len(space.shape) != 1:
            raise TypeError(f"PaddedObservation needs a flat Box observation, got {space}")
        pad = np.full(extra, value, dtype=space.dtype)
        self.pad = pad
        self.observation_space = spaces.Box(
            np.concatenate([space.low, pad]), np.concatenate([space.high, pad]), dtype=space.dtype
        )

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return np.concatenate([observation, self.pad])


class ScaledReward(gym.RewardWrapper):
    """Multiplies every reward by `scale`: what the agent learns from, not the env's own."""

    def __init__(self, env: gym.Env, scale: float) -> None:
        super().__init__(env)
        self.scale = scale

    def reward(self, reward: float) -> float:
        return self.scale * reward


class NeedsImages(gym.ObservationWrapper):
    """Refuses what it cannot wrap, as an image wrapper would refuse CartPole."""

    def __init__(self, env: gym.Env) -> None:
        raise ValueError(f"NeedsImages wraps image observations, got {env.observation_space}")


NOT_A_WRAPPER = 3
