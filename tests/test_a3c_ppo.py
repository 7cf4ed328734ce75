"""A3C (GA3C loss) and PPO: losses against slow references, masking, clipping, learning."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS, ppo
from rlfabric.algorithms.a3c import A3C, A3CConfig
from rlfabric.algorithms.ppo import PPO, PPOConfig, clipped_policy_loss, value_loss
from rlfabric.errors import SpecError
from rlfabric.models import ModelConfig
from rlfabric.platform.spec import ExperimentSpec

T, B = 6, 4
GAMMA, LAMBDA = 0.99, 0.95
OBS = gym.spaces.Box(-1, 1, (3,), np.float32)
ACT = gym.spaces.Discrete(3)
BOX = gym.spaces.Box(-2, 2, (2,), np.float32)
AUTORESET = ((2, 0), (4, 1))  # (t, env) of the steps that only reset an env

#: CartPole settings that learn within a few seconds on the local architecture.
FAST_A3C = {"name": "a3c", "lr": 3e-3}
FAST_PPO = {
    "name": "ppo",
    "lr": 3e-3,
    "lr_schedule": "constant",
    "unroll_length": 16,
    "batch_size": 16,
}


def _batch(seed: int = 0, action_space: gym.Space = ACT) -> dict[str, np.ndarray]:
    """Env 0 terminates at t=1, env 1 is truncated at t=3, env 2 is truncated at the last step."""
    rng = np.random.default_rng(seed)
    terminated = np.zeros((T, B), bool)
    truncated = np.zeros((T, B), bool)
    terminated[1, 0] = True  # t=2 is env 0's autoreset step
    truncated[3, 1] = True  # t=4 is env 1's autoreset step
    truncated[T - 1, 2] = True  # obs[T] is env 2's final observation: it bootstraps
    is_first = np.zeros((T + 1, B), bool)
    is_first[3, 0] = is_first[5, 1] = True
    if isinstance(action_space, gym.spaces.Discrete):
        action = rng.integers(0, action_space.n, size=(T, B))
    else:
        action = rng.normal(size=(T, B, *action_space.shape)).astype(np.float32)
    return {
        "obs": rng.normal(size=(T + 1, B, 3)).astype(np.float32),
        "is_first": is_first,
        "action": action,
        "reward": rng.normal(size=(T, B)).astype(np.float32),
        "terminated": terminated,
        "truncated": truncated,
        "logp": np.log(rng.uniform(0.2, 0.5, size=(T, B))).astype(np.float32),
        "policy_version": np.zeros((T, B), np.int64),
    }


def _algo(cls, action_space: gym.Space = ACT, **cfg):
    torch.manual_seed(0)
    return cls(cls.config_cls(**cfg), OBS, action_space, ModelConfig(hidden=[16]))


def _frozen_update(algo, batch) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Update with lr 0: the metrics and the last gradients, parameters untouched."""
    algo.optimizer = torch.optim.SGD(algo.model.parameters(), lr=0.0)
    torch.manual_seed(1)  # the minibatch split
    metrics = algo.update(batch)
    return metrics, [p.grad.clone() for p in algo.model.parameters()]


