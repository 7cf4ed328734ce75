"""The IMPALA loss wiring: masking of autoreset steps, termination vs truncation, reduction."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlfabric.algorithms import vtrace as vtrace_module
from rlfabric.algorithms.returns import vtrace
from rlfabric.algorithms.vtrace import VTrace, VTraceConfig
from rlfabric.models import ModelConfig

T, B = 6, 4
OBS = gym.spaces.Box(-1, 1, (3,), np.float32)
ACT = gym.spaces.Discrete(3)


def _algo(**cfg) -> VTrace:
    torch.manual_seed(0)
    return VTrace(VTraceConfig(**cfg), OBS, ACT, ModelConfig(hidden=[16]))


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    terminated = np.zeros((T, B), bool)
    truncated = np.zeros((T, B), bool)
    terminated[1, 0] = True  # env 0: episode ends at t=1, t=2 is the autoreset step
    truncated[3, 1] = True  # env 1: time limit at t=3, t=4 is the autoreset step
    is_first = np.zeros((T + 1, B), bool)
    is_first[3, 0] = is_first[5, 1] = True  # obs after each autoreset step is a reset obs
    return {
        "obs": rng.normal(size=(T + 1, B, 3)).astype(np.float32),
        "is_first": is_first,
        "action": rng.integers(0, 3, size=(T, B)),
        "reward": rng.normal(size=(T, B)).astype(np.float32),
        "terminated": terminated,
        "truncated": truncated,
        "logp": np.log(rng.uniform(0.2, 0.5, size=(T, B))).astype(np.float32),
        "policy_version": np.zeros((T, B), np.int64),
    }


def _grads(algo: VTrace, batch) -> tuple[float, list[torch.Tensor]]:
    params_before = [p.detach().clone() for p in algo.model.parameters()]
    algo.optimizer = torch.optim.SGD(algo.model.parameters(), lr=0.0)
    metrics = algo.update(batch)
    grads = [p.grad.clone() for p in algo.model.parameters()]
    for p, before in zip(algo.model.parameters(), params_before):
        assert torch.equal(p, before)
    return metrics["loss"], grads


def _reference(algo: VTrace, batch) -> tuple:
    """The loss's pieces computed by hand from the model's outputs and `vtrace`:
    (logp, entropy, values, valid, vtrace returns)."""
    with torch.no_grad():
        params, values = algo.model(torch.as_tensor(batch["obs"]))
        dist = algo.model.distribution(params[:-1])
        logp = dist.log_prob(torch.as_tensor(batch["action"]))
        entropy = dist.entropy()
    valid = torch.as_tensor(~batch["is_first"][1:]).float()
    discounts = 0.99 * (1 - torch.as_tensor(batch["terminated"]).float()) * valid
    ret = vtrace(
        logp - torch.as_tensor(batch["logp"]),
        discounts,
        torch.as_tensor(batch["reward"]),
        values[:-1],
        values[-1],
        valid,
    )
    return logp, entropy, values, valid, ret


def test_loss_matches_impala_formula():
    algo = _algo(loss_reduction="sum")
    batch = _batch()
    logp, entropy, values, valid, ret = _reference(algo, batch)
    expected = (
        -(logp * ret.pg_advantages * valid).sum()
        + 0.5 * 0.5 * ((ret.vs - values[:-1]) ** 2 * valid).sum()
        - 0.01 * (entropy * valid).sum()
    )
    loss, _ = _grads(algo, batch)
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    loss_mean, _ = _grads(_algo(loss_reduction="mean"), batch)
    assert loss_mean == pytest.approx(expected.item() / valid.sum().item(), rel=1e-5)


def test_autoreset_steps_do_not_affect_the_update():
    batch = _batch()
    loss, grads = _grads(_algo(), batch)
    changed = {k: v.copy() for k, v in batch.items()}
    for t, b in ((2, 0), (4, 1)):  # the autoreset steps
        changed["action"][t, b] = (changed["action"][t, b] + 1) % 3
        changed["reward"][t, b] += 100.0
        changed["logp"][t, b] -= 5.0
    loss2, grads2 = _grads(_algo(), changed)
    assert loss2 == pytest.approx(loss, rel=1e-6)
    for g1, g2 in zip(grads, grads2):
        torch.testing.assert_close(g1, g2)


def test_termination_cuts_bootstrap_but_truncation_does_not():
    base_loss, _ = _grads(_algo(), _batch())
    after_terminal = _batch()
    after_terminal["obs"][2, 0] += 10.0  # env 0: observation after the terminal step
    loss_term, _ = _grads(_algo(), after_terminal)
    after_truncation = _batch()
    after_truncation["obs"][4, 1] += 10.0  # env 1: final observation at the time limit
    loss_trunc, _ = _grads(_algo(), after_truncation)
    # obs[2, 0] is the (ignored) terminal observation: no value is bootstrapped from it,
    # and its own step is masked, so nothing changes.
    assert loss_term == pytest.approx(base_loss, rel=1e-6)
    # obs[4, 1] is the final observation of a truncated episode: it bootstraps.
    assert loss_trunc != pytest.approx(base_loss, rel=1e-3)


def test_reward_clipping_only_when_asked():
    batch = _batch()
    big = {**batch, "reward": batch["reward"] * 100}
    clipped_small, _ = _grads(
        _algo(reward_clip=0.5), {**batch, "reward": np.sign(batch["reward"]) * 0.5}
    )
    clipped_big, _ = _grads(_algo(reward_clip=0.5), big)
    unclipped_big, _ = _grads(_algo(), big)
    assert clipped_big == pytest.approx(clipped_small, rel=1e-6)
    assert unclipped_big != pytest.approx(clipped_big, rel=1e-3)


def test_updates_reduce_value_error_on_a_fixed_batch():
    algo = _algo(optimizer="adam", lr=1e-2, lr_schedule="constant", loss_reduction="mean")
    batch = _batch()
    first = algo.update(batch)["baseline_loss"]
    for _ in range(200):
        last = algo.update(batch)["baseline_loss"]
    assert last < 0.5 * first


def test_continuous_actions():
    space = gym.spaces.Box(-2, 2, (2,), np.float32)
    algo = VTrace(VTraceConfig(), OBS, space, ModelConfig(hidden=[16]))
    action, extras, _ = algo.act(np.zeros((5, 3), np.float32))
    assert action.shape == (5, 2) and extras["logp"].shape == (5,)
    batch = _batch()
    batch["action"] = np.random.default_rng(0).normal(size=(T, B, 2)).astype(np.float32)
    metrics = algo.update(batch)
    assert np.isfinite(metrics["loss"])


def test_rho_mean_stays_finite_for_a_huge_log_ratio():
    """A behaviour log-prob far below pi's makes exp(log rho) overflow; the diagnostic is
    of the clipped ratios the targets use, and the update is applied."""
    algo = _algo(rho_bar=1.0)
    batch = _batch()
    batch["logp"][0, 2] = -500.0  # valid step: pi/mu = e^500 overflows float32
    batch["logp"][2, 0] = -np.inf  # the autoreset step, masked out
    metrics = algo.update(batch)
    assert np.isfinite(metrics["rho_mean"]) and 0.0 < metrics["rho_mean"] <= 1.0
    assert algo.nonfinite_steps == 0


def test_normalized_advantages_are_normalized_before_their_importance_weight():
    """Each step's pg term is min(pg_rho_bar, rho) (q - mean q) / std q over the valid
    steps, q = r + gamma v_{s+1} - V(x_s), as PPO's ratio multiplies a normalized
    advantage. Normalizing rho * q instead (as before) centres the weighted product, which
    made a lagged batch's policy collapse."""
    batch = _batch()  # mu's log-probs differ from pi's, so the ratios are not all 1
    algo = _algo(loss_reduction="sum", normalize_advantages=True, entropy_cost=0.0)
    logp, _, values, valid, ret = _reference(algo, batch)
    with torch.no_grad():
        discounts = 0.99 * (1 - torch.as_tensor(batch["terminated"]).float()) * valid
        vs_tp1 = torch.cat([ret.vs[1:], values[-1:]])
        q = torch.as_tensor(batch["reward"]) + discounts * vs_tp1 - values[:-1]
        rhos = (logp - torch.as_tensor(batch["logp"])).exp().clamp(max=1.0)
    assert not torch.allclose(rhos[valid > 0], torch.ones(int(valid.sum())))
    q_valid = q[valid > 0]  # masked steps take no part in the statistics
    q_norm = torch.zeros_like(q)
    q_norm[valid > 0] = (q_valid - q_valid.mean()) / (q_valid.std() + 1e-8)
    expected = (
        -(logp * rhos * q_norm * valid).sum()
        + 0.5 * 0.5 * ((ret.vs - values[:-1]) ** 2 * valid).sum()
    )
    loss, _ = _grads(algo, batch)
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    unnormalized, _ = _grads(_algo(loss_reduction="sum", entropy_cost=0.0), batch)
    assert unnormalized != pytest.approx(loss, rel=1e-3)


