"""Envs that fail on purpose, for fault tests under Ray.

Importing this module registers them as `<Name>-v0`; a test imports it, and the env
runners get each registration with the env's description (their entry points import
this module there: the `ray_session` fixture puts tests/ on the workers' path).
"""

from __future__ import annotations

import threading

import gymnasium as gym
import numpy as np


class NaNCartPole(gym.Wrapper):
    """CartPole whose rewards or observations turn NaN after `good_steps` steps (a broken
    env or reward). NaN observations make the policy's sampling raise in the learner's
    inference, not in the runner."""

    def __init__(self, good_steps: int = 3_000, field: str = "reward") -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.good_steps = good_steps
        self.field = field
        self.steps = 0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        if self.steps >= self.good_steps:
            if self.field == "obs":
                obs = np.full_like(obs, np.nan)
            else:
                reward = float("nan")
        return obs, reward, terminated, truncated, info


class BrokenStepCartPole(gym.Wrapper):
    """CartPole whose every step raises: a deterministic env bug."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))

    def step(self, action):
        raise ValueError("the physics engine is not installed")


class WedgedCartPole(gym.Wrapper):
    """CartPole whose step never returns after `good_steps` steps (a hung simulator)."""

    def __init__(self, good_steps: int = 100) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.good_steps = good_steps
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps > self.good_steps:
            threading.Event().wait()  # the runner's process is killed, never woken
        return self.env.step(action)


gym.register("WedgedCartPole-v0", entry_point=WedgedCartPole, max_episode_steps=500)
gym.register("NaNRewardCartPole-v0", entry_point=NaNCartPole, max_episode_steps=500)
gym.register(
    "NaNRewardSoonCartPole-v0",
    entry_point=NaNCartPole,
    max_episode_steps=500,
    kwargs={"good_steps": 20},
)
gym.register(
    "NaNObsCartPole-v0",
    entry_point=NaNCartPole,
    max_episode_steps=500,
    kwargs={"good_steps": 50, "field": "obs"},
)
gym.register("BrokenStepCartPole-v0", entry_point=BrokenStepCartPole, max_episode_steps=500)


def short_cartpole(max_episode_steps: int = 200) -> gym.Env:
    """An env creator function (no registered id): CartPole with shorter episodes."""
    return gym.make("CartPole-v1", max_episode_steps=max_episode_steps)
