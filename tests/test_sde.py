"""Generalized state-dependent exploration (`model.sde`): the Gaussian the losses score is
the one the held noise gives, the noise is held per env for its period, and the runs
that carry it as acting state train under IMPALA's runner-side acting. For the on-policy
head and for SAC's actor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sparse_algorithms import CARTPOLE, PENDULUM

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS, Algorithm
from rlfabric.algorithms.sac import SDETanhGaussianActor
from rlfabric.errors import SpecError
from rlfabric.models import ModelConfig
from rlfabric.models.networks import SDEGaussianHead


def test_held_noise_gives_the_gaussian_the_losses_score():
    torch.manual_seed(0)
    head = SDEGaussianHead(in_dim=5, action_dim=2, log_std_init=-0.5)
    with torch.no_grad():
        head.log_std.normal_(-0.5, 0.3)  # a different sigma per (feature, action)
        features = torch.randn(3, 5)
        params = head(features)
        draws = 40_000
        noise = head.sample_exploration(draws)  # one matrix per draw, each state
        actions = torch.stack([head.explore(params[i].expand(draws, -1), noise) for i in range(3)])
    dist = head.distribution(params)
    # SB3: variance = phi^2 @ sigma^2 (+ 1e-6), mean mu(s).
    expected_std = (features.square() @ head.log_std.exp().square() + 1e-6).sqrt()
    torch.testing.assert_close(dist.base_dist.scale, expected_std)
    torch.testing.assert_close(actions.mean(1), dist.mean, atol=0.02, rtol=0)
    torch.testing.assert_close(actions.std(1), expected_std, atol=0, rtol=0.02)
    assert torch.equal(head.mode(params), dist.mean)


def test_sac_actor_scores_the_squashed_gaussian_its_held_noise_gives():
    torch.manual_seed(0)
    actor = SDETanhGaussianActor(obs_dim=3, action_dim=2, hidden=[8, 5], log_std_init=-0.5)
    with torch.no_grad():
        actor.log_std.normal_(-0.5, 0.3)
        obs = torch.randn(3, 3)
        features = actor.features(obs)
        mean, log_std = actor(obs)
        draws = 40_000
        theta = actor.sample_exploration(draws)
        pre_tanh = torch.stack(
            [mean[i] + features[i].expand(draws, 1, -1).bmm(theta).squeeze(1) for i in range(3)]
        )
    expected_std = (features.square() @ actor.log_std.exp().square() + 1e-6).sqrt()
    torch.testing.assert_close(log_std.exp(), expected_std)
    torch.testing.assert_close(pre_tanh.mean(1), mean, atol=0.02, rtol=0)
    torch.testing.assert_close(pre_tanh.std(1), expected_std, atol=0, rtol=0.02)
    # The training sample: tanh(mean + std eps), scored with the tanh correction.
    eps = torch.randn(3, 2)
    action, logp, mode = actor.sample(obs, eps)
    x = mean + expected_std * eps
    normal = torch.distributions.Normal(mean, expected_std).log_prob(x)
    expected_logp = (normal - torch.log(1 - torch.tanh(x) ** 2)).sum(-1)
    torch.testing.assert_close(action, torch.tanh(x))
    torch.testing.assert_close(logp, expected_logp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mode, torch.tanh(mean))


def test_sac_actor_without_hidden_layers_explores_on_the_observation():
    actor = SDETanhGaussianActor(obs_dim=3, action_dim=2, hidden=[], log_std_init=-1.0)
    obs = torch.randn(4, 3)
    torch.testing.assert_close(actor.features(obs), obs)
    assert actor.sample_exploration(5).shape == (5, 3, 2)


def test_sac_actor_clips_its_mean_as_sb3():
    actor = SDETanhGaussianActor(obs_dim=3, action_dim=1, hidden=[4], log_std_init=-3.0)
    with torch.no_grad():
        actor.mean.bias.fill_(10.0)
    mean, _ = actor(torch.zeros(2, 3))
    assert torch.equal(mean, torch.full((2, 1), 2.0))


def make(freq: int, algo: str = "a3c", **model: object) -> Algorithm:
    torch.manual_seed(0)
    cls = ALGORITHMS[algo]
    cfg = ModelConfig(sde=True, sde_sample_freq=freq, **model)
    return cls(cls.config_cls(), PENDULUM.observation_space, PENDULUM.action_space, cfg)


def act_steps(algorithm: Algorithm, steps: int, envs: int = 2) -> np.ndarray:
    """Actions `[steps, envs]` on one fixed observation per env, the state carried."""
    obs = np.random.default_rng(0).normal(size=(envs, 3)).astype(np.float32)
    state, out = algorithm.acting_state(envs), []
    for _ in range(steps):
        action, _, state = algorithm.act(obs, state, np.zeros(envs, bool))
        out.append(action[:, 0])
    return np.array(out)


@pytest.mark.parametrize(
    ("algo", "freq", "period"),
    [("a3c", 3, 3), ("a3c", -1, 5), ("sac", 3, 3), ("sac", -1, 8)],  # -1: the unroll length
)
def test_noise_is_held_for_its_period_per_env_then_drawn_afresh(algo: str, freq: int, period: int):
    actions = act_steps(make(freq, algo), 2 * period + 1)
    # Same observation, same held noise: the same action for a whole period.
    for start in (0, period):
        block = actions[start : start + period]
        np.testing.assert_array_equal(block, np.broadcast_to(block[0], block.shape))
    assert (actions[period] != actions[0]).all() and (actions[2 * period] != actions[period]).all()
    assert actions[0, 0] != actions[0, 1]  # each env draws its own


def test_behaviour_log_prob_is_under_the_state_dependent_gaussian():
    algorithm = make(4)
    obs = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
    action, extras, state = algorithm.act(obs, algorithm.acting_state(4), np.zeros(4, bool))
    params, _ = algorithm.model(torch.as_tensor(obs)[None])
    expected = algorithm.model.distribution(params[0]).log_prob(torch.as_tensor(action))
    np.testing.assert_allclose(extras["logp"], expected.detach().numpy(), rtol=1e-5)
    assert state.shape == (4, 1 + 64 * 1)  # steps held, then the [features, actions] matrix
    greedy = algorithm.greedy_policy()(torch.as_tensor(obs))
    torch.testing.assert_close(greedy, params[0, :, :1])  # the mean: no noise


def test_sac_greedy_action_is_the_squashed_mean_and_keeps_the_noise():
    algorithm = make(4, "sac")
    obs = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
    _, _, state = algorithm.act(obs, algorithm.acting_state(4), np.zeros(4, bool))
    assert state.shape == (4, 1 + 256 * 1)
    action, extras, kept = algorithm.act(obs, state, np.zeros(4, bool), deterministic=True)
    assert kept is state
    mean, _ = algorithm.actor(torch.as_tensor(obs))
    expected = (torch.tanh(mean) * 2.0).detach().numpy()  # Pendulum's torque bound is 2
    np.testing.assert_allclose(action, expected, rtol=1e-6)
    np.testing.assert_allclose(extras["policy_action"], expected, rtol=1e-6)
    greedy = algorithm.greedy_policy()(torch.as_tensor(obs)).detach().numpy()
    np.testing.assert_allclose(greedy, expected, rtol=1e-6)


@pytest.mark.parametrize(
    ("algo", "model", "env", "match"),
    [
        ("a3c", {"sde": True}, "CartPole-v1", "sde=true explores continuous actions"),
        ("ppo", {"sde": True, "lstm": 16, "shared_torso": True}, "Pendulum-v1", "lstm=0 with sde"),
        ("td3", {"sde": True}, "Pendulum-v1", "'td3' explores with its algo.exploration"),
        ("vtrace", {"sde": True, "sde_sample_freq": 0}, "Pendulum-v1", "sde_sample_freq must"),
    ],
)
def test_what_sde_refuses_is_a_spec_error(algo: str, model: dict, env: str, match: str):
    with pytest.raises(SpecError, match=match):
        Platform(arch="local", algo=algo, env=env, model=model)


def test_a_discrete_head_is_not_touched():
    cls = ALGORITHMS["a3c"]
    plain = cls(cls.config_cls(), CARTPOLE.observation_space, CARTPOLE.action_space, ModelConfig())
    assert plain.acting_state(3) is None


def test_impala_runners_carry_the_noise_and_train(ray_session, tmp_path):
    """IMPALA holds each env's noise in its runner. The gSDE presets, SAC's included, run
    under `local` in `test_presets`; off-policy acting state under IMPALA is
    `test_td3_ou_exploration_is_carried_in_impala_actors`'s."""
    run = {"stop": {"env_frames": 1_200}, "display": "none", "logdir": str(tmp_path)}
    result = Platform(
        arch="impala",
        algo={"name": "vtrace", "unroll_length": 8, "batch_size": 4},
        env={"id": "Pendulum-v1", "num_envs": 4},
        model={"sde": True, "sde_sample_freq": 4},
        resources={"num_env_runners": 1},
        run=run,
    ).fit()
    assert result.metrics["updates"] >= 10, result.metrics
    assert np.isfinite(result.metrics["loss"])
