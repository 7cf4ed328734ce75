"""The actor-critic network every on-policy algorithm shares."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from rlfabric.models.config import ModelConfig, runs_bf16
from rlfabric.models.encoders import Obs, build_torso
from rlfabric.models.networks import (
    BernoulliHead,
    CategoricalHead,
    GaussianHead,
    MultiCategoricalHead,
    SDEGaussianHead,
    init_layer,
)
from rlfabric.models.normalization import build_obs_normalizer
from rlfabric.observations import UnsupportedSpaceError, first_array, obs_map


def build_policy_head(in_dim: int, action_space: gym.Space, cfg: ModelConfig) -> nn.Module:
    """Categorical for Discrete actions, one categorical per dimension for MultiDiscrete,
    Bernoulli for MultiBinary, diagonal Gaussian for 1-D Box actions."""
    discrete = (gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)
    if isinstance(action_space, discrete) and cfg.sde:
        raise UnsupportedSpaceError(
            f"model.sde=true explores continuous actions; {action_space} is discrete "
            "(allowed: model.sde=false)"
        )
    if isinstance(action_space, gym.spaces.Discrete):
        if action_space.start != 0:
            raise UnsupportedSpaceError(
                f"action space {action_space} starts at {action_space.start}; the categorical "
                "head acts in 0..n-1 (allowed: Discrete(n) with start 0; a wrapper in "
                "env.wrappers can shift the actions)"
            )
        return CategoricalHead(in_dim, int(action_space.n))
    if isinstance(action_space, gym.spaces.MultiDiscrete):
        if action_space.nvec.ndim != 1 or np.any(action_space.start != 0):
            raise UnsupportedSpaceError(
                f"action space {action_space} is not supported; allowed: a 1-D MultiDiscrete "
                "starting at 0 (a wrapper in env.wrappers can flatten or shift it)"
            )
        return MultiCategoricalHead(in_dim, tuple(action_space.nvec.tolist()))
    if isinstance(action_space, gym.spaces.MultiBinary):
        if len(action_space.shape) != 1:
            raise UnsupportedSpaceError(
                f"action space {action_space} is not supported; allowed: a 1-D MultiBinary"
            )
        return BernoulliHead(in_dim, int(action_space.n))
    if isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
        head = SDEGaussianHead if cfg.sde else GaussianHead
        return head(in_dim, action_space.shape[0], cfg.log_std_init)
    raise UnsupportedSpaceError(
        f"action space {action_space} is not supported; allowed: Discrete, MultiDiscrete, "
        "MultiBinary or 1-D Box"
    )


class ActorCritic(nn.Module):
    """An optional observation normalizer, torso, optional LSTM core, policy and value heads.

    With `model.normalize_obs` the observation is normalized by running statistics
    (`models.normalization`) before both torsos, as Sample Factory's normalizer sits at
    the front of its model: the model takes observations as the env gives them.

    With `shared_torso=False` the value head sits on its own torso of the same kind,
    as CleanRL's `ppo_continuous_action.py` keeps separate actor and critic networks
    (SB3's `share_features_extractor=False`), so that the value loss does not shape the
    policy's features.

    Inputs are time-major `[T, B, ...]`: a tensor, or a dict of them for Dict/Tuple
    observations (`models.encoders`). `forward` returns the policy
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
            if cfg.lstm:
                raise ValueError(
                    "model.shared_torso=false gives the value its own torso, beside the "
                    f"policy's LSTM core, which the value reads when shared; got model.lstm="
                    f"{cfg.lstm} (allowed: model.shared_torso=true, or model.lstm=0)"
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
        obs: Obs,
        first: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        params, value, _ = self.unroll(obs, first, state)
        return params, value

    def unroll(
        self,
        obs: Obs,
        first: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        lead = first_array(obs)
        time, batch, device = lead.shape[0], lead.shape[1], lead.device
        if self.obs_norm is not None:  # in float32, before any autocast
            obs = self.obs_norm(obs)
        flat = obs_map(lambda x: x.reshape(time * batch, *x.shape[2:]), obs)
        # Mixed precision stops at the torso: core, heads, losses and targets stay float32.
        bf16 = runs_bf16(self.precision, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
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
