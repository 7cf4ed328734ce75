"""RLx2-style dynamic sparse training around any ``nn.Module`` and its optimizer.

RLx2 (Tan et al., arXiv 2205.15043; ``DST/DST_Scheduler.py``) trains the actor and critic of
TD3/SAC sparse from scratch with RigL topology evolution (Evci et al., arXiv 1911.11134).
:class:`SparseTrainer` keeps every Linear/Conv weight masked (biases stay dense):

- Masks start from the largest ``|w|`` of the dense random init, at the per-layer densities
  of :mod:`rlfabric.sparse.distribution` (ERK or uniform).
- Weights stay dense tensors that hold exact zeros. A gradient hook returns ``grad * mask``
  so inactive weights never move, and, on the backward pass right before a RigL update,
  keeps the dense gradient that RigL grows by.
- :meth:`SparseTrainer.step` replaces ``optimizer.step()``: on a topology-update step it
  updates the masks and skips the optimizer step (RLx2); otherwise it steps the optimizer.
  Either way it re-masks the weights afterwards.
- :meth:`SparseTrainer.mask_target` re-masks a target network after each soft update.
- Weight matrices of other modules (an LSTM's) are not masked: they train dense and are
  counted as dense in the reported sparsity and FLOPs, so the figures stay true.
- An ensemble layer (``distribution.EnsembleLayer``: twin critics as one batched matmul) is
  masked member by member: each member gets its own ERK density, initial top-``|w|`` mask
  and drop/grow, exactly as the same members as separate layers would.

Usage::

    trainer = SparseTrainer(critic, critic_optimizer, sparsity=0.9, t_end=total_updates)
    critic_optimizer.zero_grad()
    loss.backward()
    trainer.step()                       # instead of critic_optimizer.step()
    soft_update(critic_target, critic, tau)
    trainer.mask_target(critic_target)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from rlfabric.sparse.distribution import (
    Distribution,
    EnsembleLayer,
    layer_active_counts,
    member_shapes,
    sparsifiable_layers,
)
from rlfabric.sparse.flops import forward_flops, training_flops
from rlfabric.sparse.topology import METHODS, Method, drop_and_grow, drop_fraction, is_update_step


@dataclass
class _Layer:
    """One masked weight: module name, parameter, bool mask, dense gradient for RigL.

    An ensemble layer stacks its members' weights on the leading dimension of ``weight``
    and ``mask``; :meth:`split` views any such tensor member by member.
    """

    name: str
    weight: nn.Parameter
    mask: Tensor
    ensemble: bool
    dense_grad: Tensor | None = None

    @property
    def sparse(self) -> bool:
        """Dense layers (ERK made them so, or sparsity 0) need no hook and no updates."""
        return int(self.mask.sum()) < self.mask.numel()

    def split(self, tensor: Tensor) -> Tensor:
        """``tensor`` (shaped like the weight) as ``[members, *member_shape]``, a view."""
        return tensor if self.ensemble else tensor.unsqueeze(0)


class SparseTrainer:
    """Masks, topology evolution and FLOP accounting for one module and its optimizer.

    Args:
        module: any ``nn.Module``; every ``nn.Linear``/``nn.Conv{1,2,3}d`` weight is masked.
        optimizer: the optimizer that updates ``module``; must hold every masked weight.
        sparsity: global fraction ``S`` of masked weights that are zero, in [0, 1).
        t_end: step after which the topology stops changing; RLx2 uses the end of training.
        distribution: per-layer densities, ``"erk"`` (RLx2, default) or ``"uniform"``.
        method: ``"rigl"`` (RLx2, default), ``"set"`` (random growth) or ``"static"``.
        delta: optimizer steps between topology updates; RLx2 default 10,000.
        zeta: initial drop fraction, cosine-annealed to 0 at ``t_end``; RLx2 default 0.5.
        seed: seeds the generator for SET's random growth (stored in :meth:`state_dict`).

    Build it after moving the module to its device: masks live beside the weights.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        sparsity: float,
        *,
        t_end: int,
        distribution: Distribution = "erk",
        method: Method = "rigl",
        delta: int = 10_000,
        zeta: float = 0.5,
        seed: int = 0,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if delta < 1 or t_end < 1:
            raise ValueError(f"delta and t_end must be >= 1, got delta={delta}, t_end={t_end}")
        if not 0.0 <= zeta <= 1.0:
            raise ValueError(f"zeta must be in [0, 1], got {zeta}")
        found = sparsifiable_layers(module)
        if not found:
            raise ValueError("module has no Linear or Conv layer to sparsify")
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [name for name, layer in found if id(layer.weight) not in owned]
        if missing:
            raise ValueError(f"optimizer does not hold the weights of {missing}")

        self.module = module
        self.optimizer = optimizer
        self.sparsity = sparsity
        self.distribution: Distribution = distribution
        self.method: Method = method
        self.delta = delta
        self.zeta = zeta
        self.t_end = t_end
        self.step_count = 0
        """Optimizer steps taken so far (update steps included): the schedule's position."""
        self._generator = torch.Generator().manual_seed(seed)
        counts = iter(
            layer_active_counts(
                [shape for _, layer in found for shape in member_shapes(layer)],
                sparsity,
                distribution,
            )
        )
        self._layers: list[_Layer] = []
        with torch.no_grad():
            for name, module_layer in found:
                weight = module_layer.weight
                ensemble = isinstance(module_layer, EnsembleLayer)
                layer = _Layer(name, weight, torch.zeros_like(weight, dtype=torch.bool), ensemble)
                for member_weight, member_mask in zip(
                    layer.split(weight), layer.split(layer.mask), strict=True
                ):
                    top = torch.topk(member_weight.abs().reshape(-1), next(counts)).indices
                    member_mask.view(-1)[top] = True
                weight.mul_(layer.mask)
                self._layers.append(layer)
        self._sparse_layers = [layer for layer in self._layers if layer.sparse]
        # A masked layer's own parameters are its weight and its bias (an ensemble's bias is
        # [members, 1, out]: 3-D, yet a bias).
        covered = {id(p) for _, layer in found for p in layer.parameters(recurse=False)}
        self.dense_weights = sum(
            p.numel() for p in module.parameters() if p.ndim >= 2 and id(p) not in covered
        )
        """Weights of modules no mask covers (e.g. LSTM cells): dense, and counted so."""
        for layer in self._sparse_layers:
            layer.weight.register_hook(partial(self._mask_grad, layer))

    @property
    def overall_sparsity(self) -> float:
        """Fraction of all the module's weights (masked or dense, biases aside) that are zero."""
        active = sum(int(layer.mask.sum()) for layer in self._layers)
        total = sum(layer.mask.numel() for layer in self._layers) + self.dense_weights
        return 1.0 - (active + self.dense_weights) / total

    @property
    def masks(self) -> dict[str, Tensor]:
        """Live bool masks by module name (dense layers all True); do not modify them."""
        return {layer.name: layer.mask for layer in self._layers}

    def grow_scores(self) -> list[Tensor]:
        """The dense gradients the coming step grows by (empty unless it is a RigL update).

        Data-parallel learners all-reduce them in place before :meth:`step`: each learner
        records only its own shard's gradient, and growing by it would let the learners'
        masks drift apart (RLx2 and RigL reduce the scores across workers).
        """
        return [layer.dense_grad for layer in self._sparse_layers if layer.dense_grad is not None]

    def is_update_step(self, t: int) -> bool:
        """Whether step ``t`` (counted from 1) updates the topology and skips the optimizer."""
        return is_update_step(t, self.method, self.delta, self.t_end)

    def drop_fraction(self, t: int) -> float:
        """The drop fraction ``zeta_t`` used at step ``t``."""
        return drop_fraction(t, self.zeta, self.t_end)

    @torch.no_grad()
    def _mask_grad(self, layer: _Layer, grad: Tensor) -> Tensor:
        """Gradient hook: keep the dense gradient before a RigL update; mask the update.

        The kept gradient mirrors what ``.grad`` accumulates: it restarts when ``.grad`` is
        None (after ``zero_grad()``), so backward passes of other losses through this module
        before the zero_grad (e.g. TD3's actor loss through the critic) are not counted.
        """
        if self.method == "rigl" and self.is_update_step(self.step_count + 1):
            if layer.dense_grad is None or layer.weight.grad is None:
                layer.dense_grad = grad
            else:
                layer.dense_grad = layer.dense_grad + grad
        return grad * layer.mask

    def step(self) -> bool:
        """Call after ``loss.backward()`` instead of ``optimizer.step()``.

        Returns True when the optimizer stepped, False on a topology-update step, where
        RLx2 skips the optimizer step. Weights are re-masked either way.
        """
        self.step_count += 1
        stepped = not self.is_update_step(self.step_count)
        if stepped:
            self.optimizer.step()
        else:
            self._update_topology(self.drop_fraction(self.step_count))
        self.apply_masks()
        for layer in self._layers:
            layer.dense_grad = None
        return stepped

    @torch.no_grad()
    def _update_topology(self, fraction: float) -> None:
        """Drop and grow ``int(fraction * active)`` connections per sparse layer (per member
        of an ensemble layer).

        ``k`` is floored as in RLx2's and RigL's code. New connections start at weight 0 and
        the optimizer state of a fresh parameter (RigL's reference resets the state; RLx2
        masks the momentum): 0, or the optimizer's `initial_state` value (TF's RMSProp
        starts its mean square at 1). The state of dropped weights is reset too, so no
        stale moment moves a zero weight. A layer with no recorded gradient (unused by the
        loss) keeps its topology.
        """
        initial = getattr(self.optimizer, "initial_state", {})
        for layer in self._sparse_layers:
            ks = [int(fraction * int(mask.sum())) for mask in layer.split(layer.mask)]
            if not any(ks):
                continue
            if self.method == "rigl":
                if layer.dense_grad is None:
                    continue
                score = layer.dense_grad.abs()
            else:
                score = torch.rand(layer.mask.shape, generator=self._generator)
                score = score.to(layer.mask.device)  # the generator is on the CPU
            new_mask = layer.mask.clone()
            for k, mask, weight, member_score, member_new in zip(
                ks,
                layer.split(layer.mask),
                layer.split(layer.weight),
                layer.split(score),
                layer.split(new_mask),
                strict=True,
            ):
                if k > 0 and not bool(mask.all()):  # a dense member is not a sparse layer
                    member_new.copy_(drop_and_grow(mask, weight, member_score, k))
            kept = layer.mask & new_mask
            layer.weight.masked_fill_(~kept, 0.0)
            for key, value in self.optimizer.state.get(layer.weight, {}).items():
                if isinstance(value, Tensor) and value.shape == layer.weight.shape:
                    value.masked_fill_(~kept, initial.get(key, 0.0))
            layer.mask.copy_(new_mask)

    @torch.no_grad()
    def apply_masks(self) -> None:
        """Zero the inactive weights of the module (e.g. after loading dense weights)."""
        for layer in self._sparse_layers:
            layer.weight.mul_(layer.mask)

    @torch.no_grad()
    def mask_target(self, target: nn.Module) -> None:
        """Apply these masks to a same-structured target network; call after every soft update.

        A Polyak average of masked weights would otherwise keep stale values where the
        online network dropped connections (RLx2 re-masks its targets the same way).
        """
        modules = dict(target.named_modules())
        for layer in self._sparse_layers:
            weight = getattr(modules.get(layer.name), "weight", None)
            if weight is None or weight.shape != layer.mask.shape:
                raise ValueError(
                    f"target has no weight shaped {tuple(layer.mask.shape)} at {layer.name!r}"
                )
            weight.mul_(layer.mask.to(weight.device))

    def flops(self, *inputs: Tensor, steps: int | None = None) -> dict[str, float]:
        """Per-sample forward and training FLOPs, dense vs sparse (see :mod:`.flops`).

        ``inputs`` is a sample batch for ``module(*inputs)``; training counts ``steps``
        optimizer steps (default ``t_end``) of this trainer's method and schedule.
        """
        forward = forward_flops(self.module, *inputs, masks=self.masks)
        steps = self.t_end if steps is None else steps
        train_dense = 3.0 * forward.dense * steps
        train_sparse = training_flops(
            forward.dense, forward.sparse, self.method, steps, self.delta, self.t_end
        )
        return {
            "forward_dense": float(forward.dense),
            "forward_sparse": float(forward.sparse),
            "forward_fraction": forward.fraction,
            "train_dense": train_dense,
            "train_sparse": train_sparse,
            "train_fraction": train_sparse / train_dense,
        }

    def summary(self) -> dict[str, Any]:
        """Per-layer shapes, densities and active counts; overall sparsity (unmasked weights,
        e.g. an LSTM's, count as dense); real non-zeros."""
        layers = [
            {
                "name": layer.name,
                "shape": list(layer.mask.shape),
                "numel": layer.mask.numel(),
                "active": int(layer.mask.sum()),
                "density": int(layer.mask.sum()) / layer.mask.numel(),
            }
            for layer in self._layers
        ]
        total = sum(layer["numel"] for layer in layers)
        active = sum(layer["active"] for layer in layers)
        params = list(self.module.parameters())
        return {
            "layers": layers,
            "masked_weights": total,
            "active_weights": active,
            "dense_weights": self.dense_weights,
            "sparsity": self.overall_sparsity,
            "parameters": sum(p.numel() for p in params),
            "nonzero_parameters": sum(int(torch.count_nonzero(p)) for p in params),
        }

    def __str__(self) -> str:
        info = self.summary()
        lines = [f"{'layer':<24} {'shape':<20} {'active':>10} {'density':>8}"]
        for layer in info["layers"]:
            shape = "x".join(map(str, layer["shape"]))
            lines.append(
                f"{layer['name']:<24} {shape:<20} {layer['active']:>10} {layer['density']:>8.4f}"
            )
        lines.append(
            f"sparsity {info['sparsity']:.4f} of {info['masked_weights']} masked and "
            f"{info['dense_weights']} unmasked weights; "
            f"{info['nonzero_parameters']} of {info['parameters']} parameters non-zero"
        )
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        """Masks, step counter and RNG state; loadable with ``torch.load(weights_only=True)``."""
        return {
            "step_count": self.step_count,
            "masks": {layer.name: layer.mask.clone() for layer in self._layers},
            "rng": self._generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore masks, schedule position and RNG; re-masks the module's weights."""
        masks = state["masks"]
        if set(masks) != {layer.name for layer in self._layers}:
            raise ValueError(f"mask names {sorted(masks)} do not match this module's layers")
        # Hooks exist only on the sparse layers, so the checkpoint must agree on which they are.
        sparse_names = {layer.name for layer in self._sparse_layers}
        loaded_sparse = {name for name, mask in masks.items() if not bool(mask.all())}
        if loaded_sparse != sparse_names:
            raise ValueError(
                f"checkpoint has sparse layers {sorted(loaded_sparse)}, "
                f"this trainer {sorted(sparse_names)}"
            )
        for layer in self._layers:
            layer.mask.copy_(masks[layer.name])
        self.step_count = int(state["step_count"])
        self._generator.set_state(state["rng"])
        self.apply_masks()
