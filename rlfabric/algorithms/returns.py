"""Return and advantage targets over time-major unrolls: n-step, TD(lambda), GAE, V-trace.

Pure torch, no Ray. Every function takes ``[T, B]`` tensors for an unroll of length
``T`` over ``B`` envs, with these meanings (see ARCHITECTURE.md, "Batch"):

- ``rewards[t]``: the reward that followed the action taken at ``x_t``.
- ``discounts[t]``: ``gamma * (1 - terminated[t]) * valid[t]``, built by the caller.
  A time-limit truncation keeps ``gamma``, so the step bootstraps from ``V(x_{t+1})``,
  the value of the final observation (unlike SEED RL, which refuses truncation).
- ``values[t]`` = ``V(x_t)``; ``bootstrap_value`` ``[B]`` = ``V(x_T)``.
- ``valid[t]`` (bool or 0/1 float, optional, default all valid): ``False`` for the
  step that gymnasium's NEXT_STEP autoreset spends on resetting the env after an
  episode ended (reward 0, action ignored). Such a step carries no learning signal,
  and a target that ran through it would mix the next episode's values into the
  previous one. So every function here cuts its recursion at an invalid step and
  sets the target there to ``V(x_t)`` (advantages to 0), whatever ``discounts[t]``
  holds. ``x_t`` at an invalid step is the final observation of the episode that
  just ended, so ``values[t]`` is exactly what a truncated step before it needs.

All targets are stop-gradient: the functions run under ``torch.no_grad()``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class VTraceReturns(NamedTuple):
    """V-trace targets, both ``[T, B]`` and stop-gradient."""

    vs: Tensor
    """Value targets ``v_s`` (IMPALA eq. 1)."""
    pg_advantages: Tensor
    """Policy-gradient advantages ``rho_s (r_s + gamma_s v_{s+1} - V(x_s))`` (IMPALA §4.2)."""
    pg_rhos: Tensor
    """Their importance weights ``min(pg_rho_bar, rho_s)``, 0 at invalid steps."""
    pg_advantages_unweighted: Tensor
    """The advantages before their weight, ``r_s + gamma_s v_{s+1} - V(x_s)`` (0 at
    invalid steps): what a caller rescales before weighting (PPO-style normalization)."""


def _check_shapes(rewards: Tensor, bootstrap_value: Tensor, **time_major: Tensor | None) -> None:
    """Reject shape mismatches that broadcasting would otherwise hide (``[T]`` vs ``[T, B]``)."""
    for name, tensor in time_major.items():
        if tensor is not None and tensor.shape != rewards.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, rewards {tuple(rewards.shape)}"
            )
    if bootstrap_value.shape != rewards.shape[1:]:
        raise ValueError(
            f"bootstrap_value must be [B] = {tuple(rewards.shape[1:])}, "
            f"got {tuple(bootstrap_value.shape)}"
        )


def _valid_mask(valid: Tensor | None, rewards: Tensor) -> Tensor:
    """Bool ``[T, B]`` mask; ``None`` means every step is valid."""
    if valid is None:
        return torch.ones_like(rewards, dtype=torch.bool)
    return valid.to(device=rewards.device, dtype=torch.bool)


def _clipped_ratio(rhos: Tensor, bar: float | None, valid: Tensor) -> Tensor:
    """``min(bar, rhos)`` (no clipping for ``bar=None``), forced to 0 at invalid steps.

    ``torch.where`` rather than a product, so that a meaningless log-ratio at an
    invalid step (``inf`` or ``nan`` from an ignored action) cannot leak through.
    """
    clipped = rhos if bar is None else torch.clamp(rhos, max=bar)
    return torch.where(valid, clipped, torch.zeros_like(clipped))


@torch.no_grad()
def vtrace(
    log_rhos: Tensor,
    discounts: Tensor,
    rewards: Tensor,
    values: Tensor,
    bootstrap_value: Tensor,
    valid: Tensor | None = None,
    rho_bar: float | None = 1.0,
    c_bar: float | None = 1.0,
    pg_rho_bar: float | None = 1.0,
    lambda_: float = 1.0,
) -> VTraceReturns:
    """V-trace targets and policy-gradient advantages (IMPALA, arXiv 1802.01561).

    Follows deepmind/scalable_agent ``vtrace.from_importance_weights``, with the
    Retrace-style ``lambda_`` of §4.1 applied to ``c`` as google-research/seed_rl
    ``common/vtrace.py`` does:

    - ``rho_t = min(rho_bar, exp(log_rho_t))`` and
      ``c_t = lambda_ * min(c_bar, exp(log_rho_t))``, where
      ``log_rho_t = log pi(a_t|x_t) - log mu(a_t|x_t)`` (eq. 1).
    - ``delta_t = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t))`` with ``V(x_T)`` the
      bootstrap value.
    - ``v_s - V(x_s) = delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1}))``, backwards from
      ``v_T - V(x_T) = 0``: the recursive form of eq. 1 (Remark 1), i.e.
      ``v_s = V(x_s) + sum_{t>=s} (prod_{s<=i<t} gamma_i c_i) delta_t``.
    - ``A_s = min(pg_rho_bar, exp(log_rho_s)) (r_s + gamma_s v_{s+1} - V(x_s))`` with
      ``v_T = V(x_T)`` (§4.2; ``v_{s+1}``, not ``V(x_{s+1})``, as the appendix
      finds the latter worse).

    ``rho_bar`` sets the fixed point (the value of ``pi_rho_bar ∝ min(rho_bar mu, pi)``);
    ``c_bar`` only the contraction speed. ``None`` disables a clip. At invalid steps
    ``rho_t``, ``c_t`` and the pg ratio are forced to 0, so ``vs = values`` and
    ``pg_advantages = 0`` there and nothing before them sees what comes after.

    Args:
        log_rhos: ``[T, B]`` log importance ratios ``log pi - log mu`` of the taken actions.
        discounts: ``[T, B]`` per-step discounts (module docstring).
        rewards: ``[T, B]`` rewards.
        values: ``[T, B]`` ``V(x_t)`` under the current value function.
        bootstrap_value: ``[B]`` ``V(x_T)``.
        valid: ``[T, B]`` bool or 0/1 mask, ``False`` at autoreset steps; ``None``: all valid.
        rho_bar: truncation level of ``rho_t`` (paper default 1).
        c_bar: truncation level of ``c_t`` (paper default 1).
        pg_rho_bar: truncation level of the ratio in the policy-gradient advantage.
        lambda_: trace-cutting factor on ``c_t`` (1 recovers eq. 1; on-policy, TD(lambda)).

    Returns:
        ``VTraceReturns``: ``vs`` and ``pg_advantages``, with the latter's weights
        ``pg_rhos`` and unweighted advantages beside it, all ``[T, B]``.
    """
    _check_shapes(
        rewards, bootstrap_value, log_rhos=log_rhos, discounts=discounts, values=values, valid=valid
    )
    valid_mask = _valid_mask(valid, rewards)
    rhos = torch.exp(log_rhos)
    clipped_rhos = _clipped_ratio(rhos, rho_bar, valid_mask)
    cs = lambda_ * _clipped_ratio(rhos, c_bar, valid_mask)
    clipped_pg_rhos = _clipped_ratio(rhos, pg_rho_bar, valid_mask)

    values_tp1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)])
    deltas = clipped_rhos * (rewards + discounts * values_tp1 - values)

    vs_minus_values = torch.empty_like(values)
    acc = torch.zeros_like(bootstrap_value)
    for t in reversed(range(rewards.shape[0])):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_values[t] = acc
    vs = values + vs_minus_values

    vs_tp1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)])
    unweighted = torch.where(valid_mask, rewards + discounts * vs_tp1 - values, 0.0)
    return VTraceReturns(
        vs=vs,
        pg_advantages=clipped_pg_rhos * unweighted,
        pg_rhos=clipped_pg_rhos,
        pg_advantages_unweighted=unweighted,
    )


@torch.no_grad()
def discounted_returns(
    rewards: Tensor,
    discounts: Tensor,
    bootstrap_value: Tensor,
    values: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """Bootstrapped n-step returns ``G_t = r_t + gamma_t G_{t+1}``, ``G_T = V(x_T)``.

    The n-step Bellman target that A3C/GA3C train on (each step bootstraps from the
    end of its unroll), and the IMPALA test oracle: on-policy V-trace with
    ``c_bar >= 1`` and ``lambda_ = 1`` equals it.

    At an invalid (autoreset) step the return restarts from ``G_t = V(x_t)``, the
    value of the final observation of the episode that just ended, so a truncated
    step before it bootstraps from that value; ``values`` is needed for that and
    only for that.

    Args:
        rewards: ``[T, B]`` rewards.
        discounts: ``[T, B]`` per-step discounts (module docstring).
        bootstrap_value: ``[B]`` ``V(x_T)``.
        values: ``[T, B]`` ``V(x_t)``; required when ``valid`` is given.
        valid: ``[T, B]`` bool or 0/1 mask, ``False`` at autoreset steps; ``None``: all valid.

    Returns:
        ``[T, B]`` returns.
    """
    _check_shapes(rewards, bootstrap_value, discounts=discounts, values=values, valid=valid)
    if valid is not None and values is None:
        raise ValueError("discounted_returns needs values to restart at invalid steps")
    valid_mask = _valid_mask(valid, rewards)
    returns = torch.empty_like(rewards)
    acc = bootstrap_value
    for t in reversed(range(rewards.shape[0])):
        acc = rewards[t] + discounts[t] * acc
        if values is not None:
            acc = torch.where(valid_mask[t], acc, values[t])
        returns[t] = acc
    return returns


@torch.no_grad()
def lambda_returns(
    rewards: Tensor,
    discounts: Tensor,
    values: Tensor,
    bootstrap_value: Tensor,
    lambda_: float,
    valid: Tensor | None = None,
) -> Tensor:
    """TD(lambda) returns ``G_t = r_t + gamma_t ((1 - lambda) V(x_{t+1}) + lambda G_{t+1})``.

    The lambda-return of Sutton & Barto (2nd ed., ch. 12) in its recursive form, with
    per-step discounts and ``G_T = V(x_T)``. ``lambda_ = 1`` gives
    :func:`discounted_returns`, ``lambda_ = 0`` the one-step TD target; it equals
    ``gae(...) + values`` and on-policy V-trace with ``c_bar >= 1``.

    At an invalid (autoreset) step ``G_t = V(x_t)``: the recursion restarts from the
    value of the final observation, so a truncated step before it bootstraps from it.

    Args:
        rewards: ``[T, B]`` rewards.
        discounts: ``[T, B]`` per-step discounts (module docstring).
        values: ``[T, B]`` ``V(x_t)``.
        bootstrap_value: ``[B]`` ``V(x_T)``.
        lambda_: mixing factor in ``[0, 1]``.
        valid: ``[T, B]`` bool or 0/1 mask, ``False`` at autoreset steps; ``None``: all valid.

    Returns:
        ``[T, B]`` returns.
    """
    _check_shapes(rewards, bootstrap_value, discounts=discounts, values=values, valid=valid)
    valid_mask = _valid_mask(valid, rewards)
    values_tp1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)])
    returns = torch.empty_like(rewards)
    acc = bootstrap_value
    for t in reversed(range(rewards.shape[0])):
        acc = rewards[t] + discounts[t] * ((1.0 - lambda_) * values_tp1[t] + lambda_ * acc)
        acc = torch.where(valid_mask[t], acc, values[t])
        returns[t] = acc
    return returns


@torch.no_grad()
def gae(
    rewards: Tensor,
    discounts: Tensor,
    values: Tensor,
    bootstrap_value: Tensor,
    lambda_: float,
    valid: Tensor | None = None,
) -> Tensor:
    """Generalized advantage estimation (Schulman et al. 2015, arXiv 1506.02438, eq. 16).

    ``A_t = delta_t + gamma_t lambda A_{t+1}`` with the TD error
    ``delta_t = r_t + gamma_t V(x_{t+1}) - V(x_t)`` and ``A_T = 0``; per-step discounts
    replace the paper's constant ``gamma`` so terminations cut the sum. At invalid
    (autoreset) steps ``A_t = 0`` and the recursion restarts, so ``gae + values``
    equals :func:`lambda_returns` at every step.

    Args:
        rewards: ``[T, B]`` rewards.
        discounts: ``[T, B]`` per-step discounts (module docstring).
        values: ``[T, B]`` ``V(x_t)``.
        bootstrap_value: ``[B]`` ``V(x_T)``.
        lambda_: GAE ``lambda`` in ``[0, 1]``.
        valid: ``[T, B]`` bool or 0/1 mask, ``False`` at autoreset steps; ``None``: all valid.

    Returns:
        ``[T, B]`` advantages.
    """
    _check_shapes(rewards, bootstrap_value, discounts=discounts, values=values, valid=valid)
    valid_mask = _valid_mask(valid, rewards)
    values_tp1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)])
    deltas = rewards + discounts * values_tp1 - values
    advantages = torch.empty_like(rewards)
    acc = torch.zeros_like(bootstrap_value)
    for t in reversed(range(rewards.shape[0])):
        acc = deltas[t] + discounts[t] * lambda_ * acc
        acc = torch.where(valid_mask[t], acc, torch.zeros_like(acc))
        advantages[t] = acc
    return advantages
