"""Torsos (MLP, Nature CNN, IMPALA's ResNet) and heads (categorical, one categorical per
MultiDiscrete dimension, Bernoulli, diagonal Gaussian, value).

Initialisation follows CleanRL's `ppo_atari.py`: orthogonal weights with gain
sqrt(2) in the torso, 0.01 for the policy head and 1 for the value head, so
that the initial policy is near uniform and the initial values near zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Bernoulli, Categorical, Independent, Normal

SDE_EPS = 1e-6
"""Added to gSDE's variance under the square root (SB3's `epsilon`)."""


def init_layer(layer: nn.Module, gain: float = math.sqrt(2.0)) -> nn.Module:
    """Orthogonal weight, zero bias (CleanRL `layer_init`)."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class MLP(nn.Module):
    """Flatten the observation (or `encode` it: one-hot for discrete spaces), then hidden
    layers with one activation."""

    def __init__(
        self, in_dim: int, hidden: list[int], activation: str, encode: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.encode = encode
        act = {"tanh": nn.Tanh, "relu": nn.ReLU}[activation]
        layers: list[nn.Module] = []
        for width in hidden:
            layers += [init_layer(nn.Linear(in_dim, width)), act()]
            in_dim = width
        self.net = nn.Sequential(*layers)
        self.out_dim = in_dim

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.flatten(1).float() if self.encode is None else self.encode(obs))


class PixelTorso(nn.Module):
    """A conv stack on pixels, then one ReLU layer of `features` units: the shape the
    Nature CNN and IMPALA's ResNet share.

    `obs_shape` is `[C, H, W]`; with `channels_last` the observations come as
    `[H, W, C]` (MiniGrid, most image envs outside Atari) and are permuted here, so
    the env needs no wrapper. Pixels are multiplied by `scale`: 1/255 for uint8 frames,
    1 for float images, taken as the env gives them.
    """

    def __init__(
        self,
        conv: nn.Sequential,
        obs_shape: tuple[int, ...],
        features: int,
        channels_last: bool = False,
        scale: float = 1.0 / 255.0,
    ) -> None:
        super().__init__()
        self.conv = conv
        self.channels_last, self.scale = channels_last, scale
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, *obs_shape)).shape[1]
        self.fc = nn.Sequential(init_layer(nn.Linear(flat, features)), nn.ReLU())
        self.out_dim = features

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.float()
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)
        return self.fc(self.conv(x * self.scale))


