"""The Architecture contract: a topology that wires runtime pieces together.

`start(state)` creates the processes (restoring checkpoint state if given),
`step()` runs one reporting interval and returns the learner's metrics,
`get_state()` returns checkpoint state, and `stop()` tears everything down.
A new topology is one file and one line in `ARCHITECTURES`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field

from rlfabric.envs import EnvInfo
from rlfabric.runtime.config import LearningSpec, StopConfig


class ArchConfig(BaseModel):
    """Fields every architecture has; each architecture subclasses this."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="registered architecture name")


class RunnerArchConfig(ArchConfig):
    """Fields of every topology with env runner actors (seed, impala, ga3c)."""

    env_groups: int = Field(2, ge=1, description="env groups per runner that step alternately")
    queue_capacity: int = Field(
        1, ge=1, description="batches queued for the trainer (backpressure)"
    )
    max_runner_restarts: int = Field(
        100, ge=0, description="env runner crashes tolerated before the run fails"
    )
    max_identical_runner_failures: int = Field(
        3,
        ge=1,
        description="env runner failures in a row with the same exception (an env that raises "
        "on every step) before the run fails with it: restarting will not help",
    )
    autotune: bool = Field(
        False,
        description="GA3C's dynamic adjuster: random-walk the worker counts (and batch sizes) "
        "every autotune_interval_s, keeping a change only if learner throughput did not fall",
    )
    autotune_interval_s: float = Field(20.0, gt=0, description="seconds per adjuster window")
    max_env_runners: int = Field(
        4, ge=1, description="most env runners the adjuster may run (with autotune)"
    )


class TopologySpec(LearningSpec, Protocol):
    """What an architecture reads of an experiment: the runtime's sections and its own."""

    @property
    def arch(self) -> Any: ...


class Architecture(ABC):
    config_cls: ClassVar[type[ArchConfig]]
    #: Whether the platform must start Ray before `start`.
    uses_ray: ClassVar[bool] = True
    #: Algorithm data kinds this topology can feed.
    data_kinds: ClassVar[tuple[str, ...]] = ("trajectory", "replay")

    def __init__(self, spec: TopologySpec, env_info: EnvInfo, stop: StopConfig) -> None:
        self.spec = spec
        self.env_info = env_info
        self.stop_conditions = stop

    @abstractmethod
    def start(self, state: dict[str, Any] | None = None) -> None:
        """Create the actors/threads; restore learner state from a checkpoint if given."""

    @abstractmethod
    def step(self) -> dict[str, float]:
        """Run for one reporting interval and return the latest metrics."""

    @abstractmethod
    def get_state(self) -> dict[str, Any]:
        """Checkpoint state: weights, optimizer, counters, RNG."""

    @abstractmethod
    def snapshot(self, replay_file: str | None = None) -> tuple[dict[str, float], dict[str, Any]]:
        """The latest metrics and the checkpoint state of one moment: a checkpoint and the
        metrics record written with it must agree (frames, updates, replay size).

        With `replay_file` (an empty file reserved in the checkpoint folder), the
        process holding a replay buffer writes its contents there if it sees the
        file, else keeps them for `replay_chunk`; the state describes the file
        (`runtime.feeds.ReplayFeed.state_dict`). Without, contents are inline."""

    @abstractmethod
    def replay_chunk(self, offset: int, size: int) -> bytes:
        """Up to `size` bytes from `offset` of the replay contents the last snapshot could
        not write into the checkpoint folder; b"" at the end."""

    @abstractmethod
    def policy_weights(self) -> dict[str, Any]:
        """The acting network's current weights (`Algorithm.get_weights`), for evaluation."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every process this architecture started; safe to call twice."""
