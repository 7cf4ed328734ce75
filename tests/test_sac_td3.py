"""SAC and TD3: targets and losses against hand computations, update schedule, spaces,
checkpoints, and a small Pendulum learning check without the platform."""

from __future__ import annotations

import io
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from rlfabric.algorithms import ALGORITHMS
from rlfabric.algorithms.offpolicy import polyak
from rlfabric.algorithms.sac import SAC, SACConfig
from rlfabric.algorithms.td3 import TD3, TD3Config
from rlfabric.models import ModelConfig
from rlfabric.runtime.replay import ReplayBuffer

OBS = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
ACT = gym.spaces.Box(np.array([-1.0, 0.0], np.float32), np.array([3.0, 1.0], np.float32))


def make(cls: type, **cfg: object) -> SAC | TD3:
    torch.manual_seed(0)
    algo = cls(cls.config_cls(hidden=[4], **cfg), OBS, ACT, ModelConfig())
    # Targets that differ from the online networks, so a test sees which one is used.
    with torch.no_grad():
        for key, net in algo.networks.items():
            if key.endswith("_target"):
                for p in net.parameters():
                    p.normal_()
    return algo


def np_mlp(net: nn.Sequential, x: np.ndarray) -> np.ndarray:
    """The hand computation: Linear -> ReLU -> Linear from the raw weights."""
    w1, b1 = net[0].weight.detach().numpy(), net[0].bias.detach().numpy()
    w2, b2 = net[2].weight.detach().numpy(), net[2].bias.detach().numpy()
    return np.maximum(x @ w1.T + b1, 0) @ w2.T + b2


def np_q(critic: nn.Module, member: int, obs: np.ndarray, action: np.ndarray) -> np.ndarray:
    """Q of one member of an `EnsembleQ` critic (weights [N, in, out]) from its raw weights."""
    (w1, b1), (w2, b2) = (
        (layer.weight[member].detach().numpy(), layer.bias[member, 0].detach().numpy())
        for layer in critic.layers
    )
    x = np.concatenate([obs, action], -1)
    return (np.maximum(x @ w1 + b1, 0) @ w2 + b2)[:, 0]


def replay_batch(b: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.normal(size=(b, 3)).astype(np.float32),
        "action": rng.uniform(ACT.low, ACT.high, (b, 2)).astype(np.float32),
        "reward": rng.normal(size=b).astype(np.float32),
        "next_obs": rng.normal(size=(b, 3)).astype(np.float32),
        "discount": np.array([0.99, 0.0, 0.99**3, 0.99, 0.0, 0.99], np.float32)[:b],
    }


def tensors(batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.as_tensor(batch[k]) for k in ("reward", "next_obs", "discount"))


def test_td3_target_with_smoothing_matches_hand_computation() -> None:
    algo = make(TD3)
    batch = replay_batch()
    noise = np.array([[0.7, -0.1], [-0.9, 0.3], [0.0, 0.0], [0.2, -0.6], [0.5, 0.1], [-0.3, 2]])
    y = algo.target(*tensors(batch), torch.as_tensor(noise, dtype=torch.float32)).numpy()

    s2 = batch["next_obs"]
    mu = np.tanh(np_mlp(algo.actor_target.net, s2))
    a2 = np.clip(mu + np.clip(noise, -0.5, 0.5), -1, 1)
    q = np.minimum(np_q(algo.critic_target, 0, s2, a2), np_q(algo.critic_target, 1, s2, a2))
    expected = batch["reward"] + batch["discount"] * q
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    # Terminal transitions (discount 0) do not bootstrap; gamma is not applied twice.
    terminal = batch["discount"] == 0
    np.testing.assert_allclose(y[terminal], batch["reward"][terminal], rtol=1e-6)