def _current(algo, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log pi(a_t|x_t) [T, B], entropy [T, B], V(x_t) [T+1, B] under the current network."""
    with torch.no_grad():
        params, values = algo.model(torch.as_tensor(batch["obs"]))
        dist = algo.model.distribution(params[:-1])
        return dist.log_prob(torch.as_tensor(batch["action"])), dist.entropy(), values


def _ends_after(batch, k: int, b: int) -> bool:
    """Whether the return from step k of env b must stop bootstrapping at obs[k+1]."""
    return k + 1 == T or bool(batch["is_first"][k + 2, b])


def _reference_n_step(batch, values) -> np.ndarray:
    """R_t = sum_k gamma^(k-t) r_k up to the first terminal, then + gamma^n V(x_end)."""
    r, term = batch["reward"], batch["terminated"]
    out = np.zeros((T, B))
    for b in range(B):
        for t in range(T):
            g, scale = 0.0, 1.0
            for k in range(t, T):
                g += scale * r[k, b]
                if term[k, b]:
                    break
                scale *= GAMMA
                if _ends_after(batch, k, b):
                    g += scale * float(values[k + 1, b])
                    break
            out[t, b] = g
    return out


def _reference_gae(batch, values) -> np.ndarray:
    """A_t = sum_l (gamma lambda)^l delta_{t+l}, cut at terminals and autoreset steps."""
    r, term = batch["reward"], batch["terminated"]
    out = np.zeros((T, B))
    for b in range(B):
        for t in range(T):
            adv, scale = 0.0, 1.0
            for k in range(t, T):
                next_value = 0.0 if term[k, b] else float(values[k + 1, b])
                adv += scale * (r[k, b] + GAMMA * next_value - float(values[k, b]))
                if term[k, b] or _ends_after(batch, k, b):
                    break
                scale *= GAMMA * LAMBDA
            out[t, b] = adv
    return out


def _valid(batch) -> np.ndarray:
    return ~batch["is_first"][1:]


# -- A3C ---------------------------------------------------------------------------------


@pytest.mark.parametrize("log_epsilon", [1e-6, 0.34])  # 0.34 floors about half the actions
@pytest.mark.parametrize("reduction", ["sum", "mean"])  # GA3C's sum, baselines A2C's mean
@pytest.mark.parametrize("normalize", [False, True])
def test_a3c_loss_matches_ga3c_formula(log_epsilon, reduction, normalize):
    algo = _algo(
        A3C, log_epsilon=log_epsilon, loss_reduction=reduction, normalize_advantages=normalize
    )
    batch = _batch()
    logp, entropy, values = _current(algo, batch)
    valid = _valid(batch)
    returns = torch.as_tensor(_reference_n_step(batch, values), dtype=torch.float32)
    advantages = returns - values[:-1]
    pg_adv = advantages
    if normalize:  # PPO's normalisation, over the batch's valid steps (unbiased std)
        valid_adv = advantages[torch.as_tensor(valid)]
        pg_adv = (advantages - valid_adv.mean()) / (valid_adv.std() + 1e-8)
    log_pi = torch.log(torch.clamp(logp.exp(), min=log_epsilon))
    expected = 0.0
    for t, b in zip(*np.nonzero(valid)):
        adv = advantages[t, b]
        expected += -(log_pi[t, b] * pg_adv[t, b] + 0.01 * entropy[t, b]) + 0.5 * adv**2
    if reduction == "mean":
        expected /= valid.sum()
    metrics, _ = _frozen_update(algo, batch)
    assert metrics["loss"] == pytest.approx(float(expected), rel=1e-5)


def test_a3c_continuous_actions_use_the_log_density_unfloored():
    algo = _algo(A3C, BOX, log_epsilon=0.5)  # a floor would bite: densities here are < 0.4
    batch = _batch(action_space=BOX)
    logp, entropy, values = _current(algo, batch)
    valid = torch.as_tensor(_valid(batch)).float()
    returns = torch.as_tensor(_reference_n_step(batch, values), dtype=torch.float32)
    adv = returns - values[:-1]
    expected = (valid * (-(logp * adv + 0.01 * entropy) + 0.5 * adv**2)).sum()
    metrics, _ = _frozen_update(algo, batch)
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-5)
    action, extras, _ = algo.act(np.zeros((5, 3), np.float32))
    assert action.shape == (5, 2) and extras["logp"].shape == (5,)


# -- PPO ---------------------------------------------------------------------------------


def _reference_ppo_loss(algo, batch, steps: torch.Tensor, clip: float = 0.2) -> float:
    """CleanRL's minibatch loss on the flat (t * B + b) `steps`, at parameters equal to the
    old ones; advantages are normalised over the minibatch's valid steps."""
    logp, entropy, values = _current(algo, batch)
    advantages = torch.as_tensor(_reference_gae(batch, values), dtype=torch.float32)
    returns = advantages + values[:-1]
    select = torch.zeros(T * B, dtype=torch.bool)
    select[steps] = True
    select = select.view(T, B) & torch.as_tensor(_valid(batch))
    adv = advantages[select]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = (logp - torch.as_tensor(batch["logp"]))[select].exp()
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).mean()
    v_loss = 0.5 * ((values[:-1][select] - returns[select]) ** 2).mean()  # V == V_old: no clip
    return float(pg + 0.5 * v_loss - 0.01 * entropy[select].mean())


