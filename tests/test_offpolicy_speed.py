"""The speed-ups of SAC/TD3 change no math: the ensemble critic equals separate
critics (forward, gradients, sparse masks and FLOP figures), bf16 stays close to fp32 with
float32 weights and exact masks, and learners default to their CPU share of threads."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rlfabric.algorithms import ALGORITHMS, Algorithm
from rlfabric.algorithms.offpolicy_networks import EnsembleQ, SeparateQ
from rlfabric.models import ModelConfig
from rlfabric.runtime.config import ResourcesConfig, available_cpus
from rlfabric.sparse import SparseConfig, SparseTrainer

OBS = gym.spaces.Box(-np.inf, np.inf, (5,), np.float32)
ACT = gym.spaces.Box(-2.0, 2.0, (2,), np.float32)


def copy_members(ensemble: EnsembleQ, separate: SeparateQ) -> None:
    """Give the separate MLPs the ensemble's weights (nn.Linear keeps [out, in])."""
    with torch.no_grad():
        for i, net in enumerate(separate.nets):
            linears = [m for m in net if isinstance(m, torch.nn.Linear)]
            for layer, linear in zip(ensemble.layers, linears, strict=True):
                linear.weight.copy_(layer.weight[i].T)
                linear.bias.copy_(layer.bias[i, 0])


def critic_pair(hidden: list[int]) -> tuple[EnsembleQ, SeparateQ]:
    torch.manual_seed(0)
    ensemble, separate = EnsembleQ(5, 2, hidden, 2), SeparateQ(5, 2, hidden, 2)
    copy_members(ensemble, separate)
    return ensemble, separate


def member_grads(critic: torch.nn.Module) -> list[torch.Tensor]:
    """Weight and bias gradients per member, in separate-network layout."""
    if isinstance(critic, EnsembleQ):
        return [
            g
            for i in range(critic.members)
            for layer in critic.layers
            for g in (layer.weight.grad[i].T, layer.bias.grad[i, 0])
        ]
    return [p.grad for p in critic.parameters()]


def test_ensemble_critic_equals_separate_critics_forward_and_gradients() -> None:
    ensemble, separate = critic_pair([32, 32])
    obs, action, y = torch.randn(64, 5), torch.rand(64, 2) * 2 - 1, torch.randn(64)
    for critic in (ensemble, separate):
        q = critic(obs, action)
        assert q.shape == (2, 64)
        (F.mse_loss(q, y.expand_as(q), reduction="none").mean(1).sum()).backward()
    torch.testing.assert_close(ensemble(obs, action), separate(obs, action))
    torch.testing.assert_close(ensemble(obs, action, first=1), separate(obs, action, first=1))
    for a, b in zip(member_grads(ensemble), member_grads(separate), strict=True):
        torch.testing.assert_close(a, b)
    # The members are not one network twice: Q1 and Q2 differ.
    assert not torch.allclose(ensemble(obs, action)[0], ensemble(obs, action)[1])


def ensemble_masks(trainer: SparseTrainer) -> list[torch.Tensor]:
    """Member masks in separate-network order and layout."""
    masks = list(trainer.masks.values())
    return [mask[i].T for i in range(masks[0].shape[0]) for mask in masks]


def test_sparse_ensemble_masks_like_separate_critics_through_rigl_updates() -> None:
    """Per-member ERK counts, top-|w| initial masks and RigL drop/grow: the ensemble's
    member masks are the separate layers' masks, before and after topology updates."""
    ensemble, separate = critic_pair([16, 16])
    critics = (ensemble, separate)
    trainers = [
        SparseTrainer(critic, torch.optim.Adam(critic.parameters()), 0.8, t_end=50, delta=2)
        for critic in critics
    ]
    initial = {k: m.clone() for k, m in trainers[1].masks.items()}
    obs, action, y = torch.randn(32, 5), torch.rand(32, 2) * 2 - 1, torch.randn(32)
    for step in range(5):
        for a, b in zip(ensemble_masks(trainers[0]), trainers[1].masks.values(), strict=True):
            assert torch.equal(a, b), step
        for critic, trainer in zip(critics, trainers, strict=True):
            trainer.optimizer.zero_grad()
            q = critic(obs, action)
            F.mse_loss(q, y.expand_as(q), reduction="none").mean(1).sum().backward()
            trainer.step()
        copy_members(ensemble, separate)  # undo float rounding between the two layouts
    # RigL did move connections, in the members' sparse layers.
    assert not torch.equal(trainers[1].masks["nets.1.2"], initial["nets.1.2"])


