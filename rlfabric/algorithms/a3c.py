"""A3C's n-step advantage actor-critic, as GA3C trains it.

Mnih et al. 2016, "Asynchronous Methods for Deep RL" (arXiv 1602.01783,
Algorithm S3), and its GPU variant GA3C: Babaeizadeh et al. 2017 (arXiv
1611.06256) with NVlabs/GA3C `NetworkVP.py` for the loss and `Config.py` for
the defaults:

    L = -sum_t [log max(pi(a_t|x_t), eps) (R_t - sg(V(x_t))) + beta H(pi(.|x_t))]
        + 1/2 sum_t (R_t - V(x_t))^2

summed over the batch, with one RMSProp (TF1's) on the total. R_t is the n-step
bootstrapped return over the unroll, R_t = r_t + gamma_t R_{t+1} and
R_T = V(x_T): the unroll length T plays GA3C's t_max, so step t looks T - t
steps ahead, as in A3C's backward loop over its t_max segment.

Where this differs from GA3C's agents, and why:

- Returns are computed by the learner with the current network's values (as
  IMPALA's learner does), not by the agent with the predictor's values at
  acting time: under SEED the acting-time value of x_T does not exist
  consistently, and the learner's value is the fresher one.
- A truncated episode bootstraps from V of its final observation (GA3C only
  knows terminals, V = 0); autoreset steps are masked out (trajectory.py).
- log max(pi, eps) applies to discrete actions, where pi(a|x) is a probability.
  For continuous (Gaussian) actions pi is a density with no natural floor, so
  its log-prob is used directly.
- The entropy is the distribution's exact entropy; GA3C floors p inside its
  log too, which only matters for probabilities under eps.
"""

from __future__ import annotations

import math
from typing import Literal

import gymnasium as gym
import numpy as np
from pydantic import Field

from rlfabric.algorithms.returns import discounted_returns
from rlfabric.algorithms.trajectory import (
    ActorCriticAlgorithm,
    ActorCriticConfig,
    evaluate,
    normalize,
    unroll_steps,
)


class A3CConfig(ActorCriticConfig):
    """Defaults are NVlabs/GA3C `Config.py` unless a description says otherwise."""

    name: Literal["a3c"] = Field("a3c", description="registered algorithm name")
    unroll_length: int = Field(5, ge=1, description="agent steps per unroll: GA3C's t_max (5)")
    batch_size: int = Field(
        8,
        ge=1,
        description="unrolls per learner batch: 8 x t_max 5 = 40 samples, the top of the "
        "20-40 the GA3C maintainers recommend for TRAINING_MIN_BATCH_SIZE (NVlabs/GA3C#22)",
    )
    lr: float = Field(3e-4, gt=0, description="learning rate (GA3C: 3e-4)")
    lr_schedule: Literal["constant", "linear"] = Field(
        "constant",
        description="GA3C keeps lr constant (LEARNING_RATE_START = _END); 'linear' anneals it "
        "to 0 over run.stop.env_frames (5M when run.stop names nothing; constant without one)",
    )
    optimizer: Literal["rmsprop", "rmsprop_tf", "adam"] = Field(
        "rmsprop_tf",
        description="optimizer (GA3C: one shared TF1 RMSProp, rmsprop_tf; rmsprop is torch's)",
    )
    eps: float = Field(
        0.1, gt=0, description="optimizer epsilon (GA3C RMSPROP_EPSILON: 0.1, TF's convention)"
    )
    reward_clip: float | None = Field(
        None,
        gt=0,
        description="clip rewards to [-x, x]; GA3C clips to [-1, 1] (REWARD_MIN/MAX) for Atari; "
        "null: no clipping",
    )
    entropy_cost: float = Field(0.01, ge=0, description="entropy bonus beta (GA3C: 0.01)")
    baseline_cost: float = Field(
        1.0, ge=0, description="weight of 1/2 sum (R - V)^2 (GA3C adds it with weight 1)"
    )
    loss_reduction: Literal["sum", "mean"] = Field(
        "sum",
        description="'sum' over the batch as GA3C (its lr 3e-4 assumes it) or 'mean' as "
        "OpenAI baselines' A2C (lr 7e-4, grad clip 0.5)",
    )
    normalize_advantages: bool = Field(
        False,
        description="normalise the pg advantages over each batch's valid steps (mean 0, std 1) "
        "as PPO does per minibatch; GA3C and A2C do not. Weighs entropy_cost against a "
        "unit-scale advantage instead of the reward scale",
    )
    log_epsilon: float = Field(
        1e-6,
        gt=0,
        lt=1,
        description="floor eps in log max(pi(a|x), eps), discrete actions only (GA3C: 1e-6)",
    )


class A3C(ActorCriticAlgorithm):
    """n-step advantage actor-critic with GA3C's loss."""

    config_cls = A3CConfig
    cfg: A3CConfig

    @property
    def loss_reduction(self) -> Literal["sum", "mean"]:
        return self.cfg.loss_reduction

    def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        cfg = self.cfg
        b = self.batch_tensors(batch)
        logp, entropy, values = evaluate(self.model, b)
        valid, rewards, discounts = unroll_steps(b, cfg.gamma, cfg.reward_clip)
        returns = discounted_returns(
            rewards,
            discounts,
            bootstrap_value=values[-1].detach(),
            values=values[:-1].detach(),
            valid=valid,
        )
        advantages = returns - values[:-1].detach()
        pg_advantages = normalize(advantages, valid) if cfg.normalize_advantages else advantages
        if isinstance(self.action_space, gym.spaces.Discrete):
            # log max(p, eps) == max(log p, log eps), gradient included (zero below eps).
            logp = logp.clamp(min=math.log(cfg.log_epsilon))

        # GA3C NetworkVP.py: cost_p and cost_v summed over the batch, then added.
        pg_loss = -(logp * pg_advantages * valid).sum()
        baseline_loss = 0.5 * ((returns - values[:-1]) ** 2 * valid).sum()
        entropy_sum = (entropy * valid).sum()
        loss = pg_loss + cfg.baseline_cost * baseline_loss - self.entropy_cost * entropy_sum
        n_valid = valid.sum().clamp(min=1.0).item()
        if cfg.loss_reduction == "mean":
            loss = loss / n_valid

        grad_norm = self.gradient_step(loss)
        return {
            "loss": loss.item(),
            "pg_loss": pg_loss.item() / n_valid,
            "baseline_loss": baseline_loss.item() / n_valid,
            "entropy": entropy_sum.item() / n_valid,
            "entropy_cost": self.entropy_cost,
            "grad_norm": grad_norm.item(),
            "advantage_mean": (advantages * valid).sum().item() / n_valid,
        }
