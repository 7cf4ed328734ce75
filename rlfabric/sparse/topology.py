"""Topology evolution schedule and the drop/grow rule of dynamic sparse training.

RLx2 (arXiv 2205.15043, §4.1 and ``DST/DST_Scheduler.py``) follows RigL (Evci et al. 2020,
arXiv 1911.11134, §3): every ``delta`` optimizer steps, until ``t_end``, each sparse layer
drops the ``k`` active weights of smallest magnitude and grows ``k`` inactive connections,
with ``k`` a cosine-annealed fraction of its active count. RigL grows where the dense
gradient is largest; SET (Mocanu et al. 2018) grows at random; static never updates.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Method = Literal["static", "set", "rigl"]
METHODS: tuple[str, ...] = ("static", "set", "rigl")


def drop_fraction(t: int, zeta: float, t_end: int) -> float:
    """``zeta_t = zeta / 2 * (1 + cos(pi * t / t_end))``: RigL eq. 1, ``zeta`` at 0, 0 at t_end."""
    return zeta / 2.0 * (1.0 + math.cos(math.pi * t / t_end))


def is_update_step(t: int, method: Method, delta: int, t_end: int) -> bool:
    """Whether optimizer step ``t`` (counted from 1) updates the topology instead.

    As in RLx2's ``DST_Scheduler.__call__``: every ``delta``-th step strictly before
    ``t_end``, never for the static method.
    """
    return method != "static" and t % delta == 0 and t < t_end


def update_step_count(steps: int, method: Method, delta: int, t_end: int) -> int:
    """How many of the steps ``1..steps`` are topology updates (see :func:`is_update_step`)."""
    if method == "static":
        return 0
    return max(min(steps, t_end - 1), 0) // delta


def drop_and_grow(mask: Tensor, weight: Tensor, grow_score: Tensor, k: int) -> Tensor:
    """The mask after dropping ``k`` active weights and growing ``k`` inactive connections.

    Drop: the ``k`` active entries of smallest ``|weight|``. Grow: the ``k`` entries that are
    inactive after the drop with the largest ``grow_score`` (``|dense gradient|`` for RigL,
    uniform noise for SET). A just-dropped connection may be regrown (RigL, RLx2); it then
    counts as never dropped. The active count is unchanged. ``mask`` is a bool tensor
    shaped like ``weight``; a new bool tensor is returned and the inputs are left alone.
    """
    flat = mask.reshape(-1)
    magnitude = weight.detach().abs().reshape(-1).float()
    drop_score = torch.where(flat, magnitude, torch.full_like(magnitude, math.inf))
    new = flat.clone()
    new[torch.topk(drop_score, k, largest=False).indices] = False
    score = grow_score.detach().reshape(-1).float().to(magnitude.device)
    grow_candidates = torch.where(new, torch.full_like(score, -math.inf), score)
    new[torch.topk(grow_candidates, k).indices] = True
    return new.view_as(mask)
