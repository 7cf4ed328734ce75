"""TD3: twin delayed deep deterministic policy gradient.

Fujimoto, van Hoof & Meger 2018, "Addressing Function Approximation Error in
Actor-Critic Methods" (arXiv 1802.09477), Algorithm 1, with the defaults of
the authors' `TD3.py` and CleanRL's `td3_continuous_action.py`: exploration
noise 0.1, target policy smoothing noise 0.2 clipped to 0.5 (all in units of
the action half range), actor and target updates every 2 critic updates.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from rlfabric.algorithms.offpolicy import OffPolicyAlgorithm, OffPolicyConfig, frozen, polyak
from rlfabric.algorithms.offpolicy_networks import mlp, run_mixed
from rlfabric.models import ModelConfig


class TD3Config(OffPolicyConfig):
    name: Literal["td3"] = Field("td3", description="registered algorithm name")
    exploration_noise: float = Field(
        0.1, ge=0, description="std (sigma) of the acting noise, in half ranges"
    )
    exploration: Literal["gaussian", "ou"] = Field(
        "gaussian",
        description="acting noise: 'gaussian', independent per step (the paper), or 'ou', an "
        "Ornstein-Uhlenbeck process per env, reset at episode starts (DDPG; the RL Zoo's "
        "choice where exploration must persist, e.g. MountainCarContinuous)",
    )
    ou_theta: float = Field(0.15, gt=0, description="'ou' mean reversion rate (SB3: 0.15)")
    ou_dt: float = Field(0.01, gt=0, description="'ou' time step (SB3: 1e-2)")
    policy_noise: float = Field(
        0.2, ge=0, description="std of the target policy smoothing noise, in half ranges"
    )
    noise_clip: float = Field(0.5, ge=0, description="clip of the smoothing noise, in half ranges")
    policy_freq: int = Field(2, ge=1, description="critic updates per actor and target update")


class DeterministicActor(nn.Module):
    """mu(s) in tanh units [-1, 1] (the MLP in bf16 if `bf16`)."""

    def __init__(
        self, obs_dim: int, action_dim: int, hidden: list[int], bf16: bool = False
    ) -> None:
        super().__init__()
        self.net = mlp(obs_dim, hidden, action_dim)
        self.bf16 = bf16

    def forward(self, obs: Tensor) -> Tensor:
        return torch.tanh(run_mixed(self.net, obs.flatten(1).float(), self.bf16))


class TD3(OffPolicyAlgorithm):
    """Deterministic actor, twin critics, clipped double-Q targets with smoothing, delayed actor."""

    config_cls = TD3Config
    cfg: TD3Config

    def __init__(
        self,
        cfg: TD3Config,
        obs_space: gym.Space,
        action_space: gym.Space,
        model_cfg: ModelConfig,
        device: str = "cpu",
    ) -> None:
        super().__init__(cfg, obs_space, action_space, model_cfg, device)
        actor = DeterministicActor(self.obs_dim, self.action_dim, cfg.hidden, bf16=self.bf16)
        self.build_networks(actor, actor_target=True)
        self.actor_target = self.networks["actor_target"]

    def deterministic_actor(self) -> nn.Module:
        return self.actor

    def actor_steps_per_update(self) -> Fraction:
        """One actor step every `policy_freq` updates (RLx2 `TD3.py`: actor T_end / policy_freq)."""
        return Fraction(1, self.cfg.policy_freq)

    def acting_state(self, num_envs: int) -> np.ndarray | None:
        """Each env's Ornstein-Uhlenbeck noise `[N, action_dim]` (zero), with `exploration: ou`."""
        if self.cfg.exploration != "ou":
            return None
        return np.zeros((num_envs, self.action_dim), np.float32)

    @torch.no_grad()
    def act(
        self,
        obs: np.ndarray,
        state: np.ndarray | None = None,
        first: np.ndarray | None = None,
        deterministic: bool = False,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        """mu(s) plus noise, clipped to the bounds (Fujimoto's `TD3.py` main loop).

        The noise is N(0, exploration_noise), or with `exploration: ou` each env's
        Ornstein-Uhlenbeck process x' = x - theta x dt + sigma sqrt(dt) N(0, 1) (SB3's
        `OrnsteinUhlenbeckActionNoise`), carried in `state` and restarted from 0 where
        `first` marks an episode start; the greedy action leaves it as it is.
        `policy_action` is mu(s) itself, which RLx2's policy distance compares with.
        """
        cfg = self.cfg
        mu = self.actor(self.normalize(torch.as_tensor(obs, device=self.device)))
        action, next_state = mu, state
        if not deterministic and cfg.exploration == "ou":
            x = torch.zeros_like(mu) if state is None else torch.as_tensor(state, device=mu.device)
            if first is not None:
                x = torch.where(torch.as_tensor(first, device=mu.device)[:, None], 0.0, x)
            x = x * (1.0 - cfg.ou_theta * cfg.ou_dt) + cfg.exploration_noise * math.sqrt(
                cfg.ou_dt
            ) * torch.randn_like(mu)
            action, next_state = (mu + x).clamp(-1.0, 1.0), x.cpu().numpy()
        elif not deterministic:
            noise = torch.randn_like(mu) * cfg.exploration_noise
            action = (mu + noise).clamp(-1.0, 1.0)
        extras = {"policy_action": self.to_env(mu).cpu().numpy()}
        return self.to_env(action).cpu().numpy(), extras, next_state

    @torch.no_grad()
    def target(self, reward: Tensor, next_obs: Tensor, discount: Tensor, noise: Tensor) -> Tensor:
        """y = r + discount * min_i Q'_i(s', clip(mu'(s') + clip(noise, -c, c), -1, 1)) (eq. 15).

        `noise` is the unclipped N(0, policy_noise) draw, passed in so that a test can fix it.
        """
        smoothing = noise.clamp(-self.cfg.noise_clip, self.cfg.noise_clip)
        next_action = (self.actor_target(next_obs) + smoothing).clamp(-1.0, 1.0)
        next_q = self.critic_target(next_obs, next_action).min(0).values
        return reward + discount * next_q

    def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        cfg = self.cfg
        b = self.batch_tensors(batch)
        self.updates += 1
        noise = torch.randn_like(b["action"]) * cfg.policy_noise
        y = self.target(b["reward"], b["next_obs"], b["discount"], noise)
        q = self.critic(b["obs"], b["action"])
        critic_loss = F.mse_loss(q, y.expand_as(q), reduction="none").mean(1).sum()
        self.gradient_step(self.optimizers["critic"], critic_loss)
        metrics = {
            "critic_loss": critic_loss.item(),
            "q_mean": q[0].mean().item(),
            "target_mean": y.mean().item(),
        }
        # Delayed policy updates (Section 5.2): actor and all targets every policy_freq steps.
        if self.updates % cfg.policy_freq == 0:
            with frozen(self.critic):
                actor_loss = -self.critic(b["obs"], self.actor(b["obs"]), first=1).mean()
            self.gradient_step(self.optimizers["actor"], actor_loss)
            polyak(self.actor_target, self.actor, cfg.tau)
            polyak(self.critic_target, self.critic, cfg.tau)
            self.after_target_update()
            metrics["actor_loss"] = actor_loss.item()
        return metrics