class NatureCNN(PixelTorso):
    """The DQN/IMPALA-shallow Atari torso (Mnih et al. 2015): uint8 [C, 84, 84] in."""

    #: The smallest frame side its 8-4-3 kernels with strides 4-2-1 take.
    min_side = 36

    def __init__(self, obs_shape: tuple[int, ...], features: int, **pixels: float) -> None:
        channels = obs_shape[0]
        conv = nn.Sequential(
            init_layer(nn.Conv2d(channels, 32, 8, stride=4)),
            nn.ReLU(),
            init_layer(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            init_layer(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
        )
        super().__init__(conv, obs_shape, features, **pixels)


class ResidualBlock(nn.Module):
    """IMPALA's residual block: x + conv(relu(conv(relu(x)))), 3x3 convs keeping the size."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = init_layer(nn.Conv2d(channels, channels, 3, padding=1))
        self.conv1 = init_layer(nn.Conv2d(channels, channels, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


class ImpalaCNN(PixelTorso):
    """IMPALA's deep torso (Espeholt et al. 2018, arXiv 1802.01561, Figure 3 right).

    Three sections of conv 3x3, max-pool 3x3 stride 2 and two residual blocks, with
    16, 32 and 32 channels; then ReLU, a `features`-unit layer (256 in the paper) and
    ReLU. Built as Cleanba's `cleanba_impala.py` (`ConvSequence`, `ResidualBlock`) and
    TorchBeast's `polybeast_learner.py` `Net` build it: 'same' padding, so an 84x84
    frame leaves the sections at 42, 21 and 11 pixels (pool padding 1 matches TF's
    SAME). Both residual blocks of every section are applied (TorchRL's ImpalaNet once
    skipped the second, its issue #3519; `tests/test_models.py` checks each one counts).
    Weights are initialised orthogonally as the other torsos here; the references use
    their frameworks' defaults. uint8 `[C, H, W]` in, scaled by 1/255 as the Nature CNN.
    """

    min_side = 1

    def __init__(
        self,
        obs_shape: tuple[int, ...],
        features: int,
        channels: tuple[int, ...] = (16, 32, 32),
        **pixels: float,
    ) -> None:
        layers: list[nn.Module] = []
        in_channels = obs_shape[0]
        for out_channels in channels:
            layers += [
                init_layer(nn.Conv2d(in_channels, out_channels, 3, padding=1)),
                nn.MaxPool2d(3, stride=2, padding=1),
                ResidualBlock(out_channels),
                ResidualBlock(out_channels),
            ]
            in_channels = out_channels
        conv = nn.Sequential(*layers, nn.ReLU(), nn.Flatten())
        super().__init__(conv, obs_shape, features, **pixels)


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


class MultiCategorical:
    """One categorical per `MultiDiscrete` dimension, independent given the state: the
    log-prob and the entropy of an action are the sums over its dimensions (SB3's
    `MultiCategoricalDistribution`). Actions are `[..., D]` integers."""

    def __init__(self, logits: torch.Tensor, nvec: tuple[int, ...]) -> None:
        self.parts = [
            Categorical(logits=part, validate_args=False) for part in logits.split(nvec, -1)
        ]

    def sample(self) -> torch.Tensor:
        return torch.stack([part.sample() for part in self.parts], dim=-1)

    def log_prob(self, action: torch.Tensor) -> torch.Tensor:
        dims = action.long().unbind(-1)
        return torch.stack([p.log_prob(a) for p, a in zip(self.parts, dims)], -1).sum(-1)

    def entropy(self) -> torch.Tensor:
        return torch.stack([part.entropy() for part in self.parts], dim=-1).sum(-1)


class MultiCategoricalHead(nn.Module):
    """Logits for each `MultiDiscrete` dimension, side by side: `sum(nvec)` parameters."""

    def __init__(self, in_dim: int, nvec: tuple[int, ...]) -> None:
        super().__init__()
        self.nvec = tuple(int(n) for n in nvec)
        self.linear = init_layer(nn.Linear(in_dim, sum(self.nvec)), gain=0.01)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features)

    def distribution(self, params: torch.Tensor) -> MultiCategorical:
        return MultiCategorical(params, self.nvec)

    def mode(self, params: torch.Tensor) -> torch.Tensor:
        return torch.stack([part.argmax(-1) for part in params.split(self.nvec, -1)], dim=-1)


class BinaryActions(Independent):
    """Independent Bernoulli actions, one per `MultiBinary` entry; the env's integer
    actions are scored as floats (torch's Bernoulli takes only those)."""

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return super().log_prob(value.float())


class BernoulliHead(nn.Module):
    """One logit per `MultiBinary` entry (SB3's `BernoulliDistribution`)."""

    def __init__(self, in_dim: int, n: int) -> None:
        super().__init__()
        self.linear = init_layer(nn.Linear(in_dim, n), gain=0.01)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features)

    @staticmethod
    def distribution(params: torch.Tensor) -> BinaryActions:
        return BinaryActions(Bernoulli(logits=params, validate_args=False), 1)

    @staticmethod
    def mode(params: torch.Tensor) -> torch.Tensor:
        return (params > 0).to(torch.int8)


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


class SDEGaussianHead(nn.Module):
    """A Gaussian head for generalized state-dependent exploration (gSDE: Raffin et al.,
    arXiv 2005.05719; SB3's `StateDependentNoiseDistribution` with `full_std`, no
    `expln`, features not learned).

    The exploration noise is linear in the policy's features: eps(s) = phi(s) @ theta,
    with theta ~ N(0, sigma^2) of shape `[features, actions]` (sigma = exp(log_std),
    learned) drawn per env and held for several steps, so consecutive actions push the
    same way where states are alike, which independent draws per step cancel out (a
    car that must swing up; a pendulum). Over theta the action is Gaussian with mean
    mu(s) and variance phi(s)^2 @ sigma^2: the distribution the losses score and the
    behaviour log-prob is taken under, a diagonal Gaussian as `GaussianHead`'s.

    The parameters are `cat(mean, log std, phi(s))`: the features ride along (detached,
    as SB3's `learn_features=False`) so that acting can add the held noise (`explore`).
    """

    def __init__(self, in_dim: int, action_dim: int, log_std_init: float) -> None:
        super().__init__()
        self.in_dim, self.action_dim = in_dim, action_dim
        self.mean = init_layer(nn.Linear(in_dim, action_dim), gain=0.01)
        self.log_std = nn.Parameter(torch.full((in_dim, action_dim), log_std_init))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        latent = features.detach()
        variance = latent.square() @ self.log_std.exp().square()
        log_std = 0.5 * torch.log(variance + SDE_EPS)
        return torch.cat([self.mean(features), log_std, latent], dim=-1)

    def distribution(self, params: torch.Tensor) -> Independent:
        mean, log_std = params[..., : self.action_dim], params[..., self.action_dim : -self.in_dim]
        return Independent(Normal(mean, log_std.exp(), validate_args=False), 1)

    def mode(self, params: torch.Tensor) -> torch.Tensor:
        return params[..., : self.action_dim]

    def sample_exploration(self, n: int) -> torch.Tensor:
        return draw_noise_matrices(self.log_std, n)

    def explore(self, params: torch.Tensor, exploration: torch.Tensor) -> torch.Tensor:
        """Actions `[n, actions]`: the mean plus phi(s) @ theta, one theta per row."""
        latent = params[..., -self.in_dim :]
        return self.mode(params) + torch.bmm(latent.unsqueeze(1), exploration).squeeze(1)


def draw_noise_matrices(log_std: torch.Tensor, n: int) -> torch.Tensor:
    """`n` fresh gSDE noise matrices theta `[n, features, actions]`, each entry
    N(0, sigma^2) with sigma = exp(log_std `[features, actions]`)."""
    std = log_std.exp()
    return torch.randn(n, *std.shape, device=std.device) * std


def advance_held_noise(
    held: torch.Tensor, shape: tuple[int, int], freq: int, draw: Callable[[int], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each env's gSDE noise matrix for this step, and the acting state after it.

    `held [N, 1 + features x actions]` is per env the steps its matrix has been held
    (modulo `freq`), then the flattened matrix of `shape`. A count of 0 means the
    matrix is due: `draw(n)` gives `n` fresh ones. The on-policy head and SAC's gSDE
    actor share this, so both hold their noise the same way (SB3's `sde_sample_freq`).
    """
    steps = held[:, 0]
    noise = held[:, 1:].reshape(-1, *shape).clone()
    fresh = steps == 0
    if bool(fresh.any()):
        noise[fresh] = draw(int(fresh.sum()))
    state = torch.cat([torch.remainder(steps + 1, freq)[:, None], noise.flatten(1)], dim=1)
    return noise, state


def is_image_space(space: gym.Space) -> bool:
    """Image observations: 3-D uint8 boxes (channels first, as the env factory makes them,
    or last, as most image envs give them)."""
    return isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3
