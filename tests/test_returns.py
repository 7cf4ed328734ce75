"""Return and advantage targets against slow reference loops written from the papers.

The references are forward sums, not the backward recursions that
``rlfabric.algorithms.returns`` uses, so agreement checks the recursions too:
V-trace against IMPALA eq. 1 with the products of deepmind/scalable_agent
``vtrace_test.py`` (``prod(discounts[s:t]) * prod(cs[s:t])``), n-step returns as
explicit discounted sums, and lambda-returns as the mixture of n-step returns.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlfabric.algorithms.returns import (
    VTraceReturns,
    discounted_returns,
    gae,
    lambda_returns,
    vtrace,
)

GAMMA = 0.9
SHAPES = [(t, b) for t in (1, 5, 20) for b in (1, 3, 8)]
# (rho_bar, c_bar, pg_rho_bar, lambda_)
CLIPS = {
    "paper": (1.0, 1.0, 1.0, 1.0),
    "mixed": (1.5, 0.8, 2.0, 0.9),
    "unclipped": (None, None, None, 1.0),
}
RTOL, ATOL = 1e-6, 1e-9


def make_unroll(seed: int, T: int, B: int) -> dict[str, np.ndarray]:
    """Random float64 unroll with terminations, truncations and autoreset steps.

    Under gymnasium's NEXT_STEP autoreset the step after any episode end is
    invalid: reward 0, discount 0, action ignored. Its ``values`` entry is the
    value of the final observation, which a truncated step before it bootstraps
    from. Its log-ratio is garbage (the ignored action), here a huge number.
    """
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(T, B))
    values = rng.normal(size=(T, B))
    discounts = np.full((T, B), GAMMA)
    valid = np.ones((T, B), dtype=bool)
    log_rhos = rng.normal(size=(T, B))
    episode_ended = rng.random(B) < 0.2  # the previous unroll may have ended an episode
    for t in range(T):
        u = rng.random(B)
        terminated = ~episode_ended & (u < 0.15)
        truncated = ~episode_ended & (u >= 0.15) & (u < 0.25)
        valid[t] = ~episode_ended
        discounts[t] = np.where(terminated | episode_ended, 0.0, GAMMA)
        rewards[t] = np.where(episode_ended, 0.0, rewards[t])
        log_rhos[t] = np.where(episode_ended, 30.0, log_rhos[t])
        episode_ended = terminated | truncated
    return {
        "log_rhos": log_rhos,
        "discounts": discounts,
        "rewards": rewards,
        "values": values,
        "bootstrap_value": rng.normal(size=B),
        "valid": valid,
    }


def as_torch(data: dict[str, np.ndarray], dtype: torch.dtype = torch.float64) -> dict:
    return {
        k: torch.as_tensor(v) if k == "valid" else torch.as_tensor(v, dtype=dtype)
        for k, v in data.items()
    }


def ref_vtrace(
    log_rhos, discounts, rewards, values, bootstrap_value, valid, rho_bar, c_bar, pg_rho_bar, lam
) -> tuple[np.ndarray, np.ndarray]:
    """IMPALA eq. 1 as a sum, v_s = V(x_s) + sum_t (prod_{s<=i<t} gamma_i c_i) delta_t."""
    T = len(rewards)
    rhos = np.exp(log_rhos)

    def truncated(bar):
        ratio = rhos if bar is None else np.minimum(bar, rhos)
        return np.where(valid, ratio, 0.0)

    clipped_rhos, cs, pg_rhos = truncated(rho_bar), lam * truncated(c_bar), truncated(pg_rho_bar)
    values_tp1 = np.concatenate([values[1:], bootstrap_value[None]])
    vs = np.empty_like(values)
    for s in range(T):
        v_s = values[s].copy()
        for t in range(s, T):
            delta_t = clipped_rhos[t] * (rewards[t] + discounts[t] * values_tp1[t] - values[t])
            v_s += np.prod(discounts[s:t], axis=0) * np.prod(cs[s:t], axis=0) * delta_t
        vs[s] = v_s
    vs_tp1 = np.concatenate([vs[1:], bootstrap_value[None]])
    return vs, pg_rhos * (rewards + discounts * vs_tp1 - values)


def ref_discounted_returns(rewards, discounts, values, bootstrap_value, valid) -> np.ndarray:
    """G_t = sum_k (prod_{t<=i<k} gamma_i) r_k, ending on V at the unroll end or an autoreset."""
    T, B = rewards.shape
    returns = np.empty((T, B))
    for b in range(B):
        for t in range(T):
            total, scale = 0.0, 1.0
            for k in range(t, T + 1):
                if k == T:
                    total += scale * bootstrap_value[b]
                    break
                if not valid[k, b]:
                    total += scale * values[k, b]
                    break
                total += scale * rewards[k, b]
                scale *= discounts[k, b]
            returns[t, b] = total
    return returns


def ref_lambda_returns(rewards, discounts, values, bootstrap_value, valid, lam) -> np.ndarray:
    """Mixture of n-step returns (Sutton & Barto ch. 12): (1-l) sum_n l^(n-1) G^(n), the
    longest one (to the unroll end or the autoreset step) taking the remaining weight."""
    T, B = rewards.shape
    returns = np.empty((T, B))
    for b in range(B):
        for t in range(T):
            horizon = 0
            while t + horizon < T and valid[t + horizon, b]:
                horizon += 1
            if horizon == 0:
                returns[t, b] = values[t, b]
                continue
            mixture, partial, scale = 0.0, 0.0, 1.0
            for n in range(1, horizon + 1):
                partial += scale * rewards[t + n - 1, b]
                scale *= discounts[t + n - 1, b]
                end_value = bootstrap_value[b] if t + n == T else values[t + n, b]
                weight = lam ** (n - 1) if n == horizon else (1 - lam) * lam ** (n - 1)
                mixture += weight * (partial + scale * end_value)
            returns[t, b] = mixture
    return returns


def assert_close(actual: torch.Tensor, desired: np.ndarray) -> None:
    np.testing.assert_allclose(actual.numpy(), desired, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("clip", list(CLIPS.values()), ids=list(CLIPS))
@pytest.mark.parametrize(("T", "B"), SHAPES)
def test_vtrace_matches_eq1_sum_form(T: int, B: int, clip: tuple) -> None:
    data = make_unroll(T * 100 + B, T, B)
    rho_bar, c_bar, pg_rho_bar, lam = clip
    out = vtrace(**as_torch(data), rho_bar=rho_bar, c_bar=c_bar, pg_rho_bar=pg_rho_bar, lambda_=lam)
    ref_vs, ref_pg = ref_vtrace(*data.values(), rho_bar, c_bar, pg_rho_bar, lam)
    assert isinstance(out, VTraceReturns)
    assert_close(out.vs, ref_vs)
    assert_close(out.pg_advantages, ref_pg)
    # The weight and the unweighted advantage a normalizing caller rescales separately.
    assert_close(out.pg_rhos * out.pg_advantages_unweighted, ref_pg)
    if pg_rho_bar is not None:  # unclipped ratios have no bound to check
        assert out.pg_rhos.max() <= pg_rho_bar


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf])
def test_vtrace_invalid_steps_hold_values_and_zero_advantage(garbage: float) -> None:
    data = as_torch(make_unroll(7, 20, 8))
    invalid = ~data["valid"]
    assert invalid.any()
    data["log_rhos"][invalid] = garbage
    data["discounts"][invalid] = GAMMA  # a caller's mistake must not reopen the trace either
    out = vtrace(**data, rho_bar=None, c_bar=None, pg_rho_bar=None)
    assert torch.isfinite(out.vs).all() and torch.isfinite(out.pg_advantages).all()
    assert torch.equal(out.vs[invalid], data["values"][invalid])
    assert (out.pg_advantages[invalid] == 0).all()
    assert (out.pg_rhos[invalid] == 0).all() and (out.pg_advantages_unweighted[invalid] == 0).all()


@pytest.mark.parametrize("ending", ["terminated", "truncated"])
def test_vtrace_does_not_look_past_an_autoreset(ending: str) -> None:
    # Episode ends at step 2; step 3 is the autoreset step; steps 4-5 are the next episode.
    T = 6
    discounts = torch.full((T, 1), GAMMA, dtype=torch.float64)
    discounts[2] = 0.0 if ending == "terminated" else GAMMA
    discounts[3] = 0.0
    valid = torch.ones(T, 1, dtype=torch.bool)
    valid[3] = False
    base = torch.as_tensor(np.random.default_rng(0).normal(size=(3, T, 1)))

    def run(seed: int) -> VTraceReturns:
        # everything the next episode (and the ignored action) holds changes with seed
        nxt = torch.Generator().manual_seed(seed)
        rewards, values, log_rhos = base.clone()
        rewards[3:] = torch.randn(3, 1, generator=nxt, dtype=torch.float64)
        values[4:] = torch.randn(2, 1, generator=nxt, dtype=torch.float64)
        log_rhos[3:] = torch.randn(3, 1, generator=nxt, dtype=torch.float64)
        bootstrap = torch.randn(1, generator=nxt, dtype=torch.float64)
        return vtrace(log_rhos, discounts, rewards, values, bootstrap, valid, c_bar=None)

    a, b = run(10), run(11)
    assert not torch.equal(a.vs[4:], b.vs[4:])
    assert torch.equal(a.vs[:4], b.vs[:4])
    assert torch.equal(a.pg_advantages[:4], b.pg_advantages[:4])


def test_truncation_bootstraps_from_the_final_observation() -> None:
    # B=2: env 0 is truncated at step 0, env 1 terminated; step 1 is their autoreset step.
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0], [5.0, 5.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.5], [3.0, 3.0], [7.0, 7.0]], dtype=torch.float64)
    discounts = torch.tensor([[GAMMA, 0.0], [0.0, 0.0], [GAMMA, GAMMA]], dtype=torch.float64)
    valid = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    bootstrap = torch.tensor([2.0, 2.0], dtype=torch.float64)
    out = vtrace(
        torch.zeros(3, 2, dtype=torch.float64), discounts, rewards, values, bootstrap, valid
    )
    # truncated: r_0 + gamma V(final obs); terminated: r_0 alone
    torch.testing.assert_close(
        out.vs[0], torch.tensor([1.0 + GAMMA * 3.0, 1.0], dtype=torch.float64)
    )
    torch.testing.assert_close(out.pg_advantages[0], out.vs[0] - values[0])
    for returns in (
        discounted_returns(rewards, discounts, bootstrap, values, valid),
        lambda_returns(rewards, discounts, values, bootstrap, 0.5, valid),
    ):
        torch.testing.assert_close(returns[0], out.vs[0])
        expected_later = torch.tensor([[3.0, 3.0], [5.0 + GAMMA * 2.0] * 2], dtype=torch.float64)
        torch.testing.assert_close(returns[1:], expected_later)


@pytest.mark.parametrize("c_bar", [1.0, 2.0, None])
@pytest.mark.parametrize(("T", "B"), SHAPES)
def test_on_policy_vtrace_is_the_nstep_return(T: int, B: int, c_bar: float | None) -> None:
    data = as_torch(make_unroll(T * 10 + B, T, B))
    data["log_rhos"] = torch.zeros_like(data["rewards"])
    out = vtrace(**data, c_bar=c_bar)
    returns = discounted_returns(
        data["rewards"], data["discounts"], data["bootstrap_value"], data["values"], data["valid"]
    )
    torch.testing.assert_close(out.vs, returns, rtol=RTOL, atol=ATOL)
    advantages = torch.where(data["valid"], returns - data["values"], 0.0)
    torch.testing.assert_close(out.pg_advantages, advantages, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95])
@pytest.mark.parametrize(("T", "B"), SHAPES)
def test_on_policy_vtrace_with_lambda_is_the_lambda_return(T: int, B: int, lam: float) -> None:
    data = as_torch(make_unroll(T * 10 + B + 1, T, B))
    data["log_rhos"] = torch.zeros_like(data["rewards"])
    out = vtrace(**data, lambda_=lam)
    returns = lambda_returns(
        data["rewards"],
        data["discounts"],
        data["values"],
        data["bootstrap_value"],
        lam,
        data["valid"],
    )
    torch.testing.assert_close(out.vs, returns, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("T", "B"), SHAPES)
def test_discounted_returns_match_forward_sums(T: int, B: int) -> None:
    data = make_unroll(T + B, T, B)
    keys = ("rewards", "discounts", "values", "bootstrap_value", "valid")
    ref = ref_discounted_returns(*(data[k] for k in keys))
    t = as_torch(data)
    returns = discounted_returns(
        t["rewards"], t["discounts"], t["bootstrap_value"], t["values"], t["valid"]
    )
    assert_close(returns, ref)
    # without autoreset steps, values are not needed
    all_valid = np.ones_like(data["valid"])
    plain = discounted_returns(t["rewards"], t["discounts"], t["bootstrap_value"])
    assert_close(plain, ref_discounted_returns(*(data[k] for k in keys[:-1]), all_valid))


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95, 1.0])
@pytest.mark.parametrize(("T", "B"), SHAPES)
def test_lambda_returns_match_the_nstep_mixture(T: int, B: int, lam: float) -> None:
    data = make_unroll(T + 2 * B, T, B)
    keys = ("rewards", "discounts", "values", "bootstrap_value", "valid")
    t = as_torch(data)
    returns = lambda_returns(
        t["rewards"], t["discounts"], t["values"], t["bootstrap_value"], lam, t["valid"]
    )
    assert_close(returns, ref_lambda_returns(*(data[k] for k in keys), lam))


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95, 1.0])
@pytest.mark.parametrize(("T", "B"), SHAPES)
def test_gae_is_lambda_return_minus_values(T: int, B: int, lam: float) -> None:
    t = as_torch(make_unroll(T + 3 * B, T, B))
    args = (t["rewards"], t["discounts"], t["values"], t["bootstrap_value"], lam)
    advantages = gae(*args, valid=t["valid"])
    returns = lambda_returns(*args, valid=t["valid"])
    torch.testing.assert_close(advantages + t["values"], returns, rtol=RTOL, atol=ATOL)
    assert (advantages[~t["valid"]] == 0).all()
    if lam == 0.0:  # one-step TD error
        values_tp1 = torch.cat([t["values"][1:], t["bootstrap_value"][None]])
        td = t["rewards"] + t["discounts"] * values_tp1 - t["values"]
        valid = t["valid"]
        torch.testing.assert_close(advantages[valid], td[valid], rtol=RTOL, atol=ATOL)


def test_vtrace_clipping() -> None:
    data = as_torch(make_unroll(3, 20, 8))
    on_policy = vtrace(**{**data, "log_rhos": torch.zeros_like(data["rewards"])})
    # every ratio far above 1 is clipped to 1 by the paper's bars: on-policy again
    large = vtrace(**{**data, "log_rhos": torch.full_like(data["rewards"], 5.0)})
    torch.testing.assert_close(large.vs, on_policy.vs, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(large.pg_advantages, on_policy.pg_advantages, rtol=RTOL, atol=ATOL)
    # rho_bar caps rho_t, not c_t: log-ratios above log(rho_bar) act as log(rho_bar)
    big = torch.full_like(data["rewards"], 5.0)
    at_bar = torch.full_like(data["rewards"], math.log(2.0))
    capped = vtrace(**{**data, "log_rhos": big}, rho_bar=2.0, c_bar=1.0, pg_rho_bar=3.0)
    at = vtrace(**{**data, "log_rhos": at_bar}, rho_bar=2.0, c_bar=1.0, pg_rho_bar=2.0)
    torch.testing.assert_close(capped.vs, at.vs, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(capped.pg_advantages, 1.5 * at.pg_advantages, rtol=RTOL, atol=ATOL)
    # without clipping the same ratios give different targets
    unclipped = vtrace(**{**data, "log_rhos": big}, rho_bar=None, c_bar=None, pg_rho_bar=None)
    assert not torch.allclose(unclipped.vs, on_policy.vs)
    # vanishing ratios leave the values and no advantage
    tiny = vtrace(**{**data, "log_rhos": torch.full_like(data["rewards"], -50.0)})
    torch.testing.assert_close(tiny.vs, data["values"], rtol=0, atol=1e-15)
    torch.testing.assert_close(
        tiny.pg_advantages, torch.zeros_like(data["values"]), rtol=0, atol=1e-15
    )


def test_float32_inputs_and_float_valid_mask() -> None:
    data64 = as_torch(make_unroll(5, 20, 8))
    data32 = as_torch(make_unroll(5, 20, 8), dtype=torch.float32)
    data32["valid"] = data32["valid"].float()
    r, d, v, bv = (data32[k] for k in ("rewards", "discounts", "values", "bootstrap_value"))
    r64, d64, v64, bv64 = (data64[k] for k in ("rewards", "discounts", "values", "bootstrap_value"))
    valid32, valid64 = data32["valid"], data64["valid"]
    pairs = [
        (vtrace(**data32).vs, vtrace(**data64).vs),
        (vtrace(**data32).pg_advantages, vtrace(**data64).pg_advantages),
        (
            discounted_returns(r, d, bv, v, valid32),
            discounted_returns(r64, d64, bv64, v64, valid64),
        ),
        (
            lambda_returns(r, d, v, bv, 0.9, valid32),
            lambda_returns(r64, d64, v64, bv64, 0.9, valid64),
        ),
        (gae(r, d, v, bv, 0.9, valid32), gae(r64, d64, v64, bv64, 0.9, valid64)),
    ]
    for out32, out64 in pairs:
        assert out32.dtype == torch.float32
        torch.testing.assert_close(out32, out64.float(), rtol=1e-5, atol=1e-5)


def test_targets_are_stop_gradient() -> None:
    data = as_torch(make_unroll(6, 5, 3))
    for k in ("log_rhos", "values", "bootstrap_value"):
        data[k].requires_grad_(True)
    out = vtrace(**data)
    args = (data["rewards"], data["discounts"], data["values"], data["bootstrap_value"], 0.9)
    for target in (*out, lambda_returns(*args), gae(*args)):
        assert not target.requires_grad


def test_mismatched_shapes_are_rejected() -> None:
    data = as_torch(make_unroll(8, 5, 3))
    with pytest.raises(ValueError, match="values"):
        vtrace(**{**data, "values": data["values"][:, :1]})
    with pytest.raises(ValueError, match="bootstrap_value"):
        gae(data["rewards"], data["discounts"], data["values"], data["values"][-1:], 0.9)
    with pytest.raises(ValueError, match="needs values"):
        discounted_returns(
            data["rewards"], data["discounts"], data["bootstrap_value"], valid=data["valid"]
        )
