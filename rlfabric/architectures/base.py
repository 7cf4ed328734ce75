"""The Architecture contract: a topology that wires platform pieces together.

`start(state)` creates the processes (restoring checkpoint state if given),
`step()` runs one reporting interval and returns the learner's metrics,
`get_state()` returns checkpoint state, and `stop()` tears everything down.
A new topology is one file and one line in `ARCHITECTURES`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from rlfabric.envs import EnvInfo

if TYPE_CHECKING:
    from rlfabric.platform.spec import ExperimentSpec, StopConfig


class ArchConfig(BaseModel):
    """Fields every architecture has; each architecture subclasses this."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="registered architecture name")


class Architecture(ABC):
    config_cls: ClassVar[type[ArchConfig]]
    #: Whether the platform must start Ray before `start`.
    uses_ray: ClassVar[bool] = True
    #: Algorithm data kinds this topology can feed.
    data_kinds: ClassVar[tuple[str, ...]] = ("trajectory", "replay")

    def __init__(self, spec: ExperimentSpec, env_info: EnvInfo, stop: StopConfig) -> None:
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
    def policy_weights(self) -> dict[str, Any]:
        """The acting network's current weights (`Algorithm.get_weights`), for evaluation."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every process this architecture started; safe to call twice."""
