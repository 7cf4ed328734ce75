"""The replay buffer in its own Ray actor (`resources.replay_actor: true`).

By default a learner keeps its `ReplayBuffer` in its own process: adds and
samples are plain numpy. In its own actor the buffer's memory and copying
move out of the learner's process (onto another node of a cluster, with
custom resources), at one remote call per unroll stored and per batch
sampled; arrays travel through the object store. `RemoteReplayBuffer` has
the local buffer's interface, so `ReplayFeed` uses either unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import ray

from rlfabric.runtime.replay import ReplayBuffer


class _BufferActor:
    """The actor's side: a ReplayBuffer whose mutating calls also return its new length."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.buffer = ReplayBuffer.from_spaces(*args, **kwargs)

    def add_unroll(self, unroll: dict[str, np.ndarray], streams: np.ndarray) -> tuple[int, int]:
        return self.buffer.add_unroll(unroll, streams), len(self.buffer)

    def set_capacity(self, value: int) -> int:
        self.buffer.capacity = value
        return len(self.buffer)

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        self.buffer.load_state_dict(state)
        return len(self.buffer)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Read-only calls: sample, oldest, state_dict."""
        return getattr(self.buffer, name)(*args, **kwargs)

    def describe(self) -> tuple[int, int]:
        return self.buffer.capacity, self.buffer.nbytes


class RemoteReplayBuffer:
    """A `ReplayBuffer` in a Ray actor; its length is cached from the calls that change it."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._len = 0
        self._capacity = ray.get(actor.describe.remote())[0]

    @classmethod
    def from_spaces(
        cls, observation_space: gym.Space, action_space: gym.Space, **kwargs: Any
    ) -> RemoteReplayBuffer:
        actor = (
            ray.remote(_BufferActor)
            .options(num_cpus=0)  # memory, not compute: callers do the work
            .remote(observation_space, action_space, **kwargs)
        )
        return cls(actor)

    def __len__(self) -> int:
        return self._len

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self._len = ray.get(self.actor.set_capacity.remote(value))
        self._capacity = value

    @property
    def nbytes(self) -> int:
        return ray.get(self.actor.describe.remote())[1]

    def add_unroll(self, unroll: Mapping[str, np.ndarray], streams: np.ndarray) -> int:
        added, self._len = ray.get(self.actor.add_unroll.remote(unroll, streams))
        return added

    def sample(
        self, batch_size: int, n_step: int | None = None, *, intermediate: bool = False
    ) -> dict[str, np.ndarray]:
        return ray.get(
            self.actor.call.remote("sample", batch_size, n_step, intermediate=intermediate)
        )

    def oldest(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        return ray.get(self.actor.call.remote("oldest", k))

    def state_dict(self, contents: bool = True) -> dict[str, Any]:
        return ray.get(self.actor.call.remote("state_dict", contents))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._len = ray.get(self.actor.load_state_dict.remote(state))
        self._capacity = int(state["capacity"])

    def close(self) -> None:
        ray.kill(self.actor, no_restart=True)
