"""RLx2 sparse training wrapped around every algorithm: exact sparsity through updates,
topology updates inside `update()`, TD3's delayed actor, metrics, checkpoints, errors."""

from __future__ import annotations

import io

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlfabric.algorithms import ALGORITHMS, Algorithm
from rlfabric.errors import SpecError
from rlfabric.models import ModelConfig
from rlfabric.platform.spec import ExperimentSpec
from rlfabric.sparse import SparseConfig
from rlfabric.sparse.distribution import sparsifiable_layers

PENDULUM = gym.make("Pendulum-v1")
CARTPOLE = gym.make("CartPole-v1")
OFF_POLICY = ("sac", "td3")
ON_POLICY = ("vtrace", "ppo")
T, B = 5, 4


def sparse_cfg(name: str, **kw: object) -> SparseConfig:
    """90/85 as RLx2's TD3 HalfCheetah (Table 2); on-policy algorithms have the actor only."""
    if name in OFF_POLICY:
        return SparseConfig(**{"actor": 0.9, "critic": 0.85, **kw})
    return SparseConfig(**{"actor": 0.8, **kw})


def make(name: str, sparse: SparseConfig | None = None, seed: int = 0, **algo: object) -> Algorithm:
    torch.manual_seed(seed)
    cls = ALGORITHMS[name]
    env = PENDULUM if name in OFF_POLICY else CARTPOLE
    agent = cls(cls.config_cls(**algo), env.observation_space, env.action_space, ModelConfig())
    if sparse is not None:
        agent.sparsify(sparse, total_updates=100, seed=seed)
    return agent