def test_ppo_loss_matches_cleanrl_formula():
    algo = _algo(PPO, epochs=1, num_minibatches=1)
    batch = _batch()
    metrics, _ = _frozen_update(algo, batch)
    assert metrics["loss"] == pytest.approx(_reference_ppo_loss(algo, batch, torch.arange(T * B)))


def test_ppo_feed_forward_minibatches_are_the_steps_of_the_split(monkeypatch):
    split = list(torch.randperm(T * B, generator=torch.Generator().manual_seed(0)).chunk(2))
    monkeypatch.setattr(ppo, "minibatch_indices", lambda size, n, device: split)
    algo = _algo(PPO, epochs=2, num_minibatches=2)
    batch = _batch()
    metrics, _ = _frozen_update(algo, batch)
    expected = np.mean([_reference_ppo_loss(algo, batch, steps) for steps in split])
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)


def _minibatch_obs(algo, batch) -> list[torch.Tensor]:
    """The observations each minibatch's forward pass sees, in order."""
    seen: list[torch.Tensor] = []
    algo.model.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    algo.update(batch)
    return seen[1:]  # seen[0]: the value pass over the whole batch


def test_ppo_feed_forward_minibatches_shuffle_steps_across_envs():
    """CleanRL `ppo.py`: each epoch covers every (t, b) step once, in random flat minibatches
    of T * B / num_minibatches steps, not in whole env columns."""
    batch = _batch()
    minibatch_obs = _minibatch_obs(_algo(PPO, epochs=3, num_minibatches=3), batch)
    assert len(minibatch_obs) == 9
    steps = torch.as_tensor(batch["obs"])[:-1].flatten(0, 1)
    for epoch in range(3):
        seen = torch.cat([obs[0] for obs in minibatch_obs[3 * epoch : 3 * epoch + 3]])
        assert seen.shape == steps.shape
        order = [int((steps == row).all(-1).nonzero()) for row in seen]
        assert sorted(order) == list(range(T * B))
        assert any(len({i % B for i in order[k : k + T]}) > 1 for k in range(0, T * B, T))


def test_ppo_recurrent_minibatches_are_whole_columns(monkeypatch):
    splits: list[list[torch.Tensor]] = []
    original = ppo.minibatch_indices

    def recording(size: int, n: int, device: torch.device) -> list[torch.Tensor]:
        splits.append(original(size, n, device))
        return splits[-1]

    monkeypatch.setattr(ppo, "minibatch_indices", recording)
    torch.manual_seed(0)
    algo = PPO(PPOConfig(epochs=3, num_minibatches=3), OBS, ACT, ModelConfig(hidden=[16], lstm=8))
    batch = _batch()
    minibatch_obs = _minibatch_obs(algo, batch)
    assert len(splits) == 3
    for split in splits:
        assert len(split) == 3
        assert sorted(torch.cat(split).tolist()) == list(range(B))
    assert len(minibatch_obs) == 9
    for obs, cols in zip(minibatch_obs, [c for split in splits for c in split]):
        torch.testing.assert_close(obs, torch.as_tensor(batch["obs"])[:, cols])
    for size, n in ((10, 4), (5, 5), (7, 1)):
        parts = ppo.minibatch_indices(size, n, torch.device("cpu"))
        assert len(parts) == n and sorted(torch.cat(parts).tolist()) == list(range(size))


def test_ppo_clipped_objective_has_no_gradient_beyond_the_clip():
    log_ratio = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1, 0.9])).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0])
    clipped_policy_loss(log_ratio, advantages, 0.2, torch.ones(6)).backward()
    zero = log_ratio.grad == 0
    assert zero.tolist() == [True, False, True, False, False, False]