def np_sac_sample(algo: SAC, obs: np.ndarray, eps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """a = tanh(mean + std * eps) and log pi(a|s) from the raw weights (SAC appendix C)."""
    out = np_mlp(algo.actor.net, obs)
    mean, raw = out[:, :2], out[:, 2:]
    log_std = -5 + 0.5 * 7 * (np.tanh(raw) + 1)
    x = mean + np.exp(log_std) * eps
    action = np.tanh(x)
    normal = -0.5 * ((x - mean) / np.exp(log_std)) ** 2 - log_std - 0.5 * np.log(2 * np.pi)
    return action, (normal - np.log(1 - action**2)).sum(-1)


def test_sac_target_and_alpha_loss_match_hand_computation() -> None:
    """The soft n-step target: the folded reward, the entropy of every intermediate state
    of the fold (gamma^k (-alpha log pi(a_k|s_{t+k})), k = 1..m-1; RLx2's SAC), and the
    bootstrap's soft value."""
    algo = make(SAC, alpha_init=0.5)
    batch = replay_batch()
    g = 0.99
    # Fold lengths 1, 2 (terminated), 3, 1, 3 (terminated), 1, matching the discounts.
    mid_discount = np.array([[0, 0], [g, 0], [g, g**2], [0, 0], [g, g**2], [0, 0]], np.float32)
    rng = np.random.default_rng(1)
    mid_obs = rng.normal(size=(6, 2, 3)).astype(np.float32)
    eps = rng.normal(size=(6, 2)).astype(np.float32)
    mid_eps = rng.normal(size=(6, 2, 2)).astype(np.float32)
    y = algo.target(
        *tensors(batch),
        torch.as_tensor(eps),
        mid_obs=torch.as_tensor(mid_obs),
        mid_discount=torch.as_tensor(mid_discount),
        mid_eps=torch.as_tensor(mid_eps),
    ).numpy()

    s2 = batch["next_obs"]
    a2, logp = np_sac_sample(algo, s2, eps)
    q = np.minimum(np_q(algo.critic_target, 0, s2, a2), np_q(algo.critic_target, 1, s2, a2))
    entropy = np.zeros(6)
    for k in range(2):
        _, mid_logp = np_sac_sample(algo, mid_obs[:, k], mid_eps[:, k])
        entropy += mid_discount[:, k] * -0.5 * mid_logp
    expected = batch["reward"] + entropy + batch["discount"] * (q - 0.5 * logp)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    assert np.abs(entropy).min() == 0 and np.abs(entropy[mid_discount[:, 0] > 0]).min() > 0

    # J(alpha) = -alpha (log pi + target_entropy), target entropy -|A| = -2.
    logp_t = torch.tensor([1.0, 3.0])
    assert algo.target_entropy == -2.0
    loss = algo.alpha_loss(logp_t)
    assert loss.item() == pytest.approx(-0.5 * ((1 - 2) + (3 - 2)) / 2)
    # Entropy below target (log pi > 2) must raise alpha.
    before = algo.alpha.item()
    algo.gradient_step(algo.optimizers["alpha"], algo.alpha_loss(torch.tensor([5.0, 5.0])))
    assert algo.alpha.item() > before


def test_fixed_alpha_stays_put() -> None:
    """`learn_alpha: false` is SB3's numeric ent_coef: alpha is alpha_init after updates."""
    algo = make(SAC, alpha_init=0.1, learn_alpha=False, batch_size=6)
    for _ in range(3):
        metrics = algo.update(replay_batch())
    assert algo.alpha.item() == pytest.approx(0.1)
    assert metrics["alpha"] == pytest.approx(0.1) and "alpha_loss" not in metrics


def test_update_uses_batch_discount_without_bootstrap_at_termination() -> None:
    for cls in (SAC, TD3):
        algo = make(cls)
        batch = replay_batch()
        batch["discount"][:] = 0.0
        metrics = algo.update(batch)
        assert metrics["target_mean"] == pytest.approx(batch["reward"].mean(), abs=1e-6)


def test_td3_actor_and_targets_update_every_policy_freq() -> None:
    algo = make(TD3, policy_freq=2)
    batch = replay_batch()

    def snapshot(net: nn.Module) -> list[torch.Tensor]:
        return [p.detach().clone() for p in net.parameters()]

    for step in range(1, 7):
        actor, target = snapshot(algo.actor), snapshot(algo.critic_target)
        critic = snapshot(algo.critic)
        metrics = algo.update(batch)
        delayed = step % 2 == 0
        assert ("actor_loss" in metrics) == delayed
        changed = [
            any(not torch.equal(a, b) for a, b in zip(old, net.parameters(), strict=True))
            for old, net in (
                (actor, algo.actor),
                (target, algo.critic_target),
                (critic, algo.critic),
            )
        ]
        assert changed == [delayed, delayed, True], step


def test_polyak_soft_update() -> None:
    source, target = nn.Linear(2, 1), nn.Linear(2, 1)
    s = [p.detach().clone() for p in source.parameters()]
    t = [p.detach().clone() for p in target.parameters()]
    polyak(target, source, 0.005)
    for new, old, src in zip(target.parameters(), t, s, strict=True):
        torch.testing.assert_close(new.detach(), 0.995 * old + 0.005 * src)


@pytest.mark.parametrize("cls", [SAC, TD3])
def test_actions_within_asymmetric_bounds(cls: type) -> None:
    algo = make(cls)
    with torch.no_grad():
        for p in algo.actor.parameters():
            p.mul_(50)  # saturate the tanh
    obs = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    for deterministic in (False, True):
        action, extras, state = algo.act(obs, deterministic=deterministic)
        assert state is None and action.shape == (64, 2)
        for a in (action, extras["policy_action"]):
            assert np.all(a >= ACT.low) and np.all(a <= ACT.high)
    assert np.abs(action - extras["policy_action"]).max() == 0  # deterministic: the policy's own
    unit = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]])
    np.testing.assert_allclose(algo.to_env(unit).numpy(), [[-1, 0], [3, 1], [1, 0.5]])
    torch.testing.assert_close(algo.from_env(algo.to_env(unit)), unit)


