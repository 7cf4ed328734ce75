"""Small envs in the spaces the platform learns in beyond Box and Discrete, and a torso of
a user's own.

Importing this module registers the envs as `<Name>-v0`; the env runners get each
registration with the env's description (their entry points import this module there:
the `ray_session` fixture puts tests/ on the workers' path), and `model.torso:
space_envs:SmallTorso` finds the torso the same way.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from torch import nn


class CopyBits(gym.Env):
    """Copy a random bit pattern shown as the observation: reward is the fraction of
    action entries equal to it, in 8-step episodes (truncated). The best return is 8, a
    uniform policy's 4. Actions: MultiBinary(n) or, with `multidiscrete`, one
    Discrete(2) per bit (MultiDiscrete([2] * n))."""

    def __init__(self, bits: int = 3, multidiscrete: bool = False) -> None:
        self.observation_space = gym.spaces.MultiBinary(bits)
        self.action_space = (
            gym.spaces.MultiDiscrete([2] * bits) if multidiscrete else gym.spaces.MultiBinary(bits)
        )
        self.steps = 0

    def _draw(self) -> np.ndarray:
        self.target = self.np_random.integers(0, 2, self.observation_space.n).astype(np.int8)
        return self.target

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.steps = 0
        return self._draw(), {}

    def step(self, action):
        reward = float(np.mean(np.asarray(action) == self.target))
        self.steps += 1
        return self._draw(), reward, False, self.steps >= 8, {}


class SmallTorso(nn.Module):
    """A user's torso: the contract is `Torso(obs_space, **kwargs)` with `out_dim`."""

    def __init__(self, obs_space: gym.Space, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(int(np.prod(obs_space.shape)), width), nn.ReLU())
        self.out_dim = width

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.reshape(len(obs), -1).float())


class DictCopyBits(CopyBits):
    """CopyBits with the pattern inside a nested Dict observation, beside a small frame,
    a float vector and a Discrete entry that carry no signal (MiniGrid's shape: an image,
    a direction, and here a Tuple). With `text`, a Text entry too, which no torso encodes."""

    def __init__(self, bits: int = 3, text: bool = False) -> None:
        super().__init__(bits)
        entries = {
            "frame": gym.spaces.Box(0, 255, (36, 36, 1), np.uint8),
            "task": gym.spaces.Dict(
                {"bits": gym.spaces.MultiBinary(bits), "pos": gym.spaces.Box(-1.0, 1.0, (2,))}
            ),
            "extra": gym.spaces.Tuple((gym.spaces.Discrete(3),)),
        }
        if text:
            entries["mission"] = gym.spaces.Text(12)
        self.observation_space = gym.spaces.Dict(entries)
        self.bits = bits

    def _draw(self) -> dict:
        self.target = self.np_random.integers(0, 2, self.bits).astype(np.int8)
        obs = self.observation_space.sample()
        obs["task"]["bits"] = self.target
        return obs


def flatten_only(obs_space: gym.Space) -> nn.Module:
    """A factory that breaks the contract: its module has no `out_dim`."""
    return nn.Flatten()


gym.register("CopyBits-v0", entry_point=CopyBits)
gym.register("DictCopyBits-v0", entry_point=DictCopyBits)
gym.register("DictCopyBitsText-v0", entry_point=DictCopyBits, kwargs={"text": True})
gym.register("CopyBitsMultiDiscrete-v0", entry_point=CopyBits, kwargs={"multidiscrete": True})
