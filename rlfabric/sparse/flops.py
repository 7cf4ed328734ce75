"""Theoretical FLOPs of dense vs sparse inference and training (RigL's accounting).

Forward FLOPs per input sample count the multiply-adds of every Linear/Conv weight, two
FLOPs each (one multiply, one add), at every output position:

    Linear  2 * I * O                     (times the product of any middle dims)
    Conv    2 * (I / groups) * O * kh * kw * H_out * W_out
    sparse  the same with the layer's active weights only: 2 * active * positions
    LSTMCell  2 * (4H * I + 4H * H) per step, dense and sparse alike: no mask covers it
    ensemble  the sum over its members, each counted as the Linear it stands for

Biases, activations and normalisation are left out; they are the same few FLOPs for dense
and sparse models. These are theoretical FLOPs: masked dense matmuls run no faster
(RLx2, arXiv 2205.15043, Table 2 reports the same kind of figure).

Training FLOPs follow RigL (Evci et al. 2020, arXiv 1911.11134, Appendix H): one step costs
a forward pass ``f``, the gradient w.r.t. activations ``f`` and the gradient w.r.t. weights
``f``, so ``3 f``. Dense training costs ``3 f_D`` per step, static and SET ``3 f_S``. RigL
needs the dense weight gradient on its update steps, which then cost ``2 f_S + f_D``; with
``u`` update steps among ``T`` steps

    total = 3 f_S (T - u) + (2 f_S + f_D) u,

i.e. per step ``(3 f_S (delta - 1) + 2 f_S + f_D) / delta`` before ``t_end``: RigL's
``(3 f_S dT + 2 f_S + f_D) / (dT + 1)`` with ``dT = delta - 1`` ordinary steps between
updates (here the update step itself skips the optimizer, as in RLx2).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlfabric.sparse.distribution import EnsembleLayer, sparsifiable_layers
from rlfabric.sparse.topology import Method, update_step_count


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one layer for one input sample."""

    name: str
    dense: int
    sparse: int


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs of a module for one input sample, per layer and in total."""

    layers: list[LayerFlops]

    @property
    def dense(self) -> int:
        return sum(layer.dense for layer in self.layers)

    @property
    def sparse(self) -> int:
        return sum(layer.sparse for layer in self.layers)

    @property
    def fraction(self) -> float:
        """Sparse FLOPs as a fraction of dense."""
        return self.sparse / self.dense


def forward_flops(
    module: nn.Module, *inputs: Tensor, masks: Mapping[str, Tensor] | None = None
) -> ForwardFlops:
    """Count per-sample forward FLOPs by running ``module(*inputs)`` once.

    ``inputs`` carry a leading batch dimension (taken from the first one, or from an entry
    of it where it is a dict of tensors); counts are
    divided by it. Forward hooks read each layer's output size, so convolutions need no
    shape arithmetic and a layer called twice is counted twice. ``masks`` maps layer names
    to their masks; a layer without one counts as dense. The module runs in eval mode under
    ``no_grad`` (batch-norm statistics stay untouched) and its mode is restored.
    """
    first = inputs[0]  # dict observations: a dict of tensors, one per entry
    batch = (next(iter(first.values())) if isinstance(first, Mapping) else first).shape[0]
    masks = masks or {}
    counts: dict[str, tuple[int, int]] = {}

    def record(name: str, layer: nn.Module, output: Tensor) -> None:
        # Output units per position: an ensemble's members each have out_features.
        if isinstance(layer, EnsembleLayer):
            units = layer.weight.shape[0] * layer.out_features
        else:
            units = layer.weight.shape[0]
        positions = output.numel() // (batch * units)
        active = int(masks[name].sum()) if name in masks else layer.weight.numel()
        dense, sparse = counts.get(name, (0, 0))
        counts[name] = (
            dense + 2 * layer.weight.numel() * positions,
            sparse + 2 * active * positions,
        )

    def record_lstm(name: str, cell: nn.LSTMCell, output: tuple[Tensor, Tensor]) -> None:
        positions = output[0].numel() // (batch * cell.hidden_size)
        flops = 2 * (cell.weight_ih.numel() + cell.weight_hh.numel()) * positions
        dense, sparse = counts.get(name, (0, 0))
        counts[name] = (dense + flops, sparse + flops)

    handles = [
        layer.register_forward_hook(lambda m, _args, out, name=name: record(name, m, out))
        for name, layer in sparsifiable_layers(module)
    ] + [
        cell.register_forward_hook(lambda m, _args, out, name=name: record_lstm(name, m, out))
        for name, cell in module.named_modules()
        if isinstance(cell, nn.LSTMCell)
    ]
    was_training = module.training
    try:
        module.eval()
        with torch.no_grad():
            module(*inputs)
    finally:
        module.train(was_training)
        for handle in handles:
            handle.remove()
    return ForwardFlops([LayerFlops(name, d, s) for name, (d, s) in counts.items()])


def training_flops(
    dense_forward: float,
    sparse_forward: float,
    method: Method,
    steps: int,
    delta: int,
    t_end: int,
) -> float:
    """Total per-sample training FLOPs of ``steps`` steps (RigL Appendix H, module docstring).

    ``dense_forward``/``sparse_forward`` are ``f_D``/``f_S``; dense training is
    ``3 * dense_forward * steps``.
    """
    dense_gradient_steps = update_step_count(steps, method, delta, t_end) if method == "rigl" else 0
    ordinary_steps = steps - dense_gradient_steps
    return 3 * sparse_forward * ordinary_steps + (2 * sparse_forward + dense_forward) * (
        dense_gradient_steps
    )
