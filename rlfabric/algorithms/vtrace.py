"""IMPALA's actor-critic with V-trace off-policy correction.

Espeholt et al. 2018, "IMPALA" (arXiv 1802.01561), and deepmind/scalable_agent
`experiment.py`. Defaults are the paper's Atari settings (Table G.1):
unroll 20, batch 32, gamma 0.99, baseline cost 0.5, entropy cost 0.01,
RMSProp lr 6e-4 (eps 0.01, decay 0.99, momentum 0) as TF1 computes it
(`rmsprop_tf`: eps inside the square root, mean square from 1; torch's
RMSprop with the same eps steps up to 10x further), global grad-norm clip 40,
lr annealed linearly to 0. rho_bar = c_bar = 1 ("rho_bar = 1 worked best").
Off by default, three APPO options (Luo et al. 2020, "IMPACT"; RLlib's APPO): `epochs`
passes over each batch, `num_minibatches` gradient steps per pass (each on a random
share of the batch's steps, its V-trace targets computed over the whole unrolls at the
start of the pass, or once per batch with `recompute_targets: false`), and `pg_clip`,
PPO's clipped surrogate in place of the truncated weight.

Time alignment (scalable_agent): `obs[t]` is what `action[t]` was taken in;
`reward[t]`, `terminated[t]` and `truncated[t]` are what followed it; the last
observation `obs[T]` only bootstraps. gamma_t = gamma * (1 - terminated_t), so
a truncated episode bootstraps from V(obs[t+1]), the final observation, which
NEXT_STEP autoreset keeps in the unroll. The step after a done only resets
the env; `is_first[t+1]` marks it and it is masked out of every loss term
(the shared plumbing is in `trajectory.py`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor

from rlfabric.algorithms.ppo import clipped_policy_loss, minibatch_indices, take
from rlfabric.algorithms.returns import vtrace
from rlfabric.algorithms.trajectory import (
    ActorCriticAlgorithm,
    ActorCriticConfig,
    evaluate,
    minibatch_layout,
    normalize,
    score_minibatch,
    unroll_steps,
)


class VTraceConfig(ActorCriticConfig):
    name: Literal["vtrace"] = Field("vtrace", description="registered algorithm name")
    optimizer: Literal["rmsprop", "rmsprop_tf", "adam"] = Field(
        "rmsprop_tf",
        description="optimizer (IMPALA: TF1's RMSProp, rmsprop_tf; rmsprop is torch's, adam)",
    )
    eps: float = Field(0.01, gt=0, description="optimizer epsilon (IMPALA: 0.01, TF's convention)")
    grad_clip: float | None = Field(40.0, gt=0, description="global grad-norm clip; null: none")
    baseline_cost: float = Field(0.5, ge=0, description="weight of the value loss")
    rho_bar: float = Field(1.0, gt=0, description="truncation of the importance weight rho")
    c_bar: float = Field(1.0, gt=0, description="truncation of the trace coefficient c")
    pg_rho_bar: float = Field(1.0, gt=0, description="truncation of rho in the pg advantage")
    lambda_: float = Field(1.0, ge=0, le=1, alias="lambda", description="trace decay lambda")
    reward_clip: float | None = Field(
        None, gt=0, description="clip rewards to [-x, x] (IMPALA Atari: 1); null: no clipping"
    )
    normalize_advantages: bool = Field(
        False,
        description="normalise the pg advantages over each minibatch's valid steps (mean 0, "
        "std 1; the whole batch when num_minibatches is 1) "
        "before their importance weight, as PPO does before its ratio; IMPALA does not. "
        "Weighs entropy_cost against a unit-scale advantage instead of the reward scale",
    )
    loss_reduction: Literal["sum", "mean"] = Field(
        "sum",
        description="'sum' over T*B as scalable_agent (lr 6e-4 assumes it) or 'mean' as SEED RL",
    )
    pg_clip: float | None = Field(
        None,
        gt=0,
        description="clip the ratio pi/mu at 1 +- pg_clip in PPO's surrogate on the V-trace "
        "advantage, as APPO (IMPACT, Luo et al. 2020; RLlib's APPO: 0.4); null: IMPALA's "
        "policy gradient",
    )
    pg_clip_target: bool = Field(
        False,
        description="with pg_clip: clip pi/pi_t, pi_t the policy the V-trace targets were "
        "computed under (at the start of the batch's update, or of the pass with "
        "recompute_targets), each step's advantage weighted by min(pg_rho_bar, pi_t/mu) "
        "(IMPACT's target network; RLlib's APPO). False: clip pi/mu, so the steps of a batch "
        "acted several updates ago start their first pass partly clipped",
    )
    epochs: int = Field(
        1,
        ge=1,
        description="gradient steps on each batch, each with its targets recomputed by the "
        "current network; V-trace corrects for the policy moving from mu (IMPALA: 1; "
        "RLlib's APPO on Atari reuses each batch twice)",
    )
    num_minibatches: int = Field(
        1,
        ge=1,
        description="gradient steps per pass: random steps of the batch, or with model.lstm "
        "random whole unrolls, each V-trace target computed over the whole unroll at the "
        "start of the pass (IMPALA: 1, the whole batch; RLlib's APPO: minibatch_size)",
    )
    recompute_targets: bool = Field(
        True,
        description="with epochs > 1: recompute the V-trace targets and advantages with the "
        "current network at the start of each pass (true), or compute them once per batch "
        "before its first step, as PPO computes GAE (false). Recomputed, a later pass's "
        "advantages are measured against a V already fit to this batch's targets",
    )

    model_config = ActorCriticConfig.model_config | {"populate_by_name": True}

    @model_validator(mode="after")
    def _target_clip_can_bind(self) -> VTraceConfig:
        """pi_t is the policy the targets were computed under: the clip binds only on the
        steps after the first that shares those targets."""
        if not self.pg_clip_target:
            return self
        if self.pg_clip is None:
            raise ValueError("pg_clip_target=true needs pg_clip (the clip it moves), got null")
        once = not self.recompute_targets and self.epochs > 1
        if self.num_minibatches * (self.epochs if once else 1) == 1:
            raise ValueError(
                "pg_clip_target=true with one gradient step per computation of the targets "
                f"(num_minibatches=1, epochs={self.epochs}, recompute_targets="
                f"{str(self.recompute_targets).lower()}) clips against the policy being "
                "stepped, so the clip never binds: set num_minibatches > 1, or epochs > 1 "
                "with recompute_targets=false"
            )
        return self


class VTrace(ActorCriticAlgorithm):
    """Actor-critic whose targets and advantages are V-trace corrected."""

    config_cls = VTraceConfig
    cfg: VTraceConfig

    @property
    def loss_reduction(self) -> Literal["sum", "mean"]:
        return self.cfg.loss_reduction

    def optimizer_steps_per_update(self) -> int:
        """One gradient step per minibatch per pass over the batch."""
        return self.cfg.epochs * self.cfg.num_minibatches

    def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """`epochs` passes of `num_minibatches` gradient steps; the metrics are their means."""
        cfg = self.cfg
        b = self.batch_tensors(batch)
        once = not cfg.recompute_targets and cfg.epochs > 1
        fixed = self._start_targets(b) if once else None
        totals: dict[str, float] = defaultdict(float)
        steps = 0
        for _ in range(cfg.epochs):
            if fixed is None and cfg.num_minibatches == 1:
                passes = [self._step(b)]
            else:
                passes = self._pass(b, fixed)
            for metrics in passes:
                for key, value in metrics.items():
                    totals[key] += value
                steps += 1
        return {key: total / steps for key, total in totals.items()}

    def _targets(self, b: dict[str, Tensor], logp: Tensor, values: Tensor) -> dict[str, Tensor]:
        """V-trace targets of the whole unrolls under the current pi (`logp`) and V (`values`).

        On a second pass the batch is further off-policy (pi has moved since mu acted
        and since the last pass); the targets are recomputed with the current pi and V,
        so the importance weights see that move.
        """
        cfg = self.cfg
        valid, rewards, discounts = unroll_steps(b, cfg.gamma, cfg.reward_clip)
        targets = vtrace(
            log_rhos=logp.detach() - b["logp"],
            discounts=discounts,
            rewards=rewards,
            values=values[:-1].detach(),
            bootstrap_value=values[-1].detach(),
            valid=valid,
            rho_bar=cfg.rho_bar,
            c_bar=cfg.c_bar,
            pg_rho_bar=cfg.pg_rho_bar,
            lambda_=cfg.lambda_,
        )
        return {
            "valid": valid,
            "vs": targets.vs,
            "advantages": targets.pg_advantages_unweighted,
            "pg_rhos": targets.pg_rhos,
            "target_logp": logp.detach(),
        }

    def _step(self, b: dict[str, Tensor]) -> dict[str, float]:
        """One gradient step on the whole batch: one forward pass gives the targets
        (detached) and the loss."""
        logp, entropy, values = evaluate(self.model, b)
        targets = self._targets(b, logp, values)
        return self._loss_step(logp, entropy, values[:-1], b["logp"], targets)

    def _start_targets(self, b: dict[str, Tensor]) -> dict[str, Tensor]:
        """The targets of the whole unrolls under the network as it is now, from a forward
        pass without gradient."""
        with torch.no_grad():
            logp, _, values = evaluate(self.model, b)
        return self._targets(b, logp, values)

    def _pass(
        self, b: dict[str, Tensor], targets: dict[str, Tensor] | None
    ) -> list[dict[str, float]]:
        """One pass of `num_minibatches` gradient steps, as PPO's (`ppo.py`): random flat
        steps for a feed-forward model, random whole unrolls for a recurrent one, whose
        core must start from each unroll's stored state. The targets need whole unrolls,
        so they come first: the batch's own (`targets`), or else this pass's."""
        if targets is None:
            targets = self._start_targets(b)
        data, axis = minibatch_layout(self.model, b, targets)
        metrics = []
        valid = data["valid"]
        for index in minibatch_indices(valid.shape[axis], self.cfg.num_minibatches, valid.device):
            mb = take(data, axis, index)
            logp, entropy, values = score_minibatch(self.model, mb)
            metrics.append(self._loss_step(logp, entropy, values, mb["logp"], mb))
        return metrics

    def _loss_step(
        self,
        logp: Tensor,
        entropy: Tensor,
        values: Tensor,
        behaviour_logp: Tensor,
        targets: dict[str, Tensor],
    ) -> dict[str, float]:
        """The IMPALA loss (or APPO's, with `pg_clip`) on steps scored with gradient, and
        one gradient step. `targets` holds each step's `valid`, `vs`, unweighted
        `advantages`, `pg_rhos` and the `target_logp` they were computed with, all without
        gradient."""
        cfg = self.cfg
        valid = targets["valid"]
        # IMPALA loss (scalable_agent experiment.py): each term summed over the steps.
        n_valid = valid.sum().clamp(min=1.0)
        advantages = targets["advantages"]
        if cfg.normalize_advantages:
            # Normalise the advantages, then weight them, as PPO's ratio multiplies a
            # normalised advantage. Centring the weighted product instead turns a batch of
            # equal positive advantages into positive ones where the truncated ratio is
            # high (the actions pi has made likelier since mu acted) and negative ones
            # elsewhere: each update pushes pi further from mu, and a lagged batch's
            # policy collapses.
            advantages = normalize(advantages, valid)
        # Zeroed at masked steps, whose behaviour logp may be anything.
        log_ratio = torch.where(valid > 0, logp - behaviour_logp, 0.0)
        metrics: dict[str, float] = {}
        if cfg.pg_clip is not None:
            # APPO (IMPACT): PPO's clipped surrogate on the V-trace advantage, its ratio
            # pi / mu in place of the truncated importance weight: a step whose ratio is
            # already past 1 +- pg_clip in its advantage's direction gives no gradient,
            # which bounds how far repeated passes (`epochs`) push pi from mu.
            clip_log_ratio = log_ratio
            if cfg.pg_clip_target:
                # IMPACT: the trust region is centred on pi_t, the policy the targets
                # were computed under, not on a mu several updates old; the truncated
                # weight pi_t / mu corrects the advantage for the lag. With no lag
                # (pi_t = mu) this is the clip on pi/mu.
                clip_log_ratio = torch.where(valid > 0, logp - targets["target_logp"], 0.0)
                advantages = targets["pg_rhos"] * advantages
            pg_loss = clipped_policy_loss(clip_log_ratio, advantages, cfg.pg_clip, valid) * n_valid
            # PPO's figure: the share of steps whose ratio lies outside the clip.
            outside = (clip_log_ratio.detach().exp() - 1.0).abs() > cfg.pg_clip
            metrics["clip_fraction"] = (outside * valid).sum().item() / n_valid.item()
        else:
            pg_loss = -(logp * targets["pg_rhos"] * advantages * valid).sum()
        baseline_loss = 0.5 * ((targets["vs"] - values) ** 2 * valid).sum()
        entropy_sum = (entropy * valid).sum()
        loss = pg_loss + cfg.baseline_cost * baseline_loss - self.entropy_cost * entropy_sum
        if cfg.loss_reduction == "mean":
            loss = loss / n_valid

        grad_norm = self.gradient_step(loss)
        # The ratios min(rho_bar, pi/mu), clipped in log space: exp of a large log-ratio
        # is inf.
        rhos = torch.where(
            valid > 0, log_ratio.detach().clamp(max=math.log(cfg.rho_bar)).exp(), 0.0
        )
        return {
            "loss": loss.item(),
            "pg_loss": pg_loss.item() / n_valid.item(),
            "baseline_loss": baseline_loss.item() / n_valid.item(),
            "entropy": entropy_sum.item() / n_valid.item(),
            "entropy_cost": self.entropy_cost,
            "grad_norm": grad_norm.item(),
            "rho_mean": rhos.sum().item() / n_valid.item(),
            **metrics,
        }