def test_entropy_cost_anneals_linearly_to_zero_over_its_frames():
    """`algo.entropy_decay_frames`: the entropy term of the IMPALA loss weighs
    entropy_cost * (1 - frames / decay_frames), then nothing. Without it the bonus stays
    whatever the lr schedule does."""
    algo = _algo(loss_reduction="sum", entropy_decay_frames=1000)
    batch = _batch()
    logp, entropy, values, valid, ret = _reference(algo, batch)
    pg = -(logp * ret.pg_advantages * valid).sum()
    rest = pg + 0.5 * 0.5 * ((ret.vs - values[:-1]) ** 2 * valid).sum()
    entropy_sum = (entropy * valid).sum()
    for frames, weight in [(0, 0.01), (250, 0.0075), (1000, 0.0), (4000, 0.0)]:
        algo.set_progress(frames, None)
        loss, _ = _grads(algo, batch)
        assert algo.entropy_cost == pytest.approx(weight)
        assert loss == pytest.approx((rest - weight * entropy_sum).item(), rel=1e-5)
    constant = _algo(loss_reduction="sum")
    constant.set_progress(10**9, 0.5)  # a linear lr schedule halfway; the bonus stays
    assert constant.entropy_cost == 0.01
    assert constant.optimizer.param_groups[0]["lr"] == pytest.approx(constant.cfg.lr / 2)


