"""Torsos built from the model spec: IMPALA's deep ResNet against the paper's figure."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from rlfabric.models import ActorCritic, ModelConfig
from rlfabric.models.actor_critic import UnsupportedSpaceError, build_torso
from rlfabric.models.networks import ImpalaCNN, ResidualBlock

FRAMES = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)


def test_impala_cnn_follows_figure_3():
    torso = build_torso(FRAMES, ModelConfig(torso="impala_cnn"))
    assert isinstance(torso, ImpalaCNN) and torso.out_dim == 256
    convs = [m for m in torso.modules() if isinstance(m, nn.Conv2d)]
    # Per section: one conv, then two residual blocks of two convs each.
    assert len(convs) == 3 * (1 + 2 * 2)
    assert [c.out_channels for c in convs[::5]] == [16, 32, 32]
    assert all(c.kernel_size == (3, 3) for c in convs)
    assert sum(isinstance(m, ResidualBlock) for m in torso.modules()) == 6
    pools = [m for m in torso.modules() if isinstance(m, nn.MaxPool2d)]
    assert [(p.kernel_size, p.stride) for p in pools] == [(3, 2)] * 3
    # 84 -> 42 -> 21 -> 11 pixels, as TF's SAME padding gives; then the 256-unit layer.
    assert torso.fc[0].in_features == 32 * 11 * 11
    obs = torch.randint(0, 256, (5, 4, 84, 84), dtype=torch.uint8)
    features = torso(obs)
    assert features.shape == (5, 256) and bool((features >= 0).all())


def test_every_residual_block_is_applied():
    """Each of the six blocks changes the output when its last conv changes (TorchRL's
    ImpalaNet once left the second block of every section out)."""
    torch.manual_seed(0)
    torso = build_torso(FRAMES, ModelConfig(torso="impala_cnn", impala_features=32))
    obs = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    before = torso(obs)
    for block in [m for m in torso.modules() if isinstance(m, ResidualBlock)]:
        with torch.no_grad():
            saved = block.conv1.bias.clone()
            block.conv1.bias.add_(1.0)
            assert not torch.allclose(torso(obs), before)
            block.conv1.bias.copy_(saved)
    assert torch.equal(torso(obs), before)


def test_impala_cnn_in_an_actor_critic_trains_and_scripts():
    model = ActorCritic(FRAMES, gym.spaces.Discrete(6), ModelConfig(torso="impala_cnn"))
    obs = torch.randint(0, 256, (2, 3, 4, 84, 84), dtype=torch.uint8)  # [T, B, C, H, W]
    params, value = model(obs)
    assert params.shape == (2, 3, 6) and value.shape == (2, 3)
    (params.sum() + value.sum()).backward()
    assert all(p.grad is not None for p in model.torso.parameters())
    torch.jit.script(model.torso)  # export compiles the greedy policy with TorchScript


def test_impala_cnn_needs_image_observations():
    with pytest.raises(
        UnsupportedSpaceError,
        match=r"impala_cnn.*needs image observations \(a 3-D Box, \[C, H, W\]",
    ):
        build_torso(gym.spaces.Box(-1, 1, (8,), np.float32), ModelConfig(torso="impala_cnn"))