@pytest.mark.parametrize(
    ("logp_shift", "reward", "zero_grad"),
    [(-1.0, 100.0, True), (1.0, -100.0, True), (-1.0, -100.0, False), (1.0, 100.0, False)],
)
def test_ppo_ratio_is_against_the_batch_behaviour_logp(logp_shift, reward, zero_grad):
    """Behaviour logp = current logp -+ 1 puts every ratio at e^+-1, outside [0.8, 1.2]."""
    algo = _algo(PPO, epochs=1, num_minibatches=1, value_cost=0.0, entropy_cost=0.0)
    algo.cfg.normalize_advantages = False
    batch = _batch()
    logp, _, _ = _current(algo, batch)
    batch["logp"] = (logp + logp_shift).numpy()
    batch["reward"] = np.full((T, B), reward, np.float32)  # advantages all of its sign
    metrics, grads = _frozen_update(algo, batch)
    assert metrics["clip_fraction"] == 1.0
    assert metrics["approx_kl"] == pytest.approx(math.exp(-logp_shift) - 1 + logp_shift, rel=1e-5)
    total = sum(g.abs().sum().item() for g in grads)
    assert (total == 0.0) == zero_grad
    batch["logp"] = logp.numpy()
    metrics, _ = _frozen_update(algo, batch)
    assert metrics["clip_fraction"] == 0.0 and metrics["approx_kl"] == pytest.approx(0, abs=1e-6)


def test_ppo_value_clip_bounds_the_change_from_old_values():
    old = torch.zeros(3)
    returns = torch.tensor([1.0, 1.0, -1.0])
    values = torch.tensor([0.5, 0.1, 0.5])
    ones = torch.ones(3)
    # clipped values 0.2, 0.1, 0.2: the max picks the larger error per step
    expected = 0.5 * (0.8**2 + 0.9**2 + 1.5**2) / 3
    assert value_loss(values, old, returns, 0.2, ones).item() == pytest.approx(expected)
    plain = 0.5 * (0.5**2 + 0.9**2 + 1.5**2) / 3
    assert value_loss(values, old, returns, None, ones).item() == pytest.approx(plain)


def test_ppo_rejects_more_minibatches_than_steps_or_recurrent_unrolls():
    with pytest.raises(ValueError, match="num_minibatches=9 must be <= batch_size x unroll"):
        PPOConfig(batch_size=4, unroll_length=2, num_minibatches=9)
    PPOConfig(batch_size=4, unroll_length=2, num_minibatches=8)  # flat steps: 8 fit
    algo = {"name": "ppo", "batch_size": 4, "num_minibatches": 5}
    ExperimentSpec.build({"algo": algo})
    with pytest.raises(SpecError, match=r"num_minibatches=5 must be <= algo.batch_size=4 with"):
        ExperimentSpec.build({"algo": algo, "model": {"lstm": 8}})


