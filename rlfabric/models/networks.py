"""Torsos (MLP, Nature CNN) and heads (categorical, diagonal Gaussian, value).

Initialisation follows CleanRL's `ppo_atari.py`: orthogonal weights with gain
sqrt(2) in the torso, 0.01 for the policy head and 1 for the value head, so
that the initial policy is near uniform and the initial values near zero.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Independent, Normal


def init_layer(layer: nn.Module, gain: float = math.sqrt(2.0)) -> nn.Module:
    """Orthogonal weight, zero bias (CleanRL `layer_init`)."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class MLP(nn.Module):
    """Flatten the observation, then hidden layers with one activation."""

    def __init__(self, in_dim: int, hidden: list[int], activation: str) -> None:
        super().__init__()
        act = {"tanh": nn.Tanh, "relu": nn.ReLU}[activation]
        layers: list[nn.Module] = []
        for width in hidden:
            layers += [init_layer(nn.Linear(in_dim, width)), act()]
            in_dim = width
        self.net = nn.Sequential(*layers)
        self.out_dim = in_dim

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.flatten(1).float())


class NatureCNN(nn.Module):
    """The DQN/IMPALA-shallow Atari torso (Mnih et al. 2015): uint8 [C, 84, 84] in."""

    def __init__(self, obs_shape: tuple[int, ...], features: int) -> None:
        super().__init__()
        channels = obs_shape[0]
        self.conv = nn.Sequential(
            init_layer(nn.Conv2d(channels, 32, 8, stride=4)),
            nn.ReLU(),
            init_layer(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            init_layer(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, *obs_shape)).shape[1]
        self.fc = nn.Sequential(init_layer(nn.Linear(flat, features)), nn.ReLU())
        self.out_dim = features

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(obs.float() / 255.0))


class CategoricalHead(nn.Module):
    """Logits over a Discrete action space; the parameters *are* the logits."""

    def __init__(self, in_dim: int, num_actions: int) -> None:
        super().__init__()
        self.linear = init_layer(nn.Linear(in_dim, num_actions), gain=0.01)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features)

    @staticmethod
    def distribution(params: torch.Tensor) -> Categorical:
        return Categorical(logits=params, validate_args=False)

    @staticmethod
    def mode(params: torch.Tensor) -> torch.Tensor:
        return params.argmax(-1)


class GaussianHead(nn.Module):
    """Diagonal Gaussian with a state-independent learned log std.

    The parameters are `cat(mean, log_std)` on the last axis, so that one tensor
    carries the whole distribution, whatever the action space.
    """

    def __init__(self, in_dim: int, action_dim: int, log_std_init: float) -> None:
        super().__init__()
        self.mean = init_layer(nn.Linear(in_dim, action_dim), gain=0.01)
        self.log_std = nn.Parameter(torch.full((action_dim,), log_std_init))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        mean = self.mean(features)
        return torch.cat([mean, self.log_std.expand_as(mean)], dim=-1)

    @staticmethod
    def distribution(params: torch.Tensor) -> Independent:
        mean, log_std = params.chunk(2, dim=-1)
        return Independent(Normal(mean, log_std.exp(), validate_args=False), 1)

    @staticmethod
    def mode(params: torch.Tensor) -> torch.Tensor:
        return params.chunk(2, dim=-1)[0]


def is_image_space(space: gym.Space) -> bool:
    """Image observations: 3-D uint8 boxes (channels first, as the env factory makes them)."""
    return isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3
