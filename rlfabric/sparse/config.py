"""The spec's `sparse` section: RLx2 dynamic sparse training of an algorithm's networks.

Defaults are those of RLx2's training scripts (tyq1024/RLx2 ``RLx2_TD3/train.py`` and
``RLx2_SAC/train.py``; arXiv 2205.15043): sparsity 0 (dense), ``--delta 10000``,
``--zeta 0.5``, RigL growth unless ``--random_grow``, a dynamic topology unless
``--static_actor``/``--static_critic``, Erdős–Rényi layer densities (``DST_Scheduler.py``
``sparse_set``), and ``T_end = max_timesteps - start_timesteps``: every learner update
of the run.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rlfabric.sparse.distribution import Distribution
from rlfabric.sparse.topology import Method


class SparseConfig(BaseModel):
    """Which networks train sparse, and how their topology evolves (RLx2)."""

    model_config = ConfigDict(extra="forbid")

    actor: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="actor sparsity, the fraction of its weights that are zero (RLx2 "
        "--actor_sparsity; 0: dense); on-policy algorithms: their one shared network",
    )
    critic: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="critic sparsity over both Q networks together (RLx2 --critic_sparsity; "
        "0: dense); off-policy algorithms only",
    )
    distribution: Distribution = Field(
        "erk",
        description="per-layer densities: 'erk' Erdos-Renyi (RLx2 sparse_set) or 'uniform'",
    )
    method: Method = Field(
        "rigl",
        description="topology evolution: 'rigl' grows by dense gradient (RLx2), 'set' grows "
        "at random (RLx2 --random_grow), 'static' keeps the initial mask (--static_actor)",
    )
    delta: int = Field(
        10_000,
        ge=1,
        description="optimizer steps of a network between its topology updates (RLx2 --delta)",
    )
    zeta: float = Field(
        0.5,
        ge=0,
        le=1,
        description="initial drop fraction, cosine-annealed to 0 at t_end (RLx2 --zeta)",
    )
    t_end: int | None = Field(
        None,
        ge=1,
        description="learner updates after which the topology freezes; null: all the run's "
        "expected updates, from its env-frame budget (RLx2: max_timesteps - start_timesteps)",
    )

    @property
    def enabled(self) -> bool:
        """Whether any network trains sparse."""
        return self.actor > 0 or self.critic > 0