# -- both --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [A3C, PPO])
def test_autoreset_steps_do_not_affect_the_update(cls):
    batch = _batch()
    metrics, grads = _frozen_update(_algo(cls), batch)
    changed = {k: v.copy() for k, v in batch.items()}
    for t, b in AUTORESET:
        changed["action"][t, b] = (changed["action"][t, b] + 1) % 3
        changed["reward"][t, b] += 100.0
        changed["logp"][t, b] -= 5.0
        changed["terminated"][t, b] = True
    metrics2, grads2 = _frozen_update(_algo(cls), changed)
    for key, value in metrics.items():
        assert metrics2[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for g1, g2 in zip(grads, grads2):
        torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("cls", [A3C, PPO])
def test_registered_and_act_in_both_action_spaces(cls):
    name = cls.config_cls.model_fields["name"].default
    assert ALGORITHMS[name] is cls
    for space in (ACT, BOX):
        algo = _algo(cls, space)
        action, extras, _ = algo.act(np.zeros((5, 3), np.float32))
        assert action.shape == (5, *space.shape) and extras["logp"].shape == (5,)
        with torch.no_grad():
            dist = algo.model.distribution(algo.model(torch.zeros(1, 5, 3))[0][0])
            logp = dist.log_prob(torch.as_tensor(action))
        np.testing.assert_allclose(extras["logp"], logp.numpy(), rtol=1e-6)


def test_defaults_follow_their_references():
    a3c, ppo_cfg = A3CConfig(), PPOConfig()
    assert (a3c.unroll_length, a3c.lr, a3c.eps, a3c.rmsprop_decay) == (5, 3e-4, 0.1, 0.99)
    assert (a3c.optimizer, a3c.grad_clip, a3c.reward_clip) == ("rmsprop_tf", None, None)
    assert (a3c.entropy_cost, a3c.log_epsilon, a3c.lr_schedule) == (0.01, 1e-6, "constant")
    assert (ppo_cfg.unroll_length, ppo_cfg.batch_size, ppo_cfg.lr) == (128, 4, 2.5e-4)
    assert (ppo_cfg.epochs, ppo_cfg.num_minibatches, ppo_cfg.grad_clip) == (4, 4, 0.5)


@pytest.mark.parametrize(("algo", "frames"), [(FAST_A3C, 25_000), (FAST_PPO, 20_000)])
def test_learns_cartpole_on_the_local_architecture(tmp_path, algo, frames):
    result = Platform(
        arch="local",
        algo=algo,
        env={"id": "CartPole-v1", "num_envs": 16},
        run={"stop": {"env_frames": frames}, "display": "none", "logdir": str(tmp_path)},
    ).fit()
    assert result.metrics["episode_return_mean"] >= 66  # random play: about 22
    for key in ("loss", "pg_loss", "baseline_loss", "entropy", "grad_norm"):
        assert np.isfinite(result.metrics[key]), key


# -- separate value torso ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["ppo", "a3c", "vtrace"])
def test_separate_value_torso_keeps_value_gradients_out_of_the_policy(name):
    """model.shared_torso=false (CleanRL's continuous PPO): the value loss moves only the
    value torso and head, the policy loss only the policy torso and head."""
    cls = ALGORITHMS[name]
    torch.manual_seed(0)
    model = ModelConfig(hidden=[16], shared_torso=False)
    algo = cls(cls.config_cls(), OBS, BOX, model)
    assert algo.model.value_torso is not None
    params, values = algo.model(torch.randn(2, 3, 3))
    assert params.shape == (2, 3, 4) and values.shape == (2, 3)
    values.sum().backward()
    for prefix, touched in (("torso.", False), ("policy.", False), ("value_torso.", True)):
        grads = [p.grad for k, p in algo.model.named_parameters() if k.startswith(prefix)]
        assert grads and all((g is not None and bool(g.any())) == touched for g in grads), prefix
    metrics, _ = _frozen_update(algo, _batch(action_space=BOX))  # every loss runs
    assert all(math.isfinite(v) for v in metrics.values())


def test_separate_value_torso_is_refused_beside_an_lstm_core():
    from rlfabric.errors import SpecError

    with pytest.raises(SpecError, match=r"model.shared_torso=false .*model.lstm=16.*allowed"):
        Platform(
            arch="local", algo="ppo", env="CartPole-v1", model={"shared_torso": False, "lstm": 16}
        )


@pytest.mark.parametrize("cls", [A3C, PPO])
def test_entropy_cost_anneals_over_its_frames(cls):
    """The loss weighs the entropy by the annealed cost (`algo.entropy_decay_frames`):
    at frame 0 the full cost, half-way half, past the end none."""
    batch = _batch()
    losses, entropies = [], []
    for frames in (0, 500, 1000):
        algo = _algo(cls, entropy_cost=0.5, entropy_decay_frames=1000)
        algo.set_progress(frames, None)
        metrics, _ = _frozen_update(algo, batch)
        assert metrics["entropy_cost"] == pytest.approx(0.5 * (1 - frames / 1000))
        losses.append(metrics["loss"])
        entropies.append(metrics["entropy"])
    assert entropies[0] == pytest.approx(entropies[2])  # same weights, same batch
    # loss = rest - cost * entropy_term: equal steps in cost, equal steps in loss
    assert losses[1] - losses[0] == pytest.approx(losses[2] - losses[1], rel=1e-4)
    assert losses[2] - losses[0] > 0  # less bonus, a larger loss