def make(name: str, *, ensemble: bool = True, bf16: bool = False, seed: int = 0) -> Algorithm:
    torch.manual_seed(seed)
    cls = ALGORITHMS[name]
    cfg = cls.config_cls(hidden=[64, 64], ensemble_critics=ensemble)
    return cls(cfg, OBS, ACT, ModelConfig(precision="bf16" if bf16 else "fp32"))


def replay_batch(n: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.normal(size=(n, 5)).astype(np.float32),
        "action": rng.uniform(-2.0, 2.0, (n, 2)).astype(np.float32),
        "reward": rng.normal(size=n).astype(np.float32),
        "next_obs": rng.normal(size=(n, 5)).astype(np.float32),
        "discount": np.full(n, 0.99, np.float32),
    }


@pytest.mark.parametrize("name", ["sac", "td3"])
def test_sparse_ensemble_reports_the_figures_of_separate_critics(name: str) -> None:
    metrics = []
    for ensemble in (True, False):
        algo = make(name, ensemble=ensemble)
        algo.sparsify(SparseConfig(actor=0.9, critic=0.85), total_updates=100, seed=0)
        algo.update(replay_batch())
        counts = sorted(int(m[i].sum()) for m in masks_by_member(algo) for i in range(len(m)))
        metrics.append((counts, algo.sparse_metrics()))
    assert metrics[0][0] == metrics[1][0] and len(metrics[0][0]) == 6
    assert metrics[0][1] == metrics[1][1]
    assert metrics[0][1]["sparsity_critic"] == pytest.approx(0.85, abs=1e-4)


def masks_by_member(algo: Algorithm) -> list[torch.Tensor]:
    """The critic's masks as [members, ...] stacks (a separate layer is one member)."""
    masks = algo.sparse_trainers["critic"].masks.values()
    return [m if m.ndim == 3 else m.unsqueeze(0) for m in masks]


def critic_and_actor_grads(algo: Algorithm, batch: dict[str, np.ndarray]) -> dict[str, object]:
    """Losses and gradients of one update's critic and actor losses, noise fixed."""
    b = algo.batch_tensors(batch)
    generator = torch.Generator().manual_seed(1)
    eps = torch.randn(b["action"].shape, generator=generator)
    if algo.cfg.name == "sac":
        y = algo.target(b["reward"], b["next_obs"], b["discount"], eps)
        action, logp, _ = algo.actor.sample(b["obs"], eps)
        actor_loss = (algo.alpha * logp - algo.critic(b["obs"], action).min(0).values).mean()
    else:
        y = algo.target(b["reward"], b["next_obs"], b["discount"], 0.2 * eps)
        actor_loss = -algo.critic(b["obs"], algo.actor(b["obs"]), first=1).mean()
    q = algo.critic(b["obs"], b["action"])
    critic_loss = F.mse_loss(q, y.expand_as(q), reduction="none").mean(1).sum()
    for net in (algo.critic, algo.actor):
        net.zero_grad()
    (critic_loss + actor_loss).backward()
    grads = torch.cat([p.grad.flatten() for n in (algo.critic, algo.actor) for p in n.parameters()])
    return {"q": q.detach(), "losses": torch.stack([critic_loss, actor_loss]), "grads": grads}


@pytest.mark.parametrize("name", ["sac", "td3"])
def test_bf16_update_is_close_to_fp32_and_keeps_float32_state(name: str) -> None:
    fp32, bf16 = make(name), make(name, bf16=True)
    bf16.load_state_dict(fp32.state_dict())
    batch = replay_batch()
    ref, low = critic_and_actor_grads(fp32, batch), critic_and_actor_grads(bf16, batch)
    assert low["q"].dtype == low["losses"].dtype == torch.float32
    # bf16 really ran (8-bit mantissas) and stayed close.
    assert not torch.equal(ref["q"], low["q"])
    torch.testing.assert_close(low["q"], ref["q"], rtol=0.05, atol=0.02)
    torch.testing.assert_close(low["losses"], ref["losses"], rtol=0.05, atol=0.02)
    cosine = F.cosine_similarity(low["grads"], ref["grads"], dim=0)
    assert cosine > 0.99
    assert (low["grads"].norm() / ref["grads"].norm() - 1).abs() < 0.05
    for _ in range(2):
        bf16.update(batch)
    for net in bf16.networks.values():
        assert all(p.dtype == torch.float32 for p in net.parameters())
    for optimizer in bf16.optimizers.values():
        for state in optimizer.state.values():
            assert all(v.dtype == torch.float32 for v in state.values() if v.ndim > 0)


