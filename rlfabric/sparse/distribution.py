"""Per-layer densities for a global sparsity: Erdős–Rényi(-Kernel) or uniform.

ERK (RigL, Evci et al. 2020, arXiv 1911.11134, §3 "Sparsity distribution") gives layer
``l`` with weight shape ``(O, I)`` (Linear) or ``(O, I/groups, kh, kw)`` (Conv) the density

    d_l = eps * sum(shape_l) / prod(shape_l)
        = eps * (I + O) / (I * O)                       (Linear, Erdős–Rényi)
        = eps * (I + O + kh + kw) / (I * O * kh * kw)   (Conv, the "Kernel" variant)

with one scale ``eps`` solved so that the non-zeros add up to the global budget
``sum_l d_l * n_l = (1 - S) * sum_l n_l``. A layer whose ``d_l`` would exceed 1 is made
dense and ``eps`` is solved again over the remaining layers, until none exceeds 1
(RigL's ``sparse_utils.get_sparsities``; RLx2, arXiv 2205.15043, ``DST/DST_Scheduler.py``
``sparse_set``). No layer is special-cased: as in RLx2, ERK alone decides, and small layers
such as a critic's scalar output or a narrow input layer end up dense on their own.

Uniform gives every layer the density ``1 - S``.

An ensemble layer (:class:`EnsembleLayer`, e.g. twin critics as one batched matmul) holds
``members`` independent weights stacked on its leading dimension; every function here treats
each member as a layer of its own, so an ensemble gets exactly the densities, masks and
FLOPs that the same number of separate networks would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

from torch import Tensor, nn

Distribution = Literal["erk", "uniform"]
DISTRIBUTIONS: tuple[str, ...] = ("erk", "uniform")
SPARSIFIABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@runtime_checkable
class EnsembleLayer(Protocol):
    """A layer of ``members`` independent networks: ``weight[i]`` is member ``i``'s weight
    and its output is ``[members, batch, ..., out_features]``."""

    members: int
    out_features: int
    weight: Tensor


def sparsifiable_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every Linear/Conv/ensemble sub-module, named as in ``named_modules``: the layers to mask."""
    return [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, (*SPARSIFIABLE, EnsembleLayer))
    ]


def member_shapes(layer: nn.Module) -> list[tuple[int, ...]]:
    """The weight shape of each member: what ERK sees as one layer."""
    shape = tuple(layer.weight.shape)
    return [shape[1:]] * layer.members if isinstance(layer, EnsembleLayer) else [shape]


def layer_densities(
    shapes: Sequence[Sequence[int]], sparsity: float, distribution: Distribution = "erk"
) -> list[float]:
    """Density (fraction of weights kept) of each layer for a global ``sparsity`` in [0, 1)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    if distribution == "uniform":
        return [1.0 - sparsity] * len(shapes)

    numels = [math.prod(shape) for shape in shapes]
    raw = [sum(shape) / n for shape, n in zip(shapes, numels)]
    budget = (1.0 - sparsity) * sum(numels)
    dense: set[int] = set()
    while True:
        rest = [i for i in range(len(shapes)) if i not in dense]
        if not rest:
            return [1.0] * len(shapes)
        eps = (budget - sum(numels[i] for i in dense)) / sum(raw[i] * numels[i] for i in rest)
        # Making an over-full layer dense frees budget, so eps only grows and every layer
        # over 1 now stays over 1: all of them can be fixed at once.
        over = {i for i in rest if eps * raw[i] > 1.0}
        if not over:
            return [1.0 if i in dense else eps * raw[i] for i in range(len(shapes))]
        dense |= over


def layer_active_counts(
    shapes: Sequence[Sequence[int]], sparsity: float, distribution: Distribution = "erk"
) -> list[int]:
    """Number of active weights per layer; the total is exactly ``round((1 - S) * total)``.

    ``d_l * n_l`` is rarely an integer: each layer gets its floor and the leftover units go
    to the layers with the largest fractional parts (largest-remainder apportionment), so
    every layer is within one weight of its density and the global sparsity is exact.
    """
    densities = layer_densities(shapes, sparsity, distribution)
    numels = [math.prod(shape) for shape in shapes]
    exact = [d * n for d, n in zip(densities, numels)]
    counts = [min(math.floor(x), n) for x, n in zip(exact, numels)]
    leftover = round((1.0 - sparsity) * sum(numels)) - sum(counts)
    by_remainder = sorted(range(len(shapes)), key=lambda i: counts[i] - exact[i])
    for i in [i for i in by_remainder if counts[i] < numels[i]][: max(leftover, 0)]:
        counts[i] += 1
    return counts