def test_epochs_take_one_gradient_step_per_pass_with_fresh_targets():
    """`algo.epochs=2` is two IMPALA updates on the same batch: the second recomputes
    pi, V and the V-trace targets from the weights the first left, so its importance
    weights see the policy's move from mu. Two single-pass updates on the batch are the
    reference; the metrics are the passes' means."""
    batch = _batch()
    twice = _algo(epochs=2, optimizer="adam", lr=0.01)
    once = _algo(epochs=1, optimizer="adam", lr=0.01)
    assert twice.optimizer_steps_per_update() == 2
    first, second = once.update(batch), once.update(batch)
    metrics = twice.update(batch)
    for a, b in zip(twice.model.parameters(), once.model.parameters()):
        torch.testing.assert_close(a, b)
    assert metrics["loss"] == pytest.approx((first["loss"] + second["loss"]) / 2, rel=1e-5)
    # The second pass's ratios are pi_1 / mu, not the first pass's pi_0 / mu.
    assert first["rho_mean"] != pytest.approx(second["rho_mean"], rel=1e-4)


@pytest.mark.parametrize("num_minibatches", [1, 2])
def test_targets_once_per_batch_keep_the_first_passs_targets(monkeypatch, num_minibatches):
    """`algo.recompute_targets=false`: every pass scores its steps against the targets
    the network gave before the batch's first step, as PPO's GAE, although the weights
    move between passes; by default the second pass's targets are its own."""

    def targets_per_pass(algo: VTrace) -> list[torch.Tensor]:
        """One update; the sorted `vs` each pass's gradient steps were given (minibatches
        shuffle the steps, so a pass's targets are compared as a set)."""
        seen: list[torch.Tensor] = []
        step = algo._loss_step
        monkeypatch.setattr(algo, "_loss_step", lambda *a: seen.append(a[-1]["vs"]) or step(*a))
        algo.update(batch)
        half = len(seen) // 2  # the passes' steps come one pass after the other
        return [
            torch.cat([v.flatten() for v in p]).sort().values for p in (seen[:half], seen[half:])
        ]

    batch = _batch()
    cfg = dict(epochs=2, num_minibatches=num_minibatches, optimizer="adam", lr=0.01)
    fixed = _algo(recompute_targets=False, **cfg)
    *_, ret = _reference(fixed, batch)
    start_vs = ret.vs.flatten().sort().values
    before = [p.detach().clone() for p in fixed.model.parameters()]
    first, second = targets_per_pass(fixed)
    assert not all(torch.equal(a, b) for a, b in zip(before, fixed.model.parameters()))
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(first, start_vs)

    first, second = targets_per_pass(_algo(**cfg))
    torch.testing.assert_close(first, start_vs)
    assert not torch.allclose(first, second)


