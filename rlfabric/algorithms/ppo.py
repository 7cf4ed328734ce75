"""Clipped PPO with GAE.

Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv
1707.06347, eq. 7 and 9), with the implementation details of CleanRL
`ppo.py` (Huang et al. 2022, "The 37 Implementation Details of PPO"), whose
classic-control defaults these are: unroll 128 x 4 envs, 4 epochs of 4
minibatches, GAE lambda 0.95, advantages normalised per minibatch, clip 0.2 on
the ratio and on the value change, value cost 0.5, entropy cost 0.01, global
grad-norm clip 0.5, Adam lr 2.5e-4 (eps 1e-5) annealed linearly to 0.

For each batch of B unrolls of T steps, and then `epochs` times: shuffle the
T x B steps and split them into `num_minibatches` minibatches (CleanRL `ppo.py`
shuffles flat transitions), or with an LSTM core shuffle the B columns and
split those (as CleanRL `ppo_atari_lstm.py` splits envs), so that the core
sees whole unrolls from their stored first state; take one gradient step per
minibatch on

    L = -min(r A, clip(r, 1 - e, 1 + e) A) + c_v L_V - c_H H,   r = pi(a|x) / mu(a|x)

averaged over the valid steps of the minibatch.

Two choices for asynchronous architectures (SEED, IMPALA, GA3C), where the
batch may come from a policy that lags the learner:

- The ratio is taken against mu, the behaviour policy that acted: the batch's
  `logp`, exactly as CleanRL does on-policy. A lagging batch therefore starts
  with ratios away from 1, and the clip bounds how far the update moves from
  the policy that produced the data.
- GAE and the clipped value loss use V recomputed by the current network once
  at the start of the update, not acting-time values as CleanRL: under SEED
  the acting-time value of the bootstrap observation belongs to whichever
  policy was live then, so acting-time values are not one consistent function.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from rlfabric.algorithms.returns import gae
from rlfabric.algorithms.trajectory import (
    ActorCriticAlgorithm,
    ActorCriticConfig,
    forward,
    masked_mean,
    minibatch_layout,
    normalize,
    score_minibatch,
    unroll_steps,
)
from rlfabric.observations import obs_map


class PPOConfig(ActorCriticConfig):
    """Defaults are CleanRL `ppo.py` (classic control) unless a description says otherwise."""

    name: Literal["ppo"] = Field("ppo", description="registered algorithm name")
    unroll_length: int = Field(128, ge=1, description="agent steps per unroll (num_steps)")
    batch_size: int = Field(4, ge=1, description="unrolls per learner batch (num_envs)")
    lr: float = Field(2.5e-4, gt=0, description="learning rate")
    grad_clip: float | None = Field(0.5, gt=0, description="global grad-norm clip; null: none")
    epochs: int = Field(4, ge=1, description="passes over each batch (update_epochs)")
    num_minibatches: int = Field(
        4,
        ge=1,
        description="minibatches per epoch: random steps, or with model.lstm random whole unrolls",
    )
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    clip_coef: float = Field(0.2, gt=0, description="ratio clip e (and value clip)")
    clip_value_loss: bool = Field(True, description="clip the value change to +-clip_coef")
    normalize_advantages: bool = Field(True, description="normalise advantages per minibatch")
    value_cost: float = Field(0.5, ge=0, description="weight of the value loss (vf_coef)")


def take(data: dict[str, Any], axis: int, index: Tensor) -> dict[str, Any]:
    """The minibatch of `data` at `index` along `axis` (each entry of dict observations)."""
    return {k: obs_map(lambda x: x.index_select(axis, index), v) for k, v in data.items()}


def minibatch_indices(size: int, num_minibatches: int, device: torch.device) -> list[Tensor]:
    """A random split of `range(size)` (steps or columns) into near-equal groups: each once.

    Made on the batch's `device`: `index_select` on a CUDA tensor refuses a CPU index."""
    return list(torch.randperm(size, device=device).tensor_split(num_minibatches))


