"""The replay buffer in its own Ray actor (`resources.replay_actor: true`).

By default a learner keeps its `ReplayBuffer` in its own process: adds and
samples are plain numpy. In its own actor the buffer's memory and copying
move out of the learner's process (onto another node of a cluster, with
custom resources), at one remote call per unroll stored and per batch
sampled; arrays travel through the object store. `RemoteReplayBuffer` has
the local buffer's interface, so `ReplayFeed` uses either unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlfabric.runtime.faults import call
from rlfabric.runtime.replay import ReplayBuffer
from rlfabric.runtime.replay_files import CHUNK_BYTES, Pull


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

    def load_contents(self, path: str, nbytes: int, fetch: Pull | None) -> int:
        self.buffer.load_contents(path, nbytes, fetch)
        return len(self.buffer)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Calls that leave the contents as they are: sample, oldest, state_dict,
        save_contents, read_outbox, close."""
        return getattr(self.buffer, name)(*args, **kwargs)

    def describe(self) -> tuple[int, int]:
        return self.buffer.capacity, self.buffer.nbytes


def _get(ref: ray.ObjectRef) -> Any:
    """The buffer actor's answer; its death named as the replay actor's, so that the
    driver restarts the run from its checkpoint (`Platform.fit`) rather than ending it."""
    return call(ref, "the replay actor")


class RemoteReplayBuffer:
    """A `ReplayBuffer` in a Ray actor; its length is cached from the calls that change it."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._len = 0
        self._capacity = _get(actor.describe.remote())[0]

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
        self._len = _get(self.actor.set_capacity.remote(value))
        self._capacity = value

    @property
    def nbytes(self) -> int:
        return _get(self.actor.describe.remote())[1]

    def add_unroll(self, unroll: Mapping[str, np.ndarray], streams: np.ndarray) -> int:
        added, self._len = _get(self.actor.add_unroll.remote(unroll, streams))
        return added

    def sample(
        self, batch_size: int, n_step: int | None = None, *, intermediate: bool = False
    ) -> dict[str, np.ndarray]:
        return _get(self.actor.call.remote("sample", batch_size, n_step, intermediate=intermediate))

    def oldest(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        return _get(self.actor.call.remote("oldest", k))

    def state_dict(self, contents: bool = True) -> dict[str, Any]:
        return _get(self.actor.call.remote("state_dict", contents))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._len = _get(self.actor.load_state_dict.remote(state))
        self._capacity = int(state["capacity"])

    def save_contents(self, target: str) -> dict[str, Any]:
        """The actor writes its contents itself (into `target` if its node sees it)."""
        return _get(self.actor.call.remote("save_contents", target))

    def read_outbox(self, offset: int, size: int) -> bytes:
        return _get(self.actor.call.remote("read_outbox", offset, size))

    def load_contents(self, path: str, nbytes: int, fetch: Pull | None = None) -> None:
        self._len = _get(self.actor.load_contents.remote(path, nbytes, fetch))

    def close(self) -> None:
        # Remove contents left to pull (a checkpoint's pull that never finished), unless
        # the actor is gone already.
        with contextlib.suppress(Exception):
            ray.get(self.actor.call.remote("close"), timeout=10)
        ray.kill(self.actor, no_restart=True)


class _FileReader:
    """Hands out chunks of a file on the driver's node (`replay_contents_served`)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def read(self, offset: int, size: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(min(size, CHUNK_BYTES))


def _fetch(reader: Any, offset: int, size: int) -> bytes:
    return ray.get(reader.read.remote(offset, size))


@contextlib.contextmanager
def replay_contents_served(
    state: dict[str, Any] | None, min_nodes: int = 2
) -> Iterator[dict[str, Any] | None]:
    """`state` for a learner that restores replay contents from a file beside the
    checkpoint: on a cluster of `min_nodes` nodes or more it may not see the
    driver's disk, so a reader actor on this node serves the file, in chunks,
    while the learner starts (`ReplayBuffer.load_contents`'s `fetch`)."""
    contents = (state or {}).get("replay", {}).get("contents_file")
    if contents is None or len([n for n in ray.nodes() if n["Alive"]]) < min_nodes:
        yield state
        return
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    reader = ray.remote(_FileReader).options(num_cpus=0, scheduling_strategy=here)
    actor = reader.remote(contents["path"])
    fetch = functools.partial(_fetch, actor)
    try:
        yield {
            **state,
            "replay": {**state["replay"], "contents_file": {**contents, "fetch": fetch}},
        }
    finally:
        ray.kill(actor, no_restart=True)