def test_pg_clip_takes_ppos_clipped_surrogate_on_the_vtrace_advantage():
    """`algo.pg_clip` (APPO): the pg term is -min(r A, clip(r, 1-e, 1+e) A), r = pi/mu and
    A = r_s + gamma v_{s+1} - V(x_s) unweighted, summed like IMPALA's other terms. Some of
    the batch's ratios lie outside the clip, so the clip changes the loss."""
    algo = _algo(loss_reduction="sum", pg_clip=0.2, baseline_cost=0.0, entropy_cost=0.0)
    batch = _batch()
    logp, _, _, valid, ret = _reference(algo, batch)
    ratio = torch.exp(logp - torch.as_tensor(batch["logp"]))
    assert ((ratio[valid > 0] > 1.2).any() or (ratio[valid > 0] < 0.8).any()).item()
    adv = ret.pg_advantages_unweighted
    surrogate = torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    expected = -(surrogate * valid).sum()
    algo.optimizer = torch.optim.SGD(algo.model.parameters(), lr=0.0)
    metrics = algo.update(batch)
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-5)
    unclipped = -(ratio * adv * valid).sum()
    assert metrics["loss"] != pytest.approx(unclipped.item(), rel=1e-3)
    # PPO's clip fraction: the share of valid steps whose ratio lies outside 1 +- 0.2.
    outside = ((ratio - 1.0).abs() > 0.2).float()
    assert metrics["clip_fraction"] == pytest.approx(((outside * valid).sum() / valid.sum()).item())
    assert 0.0 < metrics["clip_fraction"] < 1.0


def test_pg_clip_target_clips_against_the_targets_policy_and_weights_by_its_lag():
    """`algo.pg_clip_target` (IMPACT): the ratio is pi/pi_t, pi_t the policy the targets
    were computed under, and the advantage is weighted by min(1, pi_t/mu). On a lagged
    batch with the weights held still (lr 0) pi = pi_t at every step: nothing is clipped
    and the pg term is IMPALA's, -sum(min(1, pi/mu) A), where the clip on pi/mu would
    change it."""
    cfg = dict(
        loss_reduction="sum",
        pg_clip=0.2,
        baseline_cost=0.0,
        entropy_cost=0.0,
        epochs=2,
        recompute_targets=False,
    )
    batch = _batch()
    algo = _algo(pg_clip_target=True, **cfg)
    logp, _, _, valid, ret = _reference(algo, batch)
    ratio = torch.exp(logp - torch.as_tensor(batch["logp"]))
    assert ((ratio[valid > 0] - 1.0).abs() > 0.2).any().item()
    algo.optimizer = torch.optim.SGD(algo.model.parameters(), lr=0.0)
    metrics = algo.update(batch)
    expected = -(ret.pg_advantages * valid).sum()
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["clip_fraction"] == 0.0
    behaviour = _algo(**cfg)
    behaviour.optimizer = torch.optim.SGD(behaviour.model.parameters(), lr=0.0)
    assert behaviour.update(batch)["loss"] != pytest.approx(expected.item(), rel=1e-3)


