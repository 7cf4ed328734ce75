"""The Algorithm contract every architecture calls (see ARCHITECTURE.md).

An algorithm is pure torch: it owns its networks and optimizer, turns
observations into actions (`act`) and batches into updates (`update`), and
never knows which process it runs in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

import gymnasium as gym
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from rlfabric.models import ModelConfig

DataKind = Literal["trajectory", "replay"]


class AlgoConfig(BaseModel):
    """Fields every algorithm has; each algorithm subclasses this with its own."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="registered algorithm name")
    lr: float = Field(6e-4, gt=0, description="learning rate")
    lr_schedule: Literal["constant", "linear"] = Field(
        "linear", description="'linear' anneals lr to 0 over the run's env-frame budget"
    )
    gamma: float = Field(0.99, ge=0, le=1, description="discount factor")


class TrajectoryConfig(AlgoConfig):
    """On-policy algorithms learn from batches of `batch_size` unrolls of `unroll_length`."""

    unroll_length: int = Field(20, ge=1, description="agent steps per unroll (T)")
    batch_size: int = Field(32, ge=1, description="unrolls per learner batch (B)")


class Algorithm(ABC):
    """Base class: registry metadata, weights and checkpoint plumbing.

    Subclasses set `config_cls`, `data` and `action_spaces` (the single-env
    action space types they can act in), and implement `act` and `update`.
    """

    config_cls: ClassVar[type[AlgoConfig]]
    data: ClassVar[DataKind]
    action_spaces: ClassVar[tuple[type[gym.Space], ...]]

    def __init__(
        self,
        cfg: AlgoConfig,
        obs_space: gym.Space,
        action_space: gym.Space,
        model_cfg: ModelConfig,
        device: str = "cpu",
    ) -> None:
        self.cfg = cfg
        self.obs_space = obs_space
        self.action_space = action_space
        self.model_cfg = model_cfg
        self.device = torch.device(device)
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer

    @classmethod
    def check_spaces(cls, obs_space: gym.Space, action_space: gym.Space) -> None:
        """Raise ValueError naming the space and what is allowed if it cannot act there."""
        if not isinstance(action_space, cls.action_spaces):
            allowed = ", ".join(t.__name__ for t in cls.action_spaces)
            raise ValueError(
                f"algorithm '{cls.config_cls.model_fields['name'].default}' cannot act in "
                f"action space {action_space}; allowed: {allowed}"
            )

    @abstractmethod
    def act(
        self,
        obs: np.ndarray,
        state: np.ndarray | None = None,
        first: np.ndarray | None = None,
        deterministic: bool = False,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        """Policy step on a batch of observations `[N, ...]`.

        `state` is the recurrent state `[N, ...]` each env's previous step left
        (None without a recurrent core); `first` `[N]` marks observations that
        start an episode, where the state is reset. Returns the actions
        `[N, ...]`, the extras the learner needs later (e.g. behaviour
        log-probs) and the next recurrent state.
        """

    def initial_state(self, num_envs: int) -> np.ndarray | None:
        """The recurrent state of fresh envs, or None if the policy has no memory."""
        return None

    @abstractmethod
    def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """One learning step on a batch (see ARCHITECTURE.md's Batch contract)."""

    def set_progress(self, fraction: float) -> None:
        """Tell the algorithm how far the run is (0..1), for lr annealing."""
        scale = max(0.0, 1.0 - fraction) if self.cfg.lr_schedule == "linear" else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * scale

    def get_weights(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy() for k, v in self.model.state_dict().items()}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.model.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def to_tensors(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Numpy batch to torch without copying on the CPU."""
    return {k: torch.as_tensor(v, device=device) for k, v in batch.items()}
