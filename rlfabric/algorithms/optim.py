"""RMSProp as TensorFlow 1 computes it, for the settings of the papers that used it.

IMPALA (scalable_agent) and GA3C trained with `tf.train.RMSPropOptimizer`, and
their epsilons (0.01, 0.1) are TF's. Two things differ from `torch.optim.RMSprop`:

- TF adds epsilon *inside* the square root: the step is lr * g / sqrt(ms + eps).
  torch adds it outside, lr * g / (sqrt(ms) + eps). A parameter whose gradients
  are small (sqrt(ms) << sqrt(eps)) moves by lr * g / sqrt(eps) in TF, and by up
  to 1/sqrt(eps) times more in torch with the same eps: 10x for IMPALA's 0.01.
- TF starts the mean square at 1, torch at 0. torch's first steps are therefore
  about lr / sqrt(1 - decay) = 10 lr per parameter, in the gradient's sign, for
  every parameter at once; TF's start at lr * g and grow as the mean square
  settles over a few hundred steps.

With the papers' values under torch's rules, a Nature-CNN on Pong lost most of
its ReLU units in the first updates (docs/experiments/atari-pong.md, "Pong with SEED + V-trace").
Stable-Baselines3 ships the same optimizer (`RMSpropTFLike`) for its A2C.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import ClassVar

import torch


class RMSpropTF(torch.optim.Optimizer):
    """TF1's RMSProp: ms = decay ms + (1 - decay) g^2, starting at 1;
    mom = momentum mom + lr g / sqrt(ms + eps); p -= mom."""

    #: Per-element state a fresh parameter starts with, where it is not 0: a sparse
    #: trainer resets regrown connections to these (`rlfabric.sparse.SparseTrainer`).
    initial_state: ClassVar[Mapping[str, float]] = MappingProxyType({"square_avg": 1.0})

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        alpha: float = 0.99,
        eps: float = 1e-10,
        momentum: float = 0.0,
    ) -> None:
        if not (lr >= 0.0 and 0.0 < alpha < 1.0 and eps > 0.0 and momentum >= 0.0):
            raise ValueError(f"RMSpropTF: lr {lr}, alpha {alpha}, eps {eps}, momentum {momentum}")
        super().__init__(params, {"lr": lr, "alpha": alpha, "eps": eps, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, alpha, eps, momentum = group["lr"], group["alpha"], group["eps"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)  # as torch's optimizers count
                    state["square_avg"] = torch.full_like(p, self.initial_state["square_avg"])
                    if momentum:
                        state["momentum_buffer"] = torch.zeros_like(p)
                state["step"] += 1
                square_avg = state["square_avg"]
                square_avg.mul_(alpha).addcmul_(p.grad, p.grad, value=1.0 - alpha)
                step = p.grad / square_avg.add(eps).sqrt_()
                if momentum:
                    step = state["momentum_buffer"].mul_(momentum).add_(step, alpha=lr)
                    p.sub_(step)
                else:
                    p.add_(step, alpha=-lr)
