"""RLx2 dynamic sparse training: exact sparsity, ERK, RigL/SET growth, schedule, FLOPs."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from rlfabric.algorithms.optim import RMSpropTF
from rlfabric.sparse import (
    SparseTrainer,
    drop_and_grow,
    drop_fraction,
    forward_flops,
    is_update_step,
    layer_active_counts,
    layer_densities,
)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
    )


def conv_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 6 * 6, 64),
        nn.ReLU(),
        nn.Linear(64, 5),
    )


def line_layer(weights: list[float]) -> nn.Linear:
    """A one-output Linear without bias, so a loss ``x @ w`` has dense gradient ``x``."""
    layer = nn.Linear(len(weights), 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([weights]))
    return layer


# ---------------------------------------------------------------- layer densities


def test_erk_makes_over_full_layers_dense_and_keeps_the_budget() -> None:
    shapes = [(256, 4), (256, 256), (1, 256)]  # a 4-256-256-1 critic
    n = [1024, 65536, 256]
    densities = layer_densities(shapes, 0.9, "erk")
    # By hand: eps = 0.1 * 66816 / (260 + 512 + 257) = 6.49 puts the input and output layers
    # over 1; with them dense, eps = (6681.6 - 1024 - 256) / 512 over the middle layer alone.
    assert densities[0] == 1.0 and densities[2] == 1.0
    assert densities[1] == pytest.approx((6681.6 - 1024 - 256) / 512 * 512 / 65536)
    assert sum(d * k for d, k in zip(densities, n)) == pytest.approx(0.1 * sum(n))
    counts = layer_active_counts(shapes, 0.9, "erk")
    assert sum(counts) == round(0.1 * sum(n))
    assert counts[0] == 1024 and counts[2] == 256


def test_erk_over_conv_and_linear() -> None:
    net = conv_net()
    shapes = [m.weight.shape for m in net if isinstance(m, nn.Conv2d | nn.Linear)]
    numels = [math.prod(s) for s in shapes]
    sparsity = 0.8
    densities = layer_densities(shapes, sparsity, "erk")
    raw = [sum(s) / math.prod(s) for s in shapes]  # (I + O + kh + kw) / (I O kh kw)
    sparse = [i for i, d in enumerate(densities) if d < 1.0]
    scales = {densities[i] / raw[i] for i in sparse}
    eps = scales.pop()
    assert all(s == pytest.approx(eps) for s in scales)
    assert all(eps * raw[i] > 1.0 for i, d in enumerate(densities) if d == 1.0)
    assert sum(d * k for d, k in zip(densities, numels)) == pytest.approx(
        (1 - sparsity) * sum(numels)
    )

    optimizer = torch.optim.Adam(net.parameters())
    trainer = SparseTrainer(net, optimizer, sparsity, t_end=100)
    active = [int(m.sum()) for m in trainer.masks.values()]
    assert sum(active) == round((1 - sparsity) * sum(numels))
    assert all(abs(a - d * k) < 1 for a, d, k in zip(active, densities, numels))


def test_uniform_gives_every_layer_the_same_density() -> None:
    shapes = [(32, 4), (32, 32), (1, 32)]
    assert layer_densities(shapes, 0.75, "uniform") == [0.25, 0.25, 0.25]
    counts = layer_active_counts(shapes, 0.75, "uniform")
    assert counts == [32, 256, 8]


# ---------------------------------------------------------------- schedule


def test_zeta_schedule_and_update_steps() -> None:
    assert drop_fraction(0, 0.5, 1000) == pytest.approx(0.5)
    assert drop_fraction(500, 0.5, 1000) == pytest.approx(0.25)
    assert drop_fraction(250, 0.5, 1000) == pytest.approx(0.25 * (1 + math.cos(math.pi / 4)))
    assert drop_fraction(1000, 0.5, 1000) == pytest.approx(0.0)
    updates = [t for t in range(1, 60) if is_update_step(t, "rigl", 10, 50)]
    assert updates == [10, 20, 30, 40]
    assert not any(is_update_step(t, "static", 10, 50) for t in range(1, 60))


# ---------------------------------------------------------------- growth rules


def test_drop_and_grow_constructed() -> None:
    mask = torch.tensor([True, True, True, False, False, False])
    weight = torch.tensor([3.0, 0.1, 2.0, 0.0, 0.0, 0.0])
    grads = torch.tensor([0.0, 0.0, 0.0, 5.0, 1.0, 9.0])
    new = drop_and_grow(mask, weight, grads, 1)
    assert new.tolist() == [True, False, True, False, False, True]
    # A just-dropped connection with the largest gradient is regrown.
    regrow = drop_and_grow(mask, weight, torch.tensor([0.0, 20.0, 0.0, 5.0, 1.0, 9.0]), 1)
    assert regrow.tolist() == mask.tolist()


def test_rigl_grows_largest_gradient_inactive_connections_at_zero() -> None:
    layer = line_layer([4.0, 3.0, 2.0, 1.0, 0.4, 0.3, 0.2, 0.1])
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    trainer = SparseTrainer(
        layer, optimizer, 0.5, t_end=1000, distribution="uniform", delta=1, zeta=0.6
    )
    assert trainer.masks[""].tolist() == [[True] * 4 + [False] * 4]
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 5.0, 3.0, 2.0]])
    layer(x).sum().backward()
    assert not trainer.step()  # k = int(0.6 * 4 * ~1) = 2: drop w=2, 1; grow |grad| 5, 3
    assert trainer.masks[""].tolist() == [[True, True, False, False, False, True, True, False]]
    assert layer.weight.tolist() == [[4.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]


def test_dense_gradient_restarts_after_zero_grad() -> None:
    layer = line_layer([4.0, 3.0, 2.0, 1.0, 0.4, 0.3, 0.2, 0.1])
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
    trainer = SparseTrainer(
        layer, optimizer, 0.5, t_end=1000, distribution="uniform", delta=1, zeta=0.3
    )
    # Another loss's backward (TD3's actor loss through the critic) before zero_grad.
    layer(torch.tensor([[0.0] * 7 + [100.0]])).sum().backward()
    optimizer.zero_grad()
    layer(torch.tensor([[0.0] * 4 + [1.0, 0.0, 0.0, 0.0]])).sum().backward()
    trainer.step()  # k = 1: drop w=1, grow index 4 (not the polluted index 7)
    assert trainer.masks[""].tolist() == [[True, True, True, False, True, False, False, False]]


def test_set_grows_at_random() -> None:
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 5.0, 3.0, 2.0]])
    grown: list[int] = []
    for seed in range(300):
        layer = line_layer([4.0, 3.0, 2.0, 1.0, 0.4, 0.3, 0.2, 0.1])
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        trainer = SparseTrainer(
            layer, optimizer, 0.5, t_end=1000, distribution="uniform", method="set", delta=1,
            zeta=0.3, seed=seed,
        )  # fmt: skip
        layer(x).sum().backward()
        trainer.step()  # k = 1: drop index 3, grow one of the 5 inactive indices 3..7
        mask = trainer.masks[""][0]
        assert mask[:3].all() and int(mask.sum()) == 4
        grown.append(int(mask[3:].nonzero()[0, 0]) + 3)
        # A new connection starts at 0; regrowing the just-dropped index 3 undoes the drop.
        assert layer.weight[0, grown[-1]].item() == (1.0 if grown[-1] == 3 else 0.0)
    frequencies = [grown.count(i) / len(grown) for i in range(3, 8)]
    assert all(abs(f - 0.2) < 0.08 for f in frequencies), frequencies  # gradient ignored


# ---------------------------------------------------------------- training loop


def test_training_keeps_exact_sparsity_and_skips_optimizer_on_updates() -> None:
    net = mlp()
    target = copy.deepcopy(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    trainer = SparseTrainer(net, optimizer, 0.8, t_end=60, delta=5, zeta=0.5)
    counts = {name: int(m.sum()) for name, m in trainer.masks.items()}
    expected = layer_active_counts([m.shape for m in trainer.masks.values()], 0.8, "erk")
    assert list(counts.values()) == expected
    torch.manual_seed(1)
    x = torch.randn(128, 4)
    y = (x[:, :1] * 2 - x[:, 1:2]).sin()
    losses, changed = [], 0
    for t in range(1, 61):
        optimizer.zero_grad()
        loss = (net(x) - y).pow(2).mean()
        loss.backward()
        before = {name: net.get_submodule(name).weight.detach().clone() for name in counts}
        old_masks = {name: m.clone() for name, m in trainer.masks.items()}
        adam_steps = [float(s["step"]) for s in optimizer.state.values()]
        stepped = trainer.step()
        assert stepped == (t % 5 != 0 or t == 60)  # no update at t_end = 60
        for name, mask in trainer.masks.items():
            weight = net.get_submodule(name).weight
            assert int(mask.sum()) == counts[name]
            assert bool((weight[~mask] == 0).all())
            grown = mask & ~old_masks[name]
            if stepped:
                assert torch.equal(mask, old_masks[name])
                continue
            changed += int(grown.sum())
            assert torch.equal(weight, before[name] * mask)  # no optimizer step, grown at 0
            for state in optimizer.state[weight].values():
                if state.shape == weight.shape:
                    assert bool((state[grown] == 0).all())
        if not stepped:
            assert [float(s["step"]) for s in optimizer.state.values()] == adam_steps
        with torch.no_grad():
            for p_target, p in zip(target.parameters(), net.parameters()):
                p_target.lerp_(p, 0.05)
        trainer.mask_target(target)
        for name, mask in trainer.masks.items():
            assert bool((target.get_submodule(name).weight[~mask] == 0).all())
        losses.append(loss.item())
    assert changed > 0
    assert losses[-1] < 0.5 * losses[0]
    summary = trainer.summary()
    assert summary["sparsity"] == pytest.approx(0.8, abs=1e-3)
    assert summary["active_weights"] == sum(counts.values())
    nonzero = sum(int(torch.count_nonzero(p)) for p in net.parameters())
    assert summary["nonzero_parameters"] == nonzero
    assert f"sparsity {summary['sparsity']:.4f}" in str(trainer)


def test_regrown_connections_restart_from_the_optimizers_initial_state() -> None:
    """TF's RMSProp starts its mean square at 1, not 0: a regrown (or dropped) connection
    gets 1 back, so its first step is as gentle as a fresh parameter's; Adam's moments
    restart at 0."""
    for optimizer_cls, key, fresh in (
        (RMSpropTF, "square_avg", 1.0),
        (torch.optim.Adam, "exp_avg_sq", 0.0),
    ):
        net = mlp()
        optimizer = optimizer_cls(net.parameters(), lr=1e-2)
        trainer = SparseTrainer(net, optimizer, 0.8, t_end=60, delta=2, zeta=0.5)
        torch.manual_seed(1)
        x = torch.randn(64, 4)
        for _ in range(2):
            optimizer.zero_grad()
            net(x).pow(2).mean().backward()
            old_masks = {name: m.clone() for name, m in trainer.masks.items()}
            stepped = trainer.step()
        assert not stepped  # t = 2: a topology update
        changed = 0
        for name, mask in trainer.masks.items():
            state = optimizer.state[net.get_submodule(name).weight][key]
            moved = mask ^ old_masks[name]  # grown or dropped
            changed += int(moved.sum())
            assert bool((state[moved] == fresh).all()), (optimizer_cls.__name__, name)
            assert bool((state[mask & old_masks[name]] != fresh).any())  # kept: trained state
        assert changed > 0


def test_optimizer_must_hold_the_weights() -> None:
    net = mlp()
    with pytest.raises(ValueError, match="optimizer does not hold"):
        SparseTrainer(net, torch.optim.Adam(net[0].parameters()), 0.5, t_end=10)


# ---------------------------------------------------------------- FLOPs


def test_flops_against_hand_counts() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 10))
    x = torch.randn(2, 3, 8, 8)  # counts are per sample
    dense = forward_flops(net, x)
    assert [layer.dense for layer in dense.layers] == [2 * 3 * 4 * 9 * 64, 2 * 256 * 10]
    assert dense.sparse == dense.dense == 13824 + 5120

    trainer = SparseTrainer(
        net, torch.optim.SGD(net.parameters(), lr=0.1), 0.5, t_end=100, distribution="uniform",
        delta=10,
    )  # fmt: skip
    f_d, f_s = 18944, 2 * 54 * 64 + 2 * 1280  # half of 108 conv and 2560 linear weights
    flops = trainer.flops(x)
    assert flops["forward_dense"] == f_d and flops["forward_sparse"] == f_s
    assert flops["forward_fraction"] == pytest.approx(f_s / f_d)
    updates = 9  # steps 10, 20, ..., 90 (< t_end = 100) take the dense gradient
    train_sparse = 3 * f_s * (100 - updates) + (2 * f_s + f_d) * updates
    assert flops["train_dense"] == 3 * f_d * 100
    assert flops["train_sparse"] == pytest.approx(train_sparse)
    assert flops["train_fraction"] == pytest.approx(train_sparse / (3 * f_d * 100))
    net_copy = copy.deepcopy(net)
    static = SparseTrainer(
        net_copy, torch.optim.SGD(net_copy.parameters(), lr=0.1), 0.5, t_end=100,
        distribution="uniform", method="static",
    )  # fmt: skip
    assert static.flops(x)["train_fraction"] == pytest.approx(f_s / f_d)


# ---------------------------------------------------------------- checkpoints


def test_state_dict_round_trip_with_weights_only_load() -> None:
    x = torch.randn(16, 4)

    def run(trainer: SparseTrainer, net: nn.Module, steps: int) -> None:
        for _ in range(steps):
            trainer.optimizer.zero_grad()
            net(x).pow(2).mean().backward()
            trainer.step()

    net = mlp()
    trainer = SparseTrainer(
        net, torch.optim.SGD(net.parameters(), lr=0.1), 0.7, t_end=100, method="set", delta=3
    )
    run(trainer, net, 7)
    buffer = io.BytesIO()
    torch.save({"trainer": trainer.state_dict(), "net": net.state_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    net2 = mlp(seed=1)
    net2.load_state_dict(loaded["net"])
    trainer2 = SparseTrainer(
        net2, torch.optim.SGD(net2.parameters(), lr=0.1), 0.7, t_end=100, method="set", delta=3
    )
    trainer2.load_state_dict(loaded["trainer"])
    assert trainer2.step_count == 7
    assert all(torch.equal(trainer.masks[k], trainer2.masks[k]) for k in trainer.masks)
    run(trainer, net, 5)
    run(trainer2, net2, 5)
    assert all(torch.equal(trainer.masks[k], trainer2.masks[k]) for k in trainer.masks)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters()))