def test_pg_clip_target_is_the_clip_on_pi_over_mu_without_lag():
    """A batch acted by the learner's own policy (mu = pi_t): over two passes with the
    targets kept from the first, the target form's losses and weights equal the clip on
    pi/mu, though the second pass's ratios are past the first step."""
    batch = _batch()
    cfg = dict(pg_clip=0.1, epochs=2, recompute_targets=False, optimizer="adam", lr=0.05)
    forms = [_algo(pg_clip_target=target, **cfg) for target in (True, False)]
    logp, *_ = _reference(forms[0], batch)
    batch["logp"] = logp.numpy()
    results = [form.update(batch) for form in forms]
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-5)
    assert results[0]["clip_fraction"] == pytest.approx(results[1]["clip_fraction"])
    assert results[0]["clip_fraction"] > 0.0
    for a, b in zip(*(form.model.parameters() for form in forms)):
        torch.testing.assert_close(a, b)


def test_pg_clip_target_needs_a_clip_that_can_bind():
    with pytest.raises(ValueError, match="pg_clip_target=true needs pg_clip"):
        VTraceConfig(pg_clip_target=True, num_minibatches=2)
    for steps in (dict(epochs=2), dict(epochs=1, recompute_targets=False)):
        with pytest.raises(ValueError, match="the clip never binds: set num_minibatches > 1"):
            VTraceConfig(pg_clip_target=True, pg_clip=0.1, **steps)
    VTraceConfig(pg_clip_target=True, pg_clip=0.1, epochs=2, recompute_targets=False)
    VTraceConfig(pg_clip_target=True, pg_clip=0.1, num_minibatches=2)


def test_minibatches_are_flat_steps_scored_against_whole_unroll_targets(monkeypatch):
    """`algo.num_minibatches` (APPO): each pass computes the V-trace targets over the whole
    unrolls, then takes one gradient step per random minibatch of flat (t, b) steps, its
    loss IMPALA's (mean-reduced) over the minibatch's valid steps only."""
    order = torch.randperm(T * B, generator=torch.Generator().manual_seed(0))
    split = list(order.split([10, T * B - 10]))  # unequal, so their means weigh steps apart
    monkeypatch.setattr(vtrace_module, "minibatch_indices", lambda size, n, device: split)
    algo = _algo(loss_reduction="mean", epochs=2, num_minibatches=2)
    assert algo.optimizer_steps_per_update() == 4
    batch = _batch()
    logp, entropy, values, valid, ret = _reference(algo, batch)
    terms = (
        -logp * ret.pg_advantages + 0.25 * (ret.vs - values[:-1]) ** 2 - 0.01 * entropy
    ) * valid
    expected = [(terms.flatten()[s].sum() / valid.flatten()[s].sum()).item() for s in split]
    loss, _ = _grads(algo, batch)
    assert loss == pytest.approx(float(np.mean(expected)), rel=1e-5)
    # Not the whole batch's loss: the minibatches weigh their valid steps apart.
    assert loss != pytest.approx((terms.sum() / valid.sum()).item(), rel=1e-4)


def test_recurrent_minibatches_are_whole_unrolls():
    """With an LSTM each minibatch is whole columns from their stored first state, as PPO's;
    the first forward pass, over the whole batch, only gives the targets."""
    torch.manual_seed(0)
    cfg = VTraceConfig(num_minibatches=2, epochs=2)
    algo = VTrace(cfg, OBS, ACT, ModelConfig(hidden=[16], lstm=8))
    batch = _batch() | {"state": np.zeros((1, B, 2, 8), np.float32)}
    seen: list[torch.Tensor] = []
    algo.model.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    algo.update(batch)
    obs = torch.as_tensor(batch["obs"])
    assert [s.shape[1] for s in seen] == [B, B // 2, B // 2] * 2
    for first, second in (seen[1:3], seen[4:6]):
        cols = [int((obs[0] == c).all(-1).nonzero()) for c in (*first[0], *second[0])]
        assert sorted(cols) == list(range(B))
        torch.testing.assert_close(torch.cat([first, second], 1), obs[:, cols])


def test_rejects_more_minibatches_than_steps():
    with pytest.raises(ValueError, match="num_minibatches=9 must be <= batch_size x unroll"):
        VTraceConfig(batch_size=4, unroll_length=2, num_minibatches=9)