def batch(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if name in OFF_POLICY:
        n = 16
        return {
            "obs": rng.normal(size=(n, 3)).astype(np.float32),
            "action": rng.uniform(-2.0, 2.0, (n, 1)).astype(np.float32),
            "reward": rng.normal(size=n).astype(np.float32),
            "next_obs": rng.normal(size=(n, 3)).astype(np.float32),
            "discount": np.full(n, 0.99, np.float32),
        }
    terminated = np.zeros((T, B), bool)
    terminated[1, 0] = True
    is_first = np.zeros((T + 1, B), bool)
    is_first[3, 0] = True
    return {
        "obs": rng.normal(size=(T + 1, B, 4)).astype(np.float32),
        "is_first": is_first,
        "action": rng.integers(0, 2, size=(T, B)),
        "reward": rng.normal(size=(T, B)).astype(np.float32),
        "terminated": terminated,
        "truncated": np.zeros((T, B), bool),
        "logp": np.log(rng.uniform(0.3, 0.7, size=(T, B))).astype(np.float32),
        "policy_version": np.zeros((T, B), np.int64),
    }


def check_exact_sparsity(agent: Algorithm, cfg: SparseConfig, nonzero_equals_mask: bool) -> None:
    """Masked-out weights (online and target) are 0; each role keeps round((1 - S) * total)."""
    roles = agent.sparse_roles()
    for role, trainer in agent.sparse_trainers.items():
        summary = trainer.summary()
        sparsity = getattr(cfg, role)
        assert summary["active_weights"] == round((1 - sparsity) * summary["masked_weights"])
        assert agent.sparse_metrics()[f"sparsity_{role}"] == pytest.approx(summary["sparsity"])
        layers = dict(sparsifiable_layers(trainer.module))
        for name, mask in trainer.masks.items():
            weight = layers[name].weight
            assert torch.all(weight[~mask] == 0)
            nonzero = int(torch.count_nonzero(weight))
            assert nonzero == int(mask.sum()) if nonzero_equals_mask else nonzero <= mask.sum()
        for target in roles[role].targets:
            target_layers = dict(sparsifiable_layers(target))
            for name, mask in trainer.masks.items():
                assert torch.all(target_layers[name].weight[~mask] == 0)


@pytest.mark.parametrize("name", OFF_POLICY + ON_POLICY)
def test_sparsity_is_exact_through_updates(name: str) -> None:
    # delta beyond the steps taken: no topology update, so every active weight has moved.
    cfg = sparse_cfg(name, delta=1_000)
    agent = make(name, cfg)
    for role in agent.sparse_trainers.values():
        assert role.step_count == 0
    for seed in range(4):
        agent.update(batch(name, seed))
    check_exact_sparsity(agent, cfg, nonzero_equals_mask=True)
    # Env runners get the masked weights as they are: zeros where the actor is masked.
    weights = agent.get_weights()
    actor = agent.sparse_trainers["actor"]
    prefix = "actor." if name in OFF_POLICY else ""  # off-policy: the actor and normalizer
    for layer, mask in actor.masks.items():
        assert np.all(weights[f"{prefix}{layer}.weight"][~mask.numpy()] == 0)


@pytest.mark.parametrize("name", OFF_POLICY + ON_POLICY)
def test_sparsity_stays_exact_across_topology_updates(name: str) -> None:
    cfg = sparse_cfg(name, delta=2, t_end=10)
    agent = make(name, cfg)
    counts = {role: trainer.summary()["layers"] for role, trainer in agent.sparse_trainers.items()}
    for seed in range(7):
        agent.update(batch(name, seed))
    # Grown connections start at 0, so a few may still be 0: non-zeros <= mask count.
    check_exact_sparsity(agent, cfg, nonzero_equals_mask=False)
    for role, trainer in agent.sparse_trainers.items():
        assert [layer["active"] for layer in trainer.summary()["layers"]] == [
            layer["active"] for layer in counts[role]
        ]


@pytest.mark.parametrize(
    ("name", "role"), [("sac", "critic"), ("sac", "actor"), ("vtrace", "actor")]
)
def test_topology_update_inside_update_skips_the_optimizer_step(name: str, role: str) -> None:
    agent = make(name, sparse_cfg(name, delta=2, t_end=10))
    trainer = agent.sparse_trainers[role]
    agent.update(batch(name, 0))
    assert trainer.step_count == 1 and trainer.is_update_step(2)
    layers = dict(sparsifiable_layers(trainer.module))
    masks = {k: m.clone() for k, m in trainer.masks.items()}
    weights = {k: layers[k].weight.detach().clone() for k in masks}
    adam_steps = {k: int(trainer.optimizer.state[layers[k].weight]["step"]) for k in masks}

    agent.update(batch(name, 1))
    assert trainer.step_count == 2
    changed = 0
    for key, old_mask in masks.items():
        new_mask, weight = trainer.masks[key], layers[key].weight
        assert int(new_mask.sum()) == int(old_mask.sum())
        changed += int((new_mask != old_mask).sum())
        kept = old_mask & new_mask
        # No optimizer step: kept weights are untouched, dropped and grown ones are 0.
        assert torch.equal(weight[kept], weights[key][kept])
        assert torch.all(weight[~kept] == 0)
        assert int(trainer.optimizer.state[weight]["step"]) == adam_steps[key]
    assert changed > 0
    agent.update(batch(name, 2))  # an ordinary step again
    assert trainer.step_count == 3
    assert all(int(trainer.optimizer.state[layers[k].weight]["step"]) == 2 for k in masks)


def test_td3_actor_trainer_steps_once_per_policy_freq() -> None:
    agent = make("td3", policy_freq=3)
    agent.sparsify(sparse_cfg("td3", t_end=30), total_updates=None, seed=0)
    actor, critic = agent.sparse_trainers["actor"], agent.sparse_trainers["critic"]
    assert (actor.t_end, critic.t_end) == (10, 30)  # RLx2 TD3.py: actor T_end / policy_freq
    for seed in range(7):
        agent.update(batch("td3", seed))
    assert (actor.step_count, critic.step_count) == (2, 7)
    check_exact_sparsity(agent, sparse_cfg("td3"), nonzero_equals_mask=True)


def test_t_end_counts_each_roles_optimizer_steps() -> None:
    ppo = make("ppo")
    assert ppo.expected_updates(10_000) == 10_000 // (128 * 4)
    ppo.sparsify(SparseConfig(actor=0.5), total_updates=ppo.expected_updates(10_000), seed=0)
    assert ppo.sparse_trainers["actor"].t_end == 19 * 4 * 4  # epochs x minibatches per update
    vtrace = make("vtrace")
    assert vtrace.expected_updates(64_000) == 100
    sac = make("sac", warmup_steps=1_000, updates_per_step=0.5)
    assert sac.expected_updates(500) == 0
    assert sac.expected_updates(11_000) == 5_000


def test_sparse_metrics_dense_and_sparse() -> None:
    dense = make("sac").sparse_metrics()
    for role in ("actor", "critic"):
        assert dense[f"sparsity_{role}"] == 0.0
        assert dense[f"inference_flops_fraction_{role}"] == 1.0
        assert dense[f"train_flops_fraction_{role}"] == 1.0
    assert dense["params_actor"] == sum(p.numel() for p in make("sac").actor.parameters())
    assert dense["train_flops_fraction"] == dense["inference_flops_fraction"] == 1.0

    agent = make("sac", SparseConfig(actor=0.9))
    for seed in range(3):
        agent.update(batch("sac", seed))
    metrics = agent.sparse_metrics()
    assert metrics["sparsity_actor"] == pytest.approx(0.9, abs=1e-4)
    assert metrics["inference_flops_fraction_actor"] < 0.15
    assert metrics["train_flops_fraction_actor"] < 0.15
    assert metrics["params_actor"] == sum(
        int(torch.count_nonzero(p)) for p in agent.actor.parameters()
    )
    assert metrics["sparsity_critic"] == 0.0 and metrics["train_flops_fraction_critic"] == 1.0
    # The critic (dense, 2x the actor's FLOPs) dominates the overall training figure.
    assert 0.5 < metrics["train_flops_fraction"] < 1.0
    assert metrics["inference_flops_fraction"] == metrics["inference_flops_fraction_actor"]


@pytest.mark.parametrize("name", ["sac", "td3", "vtrace"])
def test_state_dict_round_trip_weights_only(name: str) -> None:
    cfg = sparse_cfg(name, delta=2, t_end=10)
    agent, fresh = make(name, cfg, seed=0), make(name, cfg, seed=1)
    for seed in range(5):
        agent.update(batch(name, seed))
    buffer = io.BytesIO()
    torch.save(agent.state_dict(), buffer)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    for role, trainer in agent.sparse_trainers.items():
        loaded = fresh.sparse_trainers[role]
        assert loaded.step_count == trainer.step_count
        for key, mask in trainer.masks.items():
            assert torch.equal(loaded.masks[key], mask)
        for a, b in zip(trainer.module.parameters(), loaded.module.parameters(), strict=True):
            assert torch.equal(a, b)
    check_exact_sparsity(fresh, cfg, nonzero_equals_mask=False)
    # Masks, weights, moments and schedule came along: the next updates match.
    for a in (agent, fresh):
        torch.manual_seed(3)
        a.after = [a.update(batch(name, 9)) for _ in range(2)]
    assert agent.after == fresh.after


@pytest.mark.parametrize("name", ["sac", "vtrace"])
def test_checkpoint_sparsity_must_match(name: str) -> None:
    dense, sparse = make(name), make(name, sparse_cfg(name))
    with pytest.raises(ValueError, match=r"checkpoint has sparse roles: none \(dense\)"):
        sparse.load_state_dict(dense.state_dict())
    with pytest.raises(ValueError, match=r"this run: none \(dense\)"):
        dense.load_state_dict(sparse.state_dict())
    other = make(name, SparseConfig(actor=0.5, critic=0.85 if name == "sac" else 0.0))
    with pytest.raises(ValueError, match=r"sparse\.actor"):
        other.load_state_dict(sparse.state_dict())


def test_critic_sparsity_needs_a_critic_role() -> None:
    with pytest.raises(ValueError, match=r"sparse.critic=0.5.*'vtrace'.*roles: actor.*share"):
        make("vtrace").sparsify(SparseConfig(critic=0.5), total_updates=10, seed=0)


def test_t_end_is_needed_without_a_budget() -> None:
    with pytest.raises(ValueError, match=r"sparse\.t_end"):
        make("sac").sparsify(SparseConfig(actor=0.9), total_updates=None, seed=0)
    agent = make("sac")
    agent.sparsify(SparseConfig(actor=0.9, t_end=50), total_updates=None, seed=0)
    assert agent.sparse_trainers["actor"].t_end == 50
    with pytest.raises(RuntimeError, match="already"):
        agent.sparsify(SparseConfig(actor=0.9, t_end=50), total_updates=None, seed=0)


def test_dense_config_leaves_the_algorithm_dense() -> None:
    agent = make("td3", SparseConfig())
    assert agent.sparse_trainers == {} and agent.state_dict()["sparse"] == {}
    agent.update(batch("td3"))


def test_spec_sparse_section() -> None:
    spec = ExperimentSpec.build({"sparse": {"actor": 0.9, "critic": 0.85}})
    assert (spec.sparse.actor, spec.sparse.critic, spec.sparse.enabled) == (0.9, 0.85, True)
    assert (spec.sparse.method, spec.sparse.delta, spec.sparse.zeta) == ("rigl", 10_000, 0.5)
    assert not ExperimentSpec.build({}).sparse.enabled
    with pytest.raises(SpecError, match=r"sparse\.actor: Input should be less than 1.*1\.0"):
        ExperimentSpec.build({}, ["sparse.actor=1.0"])
    with pytest.raises(SpecError, match=r"sparse\.method.*'rigl'.*'prune'"):
        ExperimentSpec.build({}, ["sparse.method=prune"])
    with pytest.raises(SpecError, match=r"sparse\.sparsity: unknown field; allowed here: actor"):
        ExperimentSpec.build({}, ["sparse.sparsity=0.9"])


@pytest.mark.parametrize("name", ON_POLICY)
def test_lstm_weights_count_as_dense_in_sparsity_and_flops(name: str) -> None:
    """The LSTM core is not masked: the reported sparsity and FLOP fractions count it dense."""
    torch.manual_seed(0)
    cls = ALGORITHMS[name]
    model = ModelConfig(hidden=[32], lstm=16)
    agent = cls(cls.config_cls(), CARTPOLE.observation_space, CARTPOLE.action_space, model)
    agent.sparsify(SparseConfig(actor=0.8, delta=1_000), total_updates=100, seed=0)
    agent.update(batch(name))
    weights = [p for p in agent.model.parameters() if p.ndim >= 2]
    zeros = sum(int((p == 0).sum()) for p in weights)
    metrics = agent.sparse_metrics()
    assert metrics["sparsity_actor"] == pytest.approx(zeros / sum(p.numel() for p in weights))
    assert agent.sparse_trainers["actor"].summary()["dense_weights"] == 4 * 16 * (32 + 16)
    # Per sample: 2 FLOPs per weight, each Linear's active ones, the LSTM's all (T = B = 1).
    masks = agent.sparse_trainers["actor"].masks
    linear = dict(sparsifiable_layers(agent.model))
    lstm = 2 * 4 * 16 * (32 + 16)
    dense = lstm + sum(2 * layer.weight.numel() for layer in linear.values())
    sparse = lstm + sum(2 * int(mask.sum()) for mask in masks.values())
    assert metrics["inference_flops_fraction"] == pytest.approx(sparse / dense)