def clipped_policy_loss(
    log_ratio: Tensor, advantages: Tensor, clip_coef: float, valid: Tensor
) -> Tensor:
    """-min(r A, clip(r, 1 - e, 1 + e) A) averaged over valid steps (PPO eq. 7).

    Where r > 1 + e with A > 0, or r < 1 - e with A < 0, the clipped term wins
    and the step gives no gradient.
    """
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef)
    return masked_mean(torch.max(unclipped, clipped), valid)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, clip_coef: float | None, valid: Tensor
) -> Tensor:
    """1/2 (V - R)^2, or with a clip the max of it and 1/2 (V_old + clip(V - V_old) - R)^2.

    The clipped form is CleanRL's `clip_vloss` (from openai/baselines ppo2);
    `clip_coef=None` gives the plain squared error.
    """
    loss = (values - returns) ** 2
    if clip_coef is not None:
        clipped = old_values + (values - old_values).clamp(-clip_coef, clip_coef)
        loss = torch.max(loss, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, valid)


class PPO(ActorCriticAlgorithm):
    """Clipped surrogate objective over several epochs of minibatches per batch."""

    config_cls = PPOConfig
    cfg: PPOConfig

    def optimizer_steps_per_update(self) -> int:
        """One gradient step per minibatch per epoch."""
        return self.cfg.epochs * self.cfg.num_minibatches

    def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        cfg = self.cfg
        b = self.batch_tensors(batch)
        valid, rewards, discounts = unroll_steps(b, cfg.gamma, cfg.reward_clip)
        with torch.no_grad():
            _, values = forward(self.model, b)
        advantages = gae(rewards, discounts, values[:-1], values[-1], cfg.gae_lambda, valid)
        targets = {
            "valid": valid,
            "old_values": values[:-1],
            "advantages": advantages,
            "returns": advantages + values[:-1],
        }

        data, axis = minibatch_layout(self.model, b, targets)
        size = data["valid"].shape[axis]

        totals: dict[str, float] = defaultdict(float)
        steps_taken = 0
        for _ in range(cfg.epochs):
            for index in minibatch_indices(size, cfg.num_minibatches, data["valid"].device):
                minibatch = take(data, axis, index)
                for key, value in self._minibatch_step(minibatch).items():
                    totals[key] += value
                steps_taken += 1
        return {key: total / steps_taken for key, total in totals.items()}

    def _minibatch_step(self, mb: dict[str, Tensor]) -> dict[str, float]:
        """One gradient step on a minibatch (flat steps or whole unrolls) with its targets."""
        cfg = self.cfg
        valid = mb["valid"]
        logp, entropy, values = score_minibatch(self.model, mb)
        advantages = mb["advantages"]
        if cfg.normalize_advantages:
            advantages = normalize(advantages, valid)
        # Zeroed at masked steps, whose behaviour logp may be anything.
        log_ratio = torch.where(valid > 0, logp - mb["logp"], 0.0)
        pg_loss = clipped_policy_loss(log_ratio, advantages, cfg.clip_coef, valid)
        value_clip = cfg.clip_coef if cfg.clip_value_loss else None
        baseline_loss = value_loss(values, mb["old_values"], mb["returns"], value_clip, valid)
        mean_entropy = masked_mean(entropy, valid)
        loss = pg_loss + cfg.value_cost * baseline_loss - self.entropy_cost * mean_entropy
        grad_norm = self.gradient_step(loss)

        with torch.no_grad():
            ratio = log_ratio.exp()
            # KL(mu || pi) by the low-variance estimator (r - 1) - log r, as CleanRL.
            approx_kl = masked_mean((ratio - 1.0) - log_ratio, valid)
            clip_fraction = masked_mean(((ratio - 1.0).abs() > cfg.clip_coef).float(), valid)
        return {
            "loss": loss.item(),
            "pg_loss": pg_loss.item(),
            "baseline_loss": baseline_loss.item(),
            "entropy": mean_entropy.item(),
            "entropy_cost": self.entropy_cost,
            "grad_norm": grad_norm.item(),
            "approx_kl": approx_kl.item(),
            "clip_fraction": clip_fraction.item(),
        }