@pytest.mark.parametrize("cls", [SAC, TD3])
def test_a_space_with_read_only_bounds_builds_without_warnings(cls: type) -> None:
    """An action space that came through Ray holds read-only arrays (IMPALA's runners);
    wrapping them made torch warn in every TD3 run under IMPALA."""
    space = gym.spaces.Box(ACT.low.copy(), ACT.high.copy(), dtype=np.float32)
    space.low.setflags(write=False)
    space.high.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        algo = cls(cls.config_cls(hidden=[4]), OBS, space, ModelConfig())
    np.testing.assert_allclose(algo.action_scale.numpy(), (ACT.high - ACT.low) / 2)


@pytest.mark.parametrize("name", ["sac", "td3"])
def test_refuses_discrete_and_unbounded_actions(name: str) -> None:
    cls = ALGORITHMS[name]
    assert cls.data == "replay"
    with pytest.raises(ValueError, match=f"'{name}' cannot act in action space Discrete.*Box"):
        cls.check_spaces(OBS, gym.spaces.Discrete(3))
    with pytest.raises(ValueError, match="finite bounds"):
        cls.check_spaces(OBS, gym.spaces.Box(-np.inf, np.inf, (2,)))
    with pytest.raises(ValueError, match="Discrete"):
        cls(cls.config_cls(), OBS, gym.spaces.Discrete(3), ModelConfig())
    # A dimension with low == high has no half range to scale by.
    flat = gym.spaces.Box(np.array([-1.0, 0.5], np.float32), np.array([1.0, 0.5], np.float32))
    with pytest.raises(ValueError, match=r"low < high.*dimension 1: low=0\.5, high=0\.5"):
        cls.check_spaces(OBS, flat)


def test_config_defaults_and_delayed_n_step() -> None:
    for cfg in (SACConfig(), TD3Config()):
        assert (cfg.lr, cfg.batch_size, cfg.gamma, cfg.tau) == (3e-4, 256, 0.99, 0.005)
        assert (cfg.hidden, cfg.warmup_steps, cfg.lr_schedule) == ([256, 256], 5_000, "constant")
        assert (cfg.updates_per_step, cfg.n_step, cfg.n_step_after) == (1.0, 1, 0)
    algo = make(TD3, n_step=3, n_step_after=2)
    batch = replay_batch()
    assert algo.n_step == 1
    algo.update(batch)
    assert algo.n_step == 1
    algo.update(batch)
    assert algo.n_step == 3


@pytest.mark.parametrize("cls", [SAC, TD3])
def test_state_dict_round_trip_weights_only(cls: type) -> None:
    algo, fresh = make(cls), make(cls)
    batch = replay_batch()
    for _ in range(3):
        algo.update(batch)
    buffer = io.BytesIO()
    torch.save(algo.state_dict(), buffer)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.updates == 3
    for key, net in algo.networks.items():
        for a, b in zip(net.parameters(), fresh.networks[key].parameters(), strict=True):
            torch.testing.assert_close(a, b)
    # Optimizer moments, counters and alpha came along: the next updates are identical.
    for a in (algo, fresh):
        torch.manual_seed(1)
        a.metrics = [a.update(batch) for _ in range(2)]
    assert algo.metrics == fresh.metrics
    # get_weights is the actor only (no normalizer here): what an env runner acts with.
    assert set(algo.get_weights()) == {f"actor.{k}" for k in algo.actor.state_dict()}