@pytest.mark.parametrize("name", ["sac", "td3"])
def test_masks_stay_exact_under_bf16_through_topology_updates(name: str) -> None:
    algo = make(name, bf16=True)
    algo.sparsify(SparseConfig(actor=0.9, critic=0.85, delta=2), total_updates=20, seed=0)
    roles = algo.sparse_roles()
    start = {
        r: {k: int(m.sum()) for k, m in t.masks.items()} for r, t in algo.sparse_trainers.items()
    }
    changed = False
    for step in range(6):
        before = {k: m.clone() for k, m in algo.sparse_trainers["critic"].masks.items()}
        algo.update(replay_batch(seed=step))
        for role, trainer in algo.sparse_trainers.items():
            modules = dict(roles[role].module.named_modules())
            targets = [dict(t.named_modules()) for t in roles[role].targets]
            for key, mask in trainer.masks.items():
                assert int(mask.sum()) == start[role][key]
                assert not modules[key].weight[~mask].any()
                assert all(not t[key].weight[~mask].any() for t in targets)
        after = algo.sparse_trainers["critic"].masks
        changed |= any(not torch.equal(before[k], after[k]) for k in before)
    assert changed  # the topology did update under bf16


@pytest.mark.parametrize("name", ["sac", "td3"])
def test_actor_step_computes_no_critic_weight_gradients(name: str) -> None:
    """The actor's loss runs through a frozen critic: each critic weight gets one gradient
    per update (its own loss's), and the critic trains again afterwards."""
    algo = make(name)
    calls: list[int] = []
    for p in algo.critic.parameters():
        p.register_hook(lambda grad: calls.append(1))
    for _ in range(2):  # TD3's actor steps on the second update
        algo.update(replay_batch())
    params = list(algo.critic.parameters())
    assert len(calls) == 2 * len(params)
    assert all(p.requires_grad for p in params)


def test_a_checkpoint_needs_the_critic_layout_it_was_trained_with() -> None:
    state = make("sac").state_dict()
    make("sac").load_state_dict(state)
    with pytest.raises(ValueError, match=r"algo\.ensemble_critics=False"):
        make("sac", ensemble=False).load_state_dict(state)
    networks = dict(state["networks"])
    networks["q1"] = networks.pop("critic")
    with pytest.raises(ValueError, match="q1/q2"):
        make("sac").load_state_dict({**state, "networks": networks})


def test_learner_threads_default_to_its_cpu_share() -> None:
    assert ResourcesConfig().learner_threads == 1
    assert ResourcesConfig().runner_threads == 1
    two = ResourcesConfig(learner_cpus=2.0)
    assert two.learner_threads == min(2, available_cpus()) and two.runner_threads == 1
    assert ResourcesConfig(learner_cpus=1000.0).learner_threads == available_cpus()
    assert ResourcesConfig(learner_cpus=0.25).learner_threads == 1
    set_by_user = ResourcesConfig(learner_cpus=2.0, torch_threads=3)
    assert set_by_user.learner_threads == set_by_user.runner_threads == 3


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_is_bf16_only_where_the_device_has_it(monkeypatch, native: bool) -> None:
    # 'auto' asks the device: emulated bf16 (CPUs without AVX512-BF16/AMX) is about 3x
    # slower than fp32, so there it must mean fp32, for both model families.
    from rlfabric.models import ActorCritic
    from rlfabric.models import config as model_config

    monkeypatch.setattr(model_config, "native_bf16", lambda device_type: native)
    assert model_config.runs_bf16("auto", torch.device("cpu")) is native
    assert model_config.runs_bf16("bf16", torch.device("cpu")) is True
    assert model_config.runs_bf16("fp32", torch.device("cpu")) is False
    cls = ALGORITHMS["sac"]
    sac = cls(cls.config_cls(hidden=[64, 64]), OBS, ACT, ModelConfig(precision="auto"))
    assert sac.bf16 is native
    model = ActorCritic(OBS, gym.spaces.Discrete(3), ModelConfig(precision="auto"))
    seen: list[torch.dtype] = []
    model.torso.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    model(torch.zeros(1, 4, 5))
    assert seen == [torch.bfloat16 if native else torch.float32]


def test_native_bf16_reads_the_cpu_flags_line() -> None:
    from rlfabric.models.config import cpu_flags_have_bf16, native_bf16

    line = "flags\t\t: fpu sse avx512f avx512bw avx512_vnni"
    assert not cpu_flags_have_bf16(f"processor\t: 0\n{line}\n")  # this machine's kind
    assert cpu_flags_have_bf16(f"processor\t: 0\n{line} avx512_bf16\n")
    assert cpu_flags_have_bf16(f"{line} amx_bf16 amx_tile\n")
    assert not cpu_flags_have_bf16("model name\t: avx512_bf16 engineering sample\n")
    assert not cpu_flags_have_bf16(f"{line} avx512_bf16x\n")
    assert native_bf16("mps") is False
