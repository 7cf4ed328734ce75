"""The networks of SAC and TD3: ReLU MLPs and N Q critics, optionally in bfloat16.

Critics: the clipped double Q of TD3 (Fujimoto et al. 2018, Section 4.2), which SAC
shares, needs N = 2 Q networks on the same batch. `EnsembleQ` evaluates them as one
network whose layers hold `[N, in, out]` weights and run one `torch.baddbmm` each, in
place of N small matmuls in a row: one larger kernel per layer, which keeps two CPU
threads busier (measured here: a SAC update of the default size at 6.3 ms with two
threads and separate critics, 3.7 ms with bf16 and the ensemble). `SeparateQ` loops over
N ordinary MLPs, the layout of the references, kept as the baseline that
`benchmarks/offpolicy_speed.py` compares against. Both map `(obs, action)` to Q values
`[N, B]`, and both sparsify the same way: `rlfabric.sparse` masks each ensemble member
as the layer it stands for.

Precision: with `bf16`, the matmuls of a network run under bfloat16 autocast and its
output is cast back to float32, as the on-policy torso does (`models.ActorCritic`):
weights, gradients, optimizer state and targets stay float32, and everything after
the network (tanh squashing, log-probs, targets, loss reductions) runs in float32.
Autocast is entered per forward pass, so its cache of bf16 weight copies never outlives
an optimizer step.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor, nn


def mlp(in_dim: int, hidden: list[int], out_dim: int) -> nn.Sequential:
    """ReLU MLP with PyTorch's default init, as CleanRL's SAC/TD3 and Fujimoto's TD3."""
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(in_dim, width), nn.ReLU()]
        in_dim = width
    layers.append(nn.Linear(in_dim, out_dim))
    return nn.Sequential(*layers)


def run_mixed(net: nn.Module, x: Tensor, bf16: bool) -> Tensor:
    """`net(x)` under bfloat16 autocast if `bf16`, returned in float32."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        return net(x).float()


def critic_input(obs: Tensor, action: Tensor) -> Tensor:
    """The flattened observation concatenated with the action in tanh units."""
    return torch.cat([obs.flatten(1).float(), action], dim=-1)


class EnsembleLinear(nn.Module):
    """`members` Linear layers as one: `x [N, B, in] -> bias + x @ weight`, `weight [N, in, out]`.

    Each member is initialised as `nn.Linear` is (weight and bias uniform in
    ±1/sqrt(in)). An input `[B, in]` is shared by all members. `rlfabric.sparse` sees
    `members`, `out_features` and `weight` (`sparse.distribution.EnsembleLayer`).
    """

    def __init__(self, members: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.members, self.in_features, self.out_features = members, in_features, out_features
        bound = 1.0 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(members, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(members, 1, out_features))
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor, first: int | None = None) -> Tensor:
        """All members, or the `first` ones only (TD3's actor loss reads Q1 alone)."""
        weight, bias = self.weight[:first], self.bias[:first]
        if x.dim() == 2:
            x = x.expand(weight.shape[0], *x.shape)
        return torch.baddbmm(bias, x, weight)


class EnsembleQ(nn.Module):
    """N Q networks of one shape as one stack of `EnsembleLinear` layers with ReLUs."""

    def __init__(
        self, obs_dim: int, action_dim: int, hidden: list[int], members: int, bf16: bool = False
    ) -> None:
        super().__init__()
        sizes = [obs_dim + action_dim, *hidden, 1]
        self.layers = nn.ModuleList(
            EnsembleLinear(members, i, o) for i, o in itertools.pairwise(sizes)
        )
        self.members, self.bf16 = members, bf16

    def forward(self, obs: Tensor, action: Tensor, first: int | None = None) -> Tensor:
        """Q values `[N, B]` (`[first, B]` for the first members only)."""
        x = critic_input(obs, action)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            for layer in self.layers[:-1]:
                x = torch.relu(layer(x, first))
            x = self.layers[-1](x, first)
        return x.float().squeeze(-1)


class SeparateQ(nn.Module):
    """N Q networks as N ordinary MLPs evaluated one after the other (the references' layout)."""

    def __init__(
        self, obs_dim: int, action_dim: int, hidden: list[int], members: int, bf16: bool = False
    ) -> None:
        super().__init__()
        self.nets = nn.ModuleList(mlp(obs_dim + action_dim, hidden, 1) for _ in range(members))
        self.members, self.bf16 = members, bf16

    def forward(self, obs: Tensor, action: Tensor, first: int | None = None) -> Tensor:
        """Q values `[N, B]` (`[first, B]` for the first members only)."""
        x = critic_input(obs, action)
        return torch.stack([run_mixed(net, x, self.bf16) for net in self.nets[:first]]).squeeze(-1)