def pendulum_returns(name: str, steps: int, seed: int = 0) -> list[float]:
    """Hand-written loop: one env, the algorithm and the ReplayBuffer; no platform."""
    torch.manual_seed(seed)
    env = gym.make("Pendulum-v1")
    env.action_space.seed(seed)
    cls = ALGORITHMS[name]
    # Smaller nets and a higher lr than the defaults so that it learns in seconds on a CPU.
    cfg = cls.config_cls(hidden=[64, 64], batch_size=128, lr=1e-3, warmup_steps=1000)
    algo = cls(cfg, env.observation_space, env.action_space, ModelConfig())
    buffer = ReplayBuffer.from_spaces(
        env.observation_space, env.action_space, steps, gamma=cfg.gamma, seed=seed
    )
    obs, _ = env.reset(seed=seed)
    returns, episode = [], 0.0
    for t in range(steps):
        warm = t < cfg.warmup_steps
        action = env.action_space.sample() if warm else algo.act(obs[None])[0][0]
        next_obs, reward, terminated, truncated, _ = env.step(action)
        buffer.add(
            obs[None],
            action[None],
            np.array([reward]),
            np.array([terminated]),
            np.array([truncated]),
            next_obs[None],
        )
        episode += float(reward)
        obs = next_obs
        if terminated or truncated:
            returns.append(episode)
            episode = 0.0
            obs, _ = env.reset()
        if t >= cfg.warmup_steps:
            algo.update(buffer.sample(cfg.batch_size))
    return returns


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny networks: threads only add overhead
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_sac_learns_pendulum(one_thread: None) -> None:
    """Random play scores about -1200 to -1500 per 200-step episode.

    In the slow suite, as TD3's: the default suite's SAC learning check is
    `test_seed_learns_pendulum` (the same algorithm through the platform, under SEED)."""
    returns = pendulum_returns("sac", 4600)
    assert np.mean(returns[-4:]) > -900, returns


@pytest.mark.slow
def test_td3_learns_pendulum(one_thread: None) -> None:
    returns = pendulum_returns("td3", 8000)
    assert np.mean(returns[-4:]) > -900, returns


def test_td3_ou_noise_is_carried_per_env_and_restarts_with_episodes() -> None:
    # SB3's OrnsteinUhlenbeckActionNoise: x' = x - theta x dt + sigma sqrt(dt) N(0, 1).
    algo = make(TD3, exploration="ou", exploration_noise=0.3, ou_theta=0.5, ou_dt=0.1)
    assert algo.initial_state(3) is None  # the greedy policy has no memory
    x = algo.acting_state(3)
    assert x.shape == (3, 2) and not x.any()
    obs = np.zeros((3, 3), np.float32)
    first = np.array([True, False, False])
    state = np.full((3, 2), 0.2, np.float32)
    torch.manual_seed(7)
    mu = algo.actor(torch.as_tensor(obs))
    action, extras, next_state = algo.act(obs, state, first)
    torch.manual_seed(7)
    algo.actor(torch.as_tensor(obs))
    eps = torch.randn_like(mu).numpy()
    start = np.where(first[:, None], 0.0, state)
    expected = start * (1 - 0.5 * 0.1) + 0.3 * np.sqrt(0.1) * eps
    np.testing.assert_allclose(next_state, expected, rtol=1e-5, atol=1e-6)
    scaled = np.clip(mu.detach().numpy() + expected, -1.0, 1.0)
    np.testing.assert_allclose(action, algo.to_env(torch.as_tensor(scaled)).numpy(), atol=1e-5)
    np.testing.assert_allclose(extras["policy_action"], algo.to_env(mu).detach().numpy())
    # The greedy action neither adds nor advances the noise.
    greedy, _, kept = algo.act(obs, next_state, first, deterministic=True)
    assert kept is next_state
    np.testing.assert_allclose(greedy, extras["policy_action"])


def test_td3_gaussian_noise_keeps_no_state_and_ou_noise_persists() -> None:
    gaussian = make(TD3)
    assert gaussian.acting_state(2) is None
    assert gaussian.act(np.zeros((2, 3), np.float32))[2] is None
    # Carried through the architectures' per-env states, OU noise is correlated in time:
    # with a slow reversion, after 10 steps the next step's noise is mostly this step's
    # (correlation about sqrt(10 / 11); seeded, so the draw is fixed).
    from rlfabric.runtime.acting import RecurrentStates, act_on_requests

    algo = make(TD3, exploration="ou", exploration_noise=0.5)
    states = RecurrentStates(algo.acting_state)
    request = {"key": (0, 0), "run_id": "a", "obs": np.zeros((64, 3), np.float32)}
    noise = []
    for t in range(11):
        request["is_first"] = np.full(64, t == 0)
        act_on_requests(algo.act, states, [request])
        noise.append(states.get(request).copy())
    correlation = np.corrcoef(noise[-2].ravel(), noise[-1].ravel())[0, 1]
    assert correlation > 0.85, correlation
    # A restarted runner (new run id) starts from fresh noise.
    assert not states.get({**request, "run_id": "b"}).any()
    # A group seen for the first time batches with one that has noise (SEED stacks the
    # requests of several groups): each keeps its own, the new one from zero.
    other = {"key": (0, 1), "run_id": "a", "obs": np.zeros((64, 3), np.float32)}
    other["is_first"] = request["is_first"] = np.zeros(64, bool)
    before = states.get(request).copy()
    acted = act_on_requests(algo.act, states, [request, other])
    np.testing.assert_array_equal(acted[0].state, before)
    assert not acted[1].state.any()
