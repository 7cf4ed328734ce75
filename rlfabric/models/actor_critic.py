"""The actor-critic network every on-policy algorithm shares."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from rlfabric.models.config import ModelConfig, runs_bf16
from rlfabric.models.networks import (
    MLP,
    CategoricalHead,
    GaussianHead,
    ImpalaCNN,
    NatureCNN,
    SDEGaussianHead,
    init_layer,
    is_image_space,
)
from rlfabric.models.normalization import build_obs_normalizer


class UnsupportedSpaceError(ValueError):
    """An observation or action space no model here can handle."""


def build_torso(obs_space: gym.Space, cfg: ModelConfig) -> nn.Module:
    """Pick the torso from the observation space unless the spec names one."""
    if not isinstance(obs_space, gym.spaces.Box):
        raise UnsupportedSpaceError(
            f"observation space {obs_space} is not supported; allowed: Box observations"
        )
    torso = cfg.torso
    if torso == "auto":
        torso = "cnn" if is_image_space(obs_space) else "mlp"
    if torso in ("cnn", "impala_cnn"):
        if len(obs_space.shape) != 3:
            raise UnsupportedSpaceError(
                f"model.torso={torso!r} needs [C, H, W] observations, got shape {obs_space.shape}"
            )
        if torso == "impala_cnn":
            return ImpalaCNN(tuple(obs_space.shape), cfg.impala_features)
        return NatureCNN(tuple(obs_space.shape), cfg.cnn_features)
    return MLP(int(np.prod(obs_space.shape)), cfg.hidden, cfg.activation)


def build_policy_head(in_dim: int, action_space: gym.Space, cfg: ModelConfig) -> nn.Module:
    """Categorical for Discrete actions, diagonal Gaussian for 1-D Box actions."""
    if isinstance(action_space, gym.spaces.Discrete):
        if cfg.sde:
            raise UnsupportedSpaceError(
                f"model.sde=true explores continuous actions; {action_space} is discrete "
                "(allowed: model.sde=false)"
            )
        return CategoricalHead(in_dim, int(action_space.n))
    if isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
        head = SDEGaussianHead if cfg.sde else GaussianHead
        return head(in_dim, action_space.shape[0], cfg.log_std_init)
    raise UnsupportedSpaceError(
        f"action space {action_space} is not supported; allowed: Discrete or 1-D Box"
    )


class ActorCritic(nn.Module):
    """An optional observation normalizer, torso, optional LSTM core, policy and value heads.

    With `model.normalize_obs` the observation is normalized by running statistics
    (`models.normalization`) before both torsos, as Sample Factory's normalizer sits at
    the front of its model: the model takes observations as the env gives them.

    With `shared_torso=False` the value head sits on its own MLP torso of the same
    shape, as CleanRL's `ppo_continuous_action.py` keeps separate actor and critic
    networks, so that the value loss does not shape the policy's features.

    Inputs are time-major `[T, B, ...]`. `forward` returns the policy
    parameters `[T, B, P]` and values `[T, B]`; `unroll` also returns the
    recurrent state after the last step. The state is one tensor `[B, 2, H]`
    (LSTM h and c), zeroed wherever `first[t]` says an episode starts, so the
    learner can recompute an unroll from the state its first step saw.
    """

    def __init__(self, obs_space: gym.Space, action_space: gym.Space, cfg: ModelConfig) -> None:
        super().__init__()
        self.torso = build_torso(obs_space, cfg)
        self.obs_norm = build_obs_normalizer(obs_space, cfg)
        self.value_torso: nn.Module | None = None
        if not cfg.shared_torso:
            if not isinstance(self.torso, MLP) or cfg.lstm:
                kind = "impala_cnn" if isinstance(self.torso, ImpalaCNN) else "cnn"
                kind = "mlp" if isinstance(self.torso, MLP) else kind
                raise ValueError(
                    "model.shared_torso=false gives the value its own MLP torso, which needs "
                    f"an MLP policy torso without an LSTM core; got torso '{kind}' and "
                    f"model.lstm={cfg.lstm} (allowed: model.shared_torso=true, or an MLP "
                    "torso with model.lstm=0)"
                )
            self.value_torso = build_torso(obs_space, cfg)
        if cfg.sde and cfg.lstm:
            raise ValueError(
                "model.sde=true holds each env's noise matrix as its acting state, which "
                "model.lstm's recurrent state would have to share (allowed: model.lstm=0 "
                "with sde, or sde=false)"
            )
        width = self.torso.out_dim
        self.core = nn.LSTMCell(width, cfg.lstm) if cfg.lstm else None
        width = cfg.lstm or width
        self.policy = build_policy_head(width, action_space, cfg)
        value_width = width if self.value_torso is None else self.value_torso.out_dim
        self.value = init_layer(nn.Linear(value_width, 1), gain=1.0)
        self.precision = cfg.precision
        self.state_size = cfg.lstm

    @property
    def recurrent(self) -> bool:
        return self.core is not None

    def initial_state(self, batch: int) -> torch.Tensor:
        """Zero state `[B, 2, H]` (empty `[B, 2, 0]` without a core)."""
        return torch.zeros(batch, 2, self.state_size, device=self.value.weight.device)

    def forward(
        self,
        obs: torch.Tensor,
        first: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        params, value, _ = self.unroll(obs, first, state)
        return params, value

    def unroll(
        self,
        obs: torch.Tensor,
        first: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        time, batch = obs.shape[:2]
        if self.obs_norm is not None:  # in float32, before any autocast
            obs = self.obs_norm(obs)
        flat = obs.reshape(time * batch, *obs.shape[2:])
        # Mixed precision stops at the torso: core, heads, losses and targets stay float32.
        bf16 = runs_bf16(self.precision, obs.device)
        with torch.autocast(obs.device.type, dtype=torch.bfloat16, enabled=bf16):
            features = self.torso(flat)
            value_features = features if self.value_torso is None else self.value_torso(flat)
        features = features.float()
        if self.core is not None:  # shared torso only: the value reads the core's output
            features, state = self._run_core(features.reshape(time, batch, -1), first, state)
            features = value_features = features.reshape(time * batch, -1)
        params = self.policy(features)
        value = self.value(value_features.float()).squeeze(-1)
        return params.reshape(time, batch, -1), value.reshape(time, batch), state

    def _run_core(
        self, features: torch.Tensor, first: torch.Tensor | None, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step the LSTM through time, resetting the state where an episode starts."""
        assert self.core is not None
        time, batch = features.shape[:2]
        if state is None:
            state = self.initial_state(batch)
        h, c = state[:, 0], state[:, 1]
        outputs = []
        for t in range(time):
            if first is not None:
                keep = (~first[t]).unsqueeze(-1).to(h.dtype)
                h, c = h * keep, c * keep
            h, c = self.core(features[t], (h, c))
            outputs.append(h)
        return torch.stack(outputs), torch.stack([h, c], dim=1)

    def distribution(self, params: torch.Tensor) -> torch.distributions.Distribution:
        return self.policy.distribution(params)

    def mode(self, params: torch.Tensor) -> torch.Tensor:
        return self.policy.mode(params)
