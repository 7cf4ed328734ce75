"""SAC: soft actor-critic with a learned temperature.

Haarnoja et al. 2018, "Soft Actor-Critic Algorithms and Applications"
(arXiv 1812.05905), Algorithm 1: twin soft Q critics with soft targets, a
tanh-squashed Gaussian policy trained through the reparameterisation trick
(eq. 13), and the temperature alpha tuned by its own Adam to a target entropy
of -|A| (eq. 18). Details follow CleanRL's `sac_continuous_action.py`: the
policy's log std is squashed smoothly into [-5, 2], alpha starts at 1, and
alpha's loss is `-alpha * (log pi + target_entropy)`. Unlike CleanRL (which
delays the actor TD3-style) the actor and alpha update at every step, as in
the paper. `learn_alpha: false` keeps alpha at `alpha_init` (SB3's numeric
`ent_coef`).

With `model.sde` the actor explores with gSDE (Raffin et al., arXiv 2005.05719),
as SB3's SAC with `use_sde` (`full_std`, learned features, the mean clipped to
±2): what the RL Zoo's SAC needs on MountainCarContinuous-v0, where noise drawn
afresh at every step cancels out before the car has swung up.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from rlfabric.algorithms.offpolicy import (
    OffPolicyAlgorithm,
    OffPolicyConfig,
    check_offpolicy_torso,
    frozen,
    polyak,
)
from rlfabric.algorithms.offpolicy_networks import mlp, run_mixed
from rlfabric.models import ModelConfig
from rlfabric.models.networks import SDE_EPS, advance_held_noise, draw_noise_matrices

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0
SDE_MEAN_CLIP = 2.0
"""gSDE's pre-tanh mean is clipped to ±2 (SB3's `clip_mean`), so that tanh never saturates
and the held noise still moves the action."""


class SACConfig(OffPolicyConfig):
    name: Literal["sac"] = Field("sac", description="registered algorithm name")
    alpha_init: float = Field(1.0, gt=0, description="initial temperature alpha")
    learn_alpha: bool = Field(
        True,
        description="tune alpha to the target entropy -|A| (eq. 18); false: alpha stays "
        "alpha_init (SB3's ent_coef given as a number)",
    )


class SquashedGaussianActor(nn.Module):
    """A Gaussian over pre-tanh actions: `forward(obs)` gives its mean and log std."""

    def sample(self, obs: Tensor, eps: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Reparameterised a = tanh(mean + std * eps), its log-prob, and tanh(mean).

        log pi(a|s) = log N(x; mean, std) - sum log(1 - tanh(x)^2) (SAC appendix C), with
        log(1 - tanh(x)^2) = 2 (log 2 - x - softplus(-2x)), exact and stable (Spinning Up).
        `eps` ~ N(0, I) is drawn here unless given (tests fix it).
        """
        mean, log_std = self(obs)
        if eps is None:
            eps = torch.randn_like(mean)
        x = mean + log_std.exp() * eps
        gaussian = (-0.5 * eps**2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        squash = (2 * (math.log(2) - x - F.softplus(-2 * x))).sum(-1)
        return torch.tanh(x), gaussian - squash, torch.tanh(mean)


class TanhGaussianActor(SquashedGaussianActor):
    """Mean and log std from one MLP (in bf16 if `bf16`), as CleanRL's SAC."""

    def __init__(
        self, obs_dim: int, action_dim: int, hidden: list[int], bf16: bool = False
    ) -> None:
        super().__init__()
        self.net = mlp(obs_dim, hidden, 2 * action_dim)
        self.bf16 = bf16

    def forward(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        mean, log_std = run_mixed(self.net, obs.flatten(1).float(), self.bf16).chunk(2, dim=-1)
        # CleanRL's smooth squash into [LOG_STD_MIN, LOG_STD_MAX]: a gradient everywhere.
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(log_std) + 1)
        return mean, log_std


class SDETanhGaussianActor(SquashedGaussianActor):
    """gSDE's actor: the pre-tanh noise is linear in the last hidden layer's features,
    eps(s) = phi(s) @ theta with theta ~ N(0, sigma^2) of shape `[features, actions]`
    (sigma = exp(log_std), learned; SB3's `full_std`).

    Acting holds one theta per env for several steps (`SAC.act`). Over theta the
    pre-tanh action is Gaussian with std sqrt(phi(s)^2 @ sigma^2), which `forward`
    returns, so the losses sample and score it as the plain actor's Gaussian: one
    independent theta per transition, where SB3 shares one matrix over a batch (the
    same distribution per transition, less correlated across the batch). The features
    keep their gradient through the std (SB3 SAC's `learn_features`).
    """

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        hidden: list[int],
        log_std_init: float,
        bf16: bool = False,
    ) -> None:
        super().__init__()
        # No hidden layers: the features are the observation itself (a linear policy).
        body = [mlp(obs_dim, hidden[:-1], hidden[-1]), nn.ReLU()] if hidden else []
        self.body = nn.Sequential(*body)
        self.in_dim = hidden[-1] if hidden else obs_dim
        self.mean = nn.Linear(self.in_dim, action_dim)
        self.log_std = nn.Parameter(torch.full((self.in_dim, action_dim), log_std_init))
        self.action_dim, self.bf16 = action_dim, bf16

    def features(self, obs: Tensor) -> Tensor:
        """phi(s) `[B, features]`, in float32."""
        return run_mixed(self.body, obs.flatten(1).float(), self.bf16)

    def head(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """The clipped mean and the log std of the pre-tanh action, given phi(s)."""
        mean = self.mean(features).clamp(-SDE_MEAN_CLIP, SDE_MEAN_CLIP)
        variance = features.square() @ self.log_std.exp().square()
        return mean, 0.5 * torch.log(variance + SDE_EPS)

    def forward(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        return self.head(self.features(obs))

    def sample_exploration(self, n: int) -> Tensor:
        return draw_noise_matrices(self.log_std, n)


class SAC(OffPolicyAlgorithm):
    """Tanh-Gaussian actor, twin soft Q critics with targets, learned temperature."""

    config_cls = SACConfig
    cfg: SACConfig
    intermediate_observations = True

    def __init__(
        self,
        cfg: SACConfig,
        obs_space: gym.Space,
        action_space: gym.Space,
        model_cfg: ModelConfig,
        device: str = "cpu",
    ) -> None:
        super().__init__(cfg, obs_space, action_space, model_cfg, device)
        if model_cfg.sde:
            actor: SquashedGaussianActor = SDETanhGaussianActor(
                self.obs_dim, self.action_dim, cfg.hidden, model_cfg.log_std_init, self.bf16
            )
        else:
            actor = TanhGaussianActor(self.obs_dim, self.action_dim, cfg.hidden, bf16=self.bf16)
        self.build_networks(actor)
        self.log_alpha = torch.tensor(
            math.log(cfg.alpha_init), device=self.device, requires_grad=True
        )
        self.target_entropy = -float(self.action_dim)
        self.optimizers["alpha"] = torch.optim.Adam([self.log_alpha], lr=cfg.lr, fused=True)

    @classmethod
    def check_model(cls, model_cfg: ModelConfig) -> None:
        """SAC takes gSDE (`model.sde`); of the other model fields it reads only the
        torso's kind (an MLP)."""
        check_offpolicy_torso("sac", model_cfg)

    def deterministic_actor(self) -> nn.Module:
        return _TanhMean(self.actor)

    def acting_state(self, num_envs: int) -> np.ndarray | None:
        """With `model.sde`, each env's held gSDE noise `[N, 1 + features x actions]`: the
        steps it has been held, then the matrix (zero steps: draw one at the next act)."""
        if not isinstance(self.actor, SDETanhGaussianActor):
            return None
        return np.zeros((num_envs, 1 + self.actor.in_dim * self.action_dim), np.float32)

    @property
    def alpha(self) -> Tensor:
        return self.log_alpha.detach().exp()

    @torch.no_grad()
    def act(
        self,
        obs: np.ndarray,
        state: np.ndarray | None = None,
        first: np.ndarray | None = None,
        deterministic: bool = False,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        """Sample from pi (deterministic: tanh(mean)); `policy_action` is tanh(mean) either way.

        With `model.sde` the sample is tanh(mean + phi(s) @ theta) with each env's held
        theta (`state`), drawn afresh every `model.sde_sample_freq` steps (-1: every
        `algo.unroll_length`) as SB3 redraws it per rollout; the greedy action leaves
        the state as it is.
        """
        x = self.normalize(torch.as_tensor(obs, device=self.device))
        if deterministic:
            mode = torch.tanh(self.actor(x)[0])
            action, next_state = mode, state
        elif isinstance(self.actor, SDETanhGaussianActor):
            action, mode, next_state = self._sde_sample(x, state)
        else:
            (action, _, mode), next_state = self.actor.sample(x), None
        extras = {"policy_action": self.to_env(mode).cpu().numpy()}
        return self.to_env(action).cpu().numpy(), extras, next_state

    def _sde_sample(
        self, obs: Tensor, state: np.ndarray | None
    ) -> tuple[Tensor, Tensor, np.ndarray]:
        """tanh(mean + phi(s) @ theta) with each env's held theta, tanh(mean), and the
        held noise after this step."""
        actor = self.actor
        features = actor.features(obs)
        mean, _ = actor.head(features)
        held = self.acting_state(len(obs)) if state is None else state
        freq = self.model_cfg.sde_sample_freq
        theta, held_out = advance_held_noise(
            torch.as_tensor(held, device=self.device),
            (actor.in_dim, self.action_dim),
            self.cfg.unroll_length if freq == -1 else freq,
            actor.sample_exploration,
        )
        action = torch.tanh(mean + torch.bmm(features.unsqueeze(1), theta).squeeze(1))
        return action, torch.tanh(mean), held_out.cpu().numpy()

    @torch.no_grad()
    def target(
        self,
        reward: Tensor,
        next_obs: Tensor,
        discount: Tensor,
        eps: Tensor | None = None,
        *,
        mid_obs: Tensor | None = None,
        mid_discount: Tensor | None = None,
        mid_eps: Tensor | None = None,
    ) -> Tensor:
        """The soft n-step target, for a fold of m steps from s_t (eq. 3, 5 unrolled):

            y = R + sum_{k=1}^{m-1} gamma^k (-alpha log pi(a_k|s_{t+k}))
                  + discount * (min_i Q'_i(s', a') - alpha log pi(a'|s')),

        with R the folded reward, s' = s_{t+m}, and each a ~ pi freshly sampled, as RLx2's
        SAC (`RLx2_SAC/SAC.py`, `train`) adds `-alpha log_prob` at every state of the fold:
        the entropy bonus of the intermediate steps belongs to the soft return just as
        their rewards do. `mid_obs [B, n-1, ...]` and `mid_discount [B, n-1]` (gamma^k, 0
        past the fold) come from `ReplayBuffer.sample(intermediate=True)`; without them
        (1-step folds) the sum is empty. `eps` and `mid_eps` fix the noise (tests).
        """
        next_action, next_logp, _ = self.actor.sample(next_obs, eps)
        next_q = self.critic_target(next_obs, next_action).min(0).values
        y = reward + discount * (next_q - self.alpha * next_logp)
        if mid_obs is not None and mid_discount is not None and mid_discount.shape[1] > 0:
            flat_eps = None if mid_eps is None else mid_eps.flatten(0, 1)
            _, mid_logp, _ = self.actor.sample(mid_obs.flatten(0, 1), flat_eps)
            mid_logp = mid_logp.view_as(mid_discount)
            # where, not a product: an observation past the fold is whatever its slot holds.
            entropy = torch.where(mid_discount > 0, -mid_discount * mid_logp, 0.0)
            y = y + self.alpha * entropy.sum(1)
        return y

    def alpha_loss(self, logp: Tensor) -> Tensor:
        """J(alpha) = E[-alpha (log pi(a|s) + target_entropy)] (eq. 18, CleanRL's form)."""
        return -(self.log_alpha.exp() * (logp.detach() + self.target_entropy)).mean()

    def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        b = self.batch_tensors(batch)
        self.updates += 1
        y = self.target(
            b["reward"],
            b["next_obs"],
            b["discount"],
            mid_obs=b.get("mid_obs"),
            mid_discount=b.get("mid_discount"),
        )
        q = self.critic(b["obs"], b["action"])
        critic_loss = F.mse_loss(q, y.expand_as(q), reduction="none").mean(1).sum()
        self.gradient_step(self.optimizers["critic"], critic_loss)

        action, logp, _ = self.actor.sample(b["obs"])
        with frozen(self.critic):
            q_pi = self.critic(b["obs"], action).min(0).values
        actor_loss = (self.alpha * logp - q_pi).mean()
        self.gradient_step(self.optimizers["actor"], actor_loss)

        metrics: dict[str, float] = {}
        if self.cfg.learn_alpha:
            alpha_loss = self.alpha_loss(logp)
            self.gradient_step(self.optimizers["alpha"], alpha_loss)
            metrics["alpha_loss"] = alpha_loss.item()

        polyak(self.critic_target, self.critic, self.cfg.tau)
        self.after_target_update()
        return {
            "critic_loss": critic_loss.item(),
            "actor_loss": actor_loss.item(),
            **metrics,
            "alpha": self.alpha.item(),
            "entropy": -logp.mean().item(),
            "q_mean": q[0].mean().item(),
            "target_mean": y.mean().item(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "log_alpha": self.log_alpha.detach().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])


class _TanhMean(nn.Module):
    """SAC's deterministic action, tanh(mean), in tanh units."""

    def __init__(self, actor: SquashedGaussianActor) -> None:
        super().__init__()
        self.actor = actor

    def forward(self, obs: Tensor) -> Tensor:
        return torch.tanh(self.actor(obs)[0])
