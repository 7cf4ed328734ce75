"""Feeds: what sits between acting and learning in a learner process.

Producers (the threads that assemble or receive unrolls) call
`add_unroll`; trainer threads call `train_step`. A learner process holds one
feed and does not care which:

- `BatchQueueFeed` (on-policy): unrolls are cut into batches of B unrolls and
  queued; a full queue blocks the producer. That wait is the backpressure
  that keeps the policy lag small (SEED's queue holds one batch). GA3C's
  training queue holds unrolls instead and its trainers cut batches
  (`batch_on="train"`).
- `ReplayFeed` (off-policy: SAC, TD3): unrolls' transitions go into a
  `ReplayBuffer`, one stream per env (runner index x env), so that n-step
  folds follow each env's own sequence. The update-to-data ratio is kept
  exactly, however fast envs step: once `warmup_steps` transitions are
  stored (and one batch's worth), the learner owes `updates_per_step`
  updates per stored transition (CleanRL's loop: one update per agent step
  after `learning_starts`). Trainers update while updates are owed;
  producers wait while the trainers are more than one unroll behind, which
  is the replay path's backpressure. RLx2's dynamic capacity
  (`runtime.replay.DynamicCapacity`) runs in the trainer, between updates,
  every `buffer_check_every` stored transitions.
"""

from __future__ import annotations

import json
import math
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from rlfabric.runtime.env_runner import group_sizes
from rlfabric.runtime.replay import CAPACITY_BOUNDS, DynamicCapacity, ReplayBuffer
from rlfabric.runtime.unrolls import BatchBuilder

if TYPE_CHECKING:
    from rlfabric.envs import EnvInfo
    from rlfabric.runtime.config import LearningSpec
    from rlfabric.runtime.learner import Learner


Unroll = dict[str, np.ndarray]


class Feed(ABC):
    """Between acting and learning. `update_lock` is the learner process's: one
    optimizer step at a time, and never during a checkpoint."""

    @abstractmethod
    def add_unroll(self, unroll: Unroll, key: tuple[int, int], stopping: threading.Event) -> bool:
        """Take one unroll from env group `key` = (runner index, group); may block for
        backpressure. False (taking nothing) once `stopping` is set."""

    @abstractmethod
    def train_step(self, timeout: float = 0.1) -> bool:
        """Run the updates one item of data allows, waiting up to `timeout` for it;
        True if any ran."""

    @abstractmethod
    def metrics(self) -> dict[str, float]:
        """Queue depths or buffer figures for the report."""

    def checkpoint(self, replay_file: str | None = None) -> dict[str, Any]:
        """Entries this feed adds to the learner's checkpoint state (none by default).
        `replay_file`: where a replay buffer writes its contents (`ReplayFeed.state_dict`)."""
        return {}

    def replay_chunk(self, offset: int, size: int) -> bytes:
        """A chunk of replay contents left to pull (`ReplayFeed.state_dict`)."""
        raise RuntimeError(f"{type(self).__name__} holds no replay contents")

    def frozen(self) -> AbstractContextManager[Any]:
        """Held while the learner takes metrics and state of one moment: no data comes in
        meanwhile that either would count (a replay buffer's adds). Reentrant."""
        return nullcontext()

    def restore(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Restore from a checkpoint's state, after the Learner."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the feed holds outside this process."""


class BatchQueueFeed(Feed):
    """A bounded queue of on-policy batches (`capacity` items; 0: unbounded).

    `batch_on="add"`: producers cut unrolls into batches of B unrolls and queue
    batches (SEED, IMPALA). `batch_on="train"`: the queue holds unrolls and
    trainers cut them into batches (GA3C's training queue of experiences).
    """

    def __init__(
        self,
        update: Callable[[Unroll], Any],
        batch_size: int,
        capacity: int,
        update_lock: threading.Lock | threading.RLock,
        batch_on: Literal["add", "train"] = "add",
        metric: str = "batch_queue",
    ) -> None:
        self.update = update
        self.queue: queue.Queue[Unroll] = queue.Queue(capacity)
        self.builder = BatchBuilder(batch_size)
        self.update_lock = update_lock
        self.batch_on = batch_on
        self.metric = metric
        self._builder_lock = threading.Lock()

    def _batches(self, unroll: Unroll) -> list[Unroll]:
        with self._builder_lock:
            return self.builder.add(unroll)

    def add_unroll(self, unroll: Unroll, key: tuple[int, int], stopping: threading.Event) -> bool:
        items = self._batches(unroll) if self.batch_on == "add" else [unroll]
        return all(self._put(item, stopping) for item in items)

    def _put(self, item: Unroll, stopping: threading.Event) -> bool:
        """Queue `item`, blocking while the queue is full; False once stopping."""
        while not stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def train_step(self, timeout: float = 0.1) -> bool:
        try:
            item = self.queue.get(timeout=timeout)
        except queue.Empty:
            return False
        for batch in self._batches(item) if self.batch_on == "train" else [item]:
            with self.update_lock:
                self.update(batch)
        return True

    def metrics(self) -> dict[str, float]:
        return {self.metric: float(self.queue.qsize())}


class StreamMap:
    """Buffer streams of each (runner index, group) key: one per env, runner-major."""

    def __init__(self, num_runners: int, num_envs: int, num_groups: int) -> None:
        self.num_streams = num_runners * num_envs
        self.num_envs = num_envs
        sizes = group_sizes(num_envs, num_groups)
        starts = np.cumsum([0, *sizes])
        self._groups = [np.arange(starts[g], starts[g + 1]) for g in range(num_groups)]

    def __call__(self, key: tuple[int, int]) -> np.ndarray:
        runner, group = key
        return runner * self.num_envs + self._groups[group]


class ReplayFeed(Feed):
    """The ReplayBuffer of one learner, fed with unrolls, drained by `train_step`.

    `update_lock` is the learner process's: updates, the capacity check (a
    forward pass) and checkpoints never overlap. The buffer has its own lock,
    held briefly by adds, samples and checkpoints.
    """

    def __init__(
        self,
        learner: Learner,
        spec: LearningSpec,
        env_info: EnvInfo,
        streams: StreamMap,
        update_lock: threading.Lock | threading.RLock,
        buffer_factory: Callable[..., ReplayBuffer] = ReplayBuffer.from_spaces,
    ) -> None:
        """`buffer_factory` builds the buffer from the env's spaces: here by default, or
        in its own actor (`architectures.replay_actor.RemoteReplayBuffer.from_spaces`)."""
        cfg = spec.algo
        self.learner = learner
        self.cfg = cfg
        self.checkpoint_replay_mb = spec.run.checkpoint_replay_mb
        self.streams = streams
        self.update_lock = update_lock
        self.dynamic: DynamicCapacity | None = None
        if cfg.dynamic_buffer:
            low = cfg.buffer_min_capacity or CAPACITY_BOUNDS[cfg.name][0]
            self.dynamic = DynamicCapacity(
                min_capacity=min(low, cfg.buffer_capacity),
                max_capacity=cfg.buffer_capacity,
                check_every=cfg.buffer_check_every,
                threshold=cfg.buffer_threshold,
                oldest_k=8 * cfg.batch_size,
            )
        self.buffer = buffer_factory(
            env_info.observation_space,
            env_info.action_space,
            capacity=cfg.buffer_capacity,
            num_envs=streams.num_streams,
            gamma=cfg.gamma,
            store_policy_action=self.dynamic is not None,
            seed=spec.run.seed,
        )
        self.stored = 0  # transitions stored since the run began (resumes included)
        self.policy_distance = float("nan")
        self._checked_at = 0  # `stored` at the last capacity check
        # Where the ratio counts from: (stored, updates) when warm-up began (see load_state_dict).
        self._origin = (0, 0)
        self._cond = threading.Condition()

    # -- the ratio ------------------------------------------------------------------
    def _owed(self, stored: int) -> int:
        """Updates owed once `stored` transitions are in (caller holds `_cond`)."""
        cfg = self.cfg
        since = stored - self._origin[0]
        if since < cfg.warmup_steps or len(self.buffer) < cfg.batch_size:
            return 0
        done = self.learner.counters["updates"] - self._origin[1]
        return math.floor((since - cfg.warmup_steps) * cfg.updates_per_step) - done

    def owed(self) -> int:
        with self._cond:
            return self._owed(self.stored)

    # -- producers --------------------------------------------------------------------
    def add_unroll(self, unroll: Unroll, key: tuple[int, int], stopping: threading.Event) -> bool:
        """Store an unroll's transitions once the trainers are at most one unroll behind.

        Returns False (storing nothing) once `stopping` is set.
        """
        transitions = math.prod(unroll["reward"].shape)
        ahead = math.ceil(transitions * self.cfg.updates_per_step)
        with self._cond:
            while self._owed(self.stored) > ahead:
                if stopping.is_set():
                    return False
                self._cond.wait(0.1)
            self.stored += self.buffer.add_unroll(unroll, self.streams(key))
            self._cond.notify_all()
        return True

    # -- trainers ---------------------------------------------------------------------
    def train_step(self, timeout: float = 0.1) -> bool:
        """One update if one is owed (waiting up to `timeout` for one); True if it ran."""
        with self._cond:
            if self._owed(self.stored) <= 0:
                self._cond.wait(timeout)
                if self._owed(self.stored) <= 0:
                    return False
        with self.update_lock:
            with self._cond:
                if self._owed(self.stored) <= 0:  # another trainer took it
                    return False
                algorithm = self.learner.algorithm
                batch = self.buffer.sample(
                    self.cfg.batch_size,
                    algorithm.n_step,
                    intermediate=algorithm.intermediate_observations,
                )
            self.learner.update(batch)
            self._check_capacity()
        with self._cond:
            self._cond.notify_all()
        return True

    def _check_capacity(self) -> None:
        """RLx2: shrink the buffer when its oldest data left the current policy behind."""
        dynamic = self.dynamic
        if dynamic is None:
            return
        with self._cond:
            stored = self.stored
            if not dynamic.due(self._checked_at, stored) or len(self.buffer) == 0:
                return
            self._checked_at = stored
            obs, stored_actions = self.buffer.oldest(dynamic.oldest_k)
        # The forward pass runs outside the buffer's lock: adds go on meanwhile.
        space = self.learner.algorithm.action_space
        policy = self.learner.algorithm.act(obs, deterministic=True)[0]
        self.policy_distance = dynamic.distance(policy, stored_actions, space.low, space.high)
        with self._cond:
            dynamic.update(self.buffer, self.policy_distance)

    # -- reporting and checkpoints --------------------------------------------------
    def metrics(self) -> dict[str, float]:
        with self._cond:
            out = {
                "replay_size": float(len(self.buffer)),
                "replay_capacity": float(self.buffer.capacity),
                "replay_stored": float(self.stored),
                "updates_owed": float(self._owed(self.stored)),
                "n_step": float(self.learner.algorithm.n_step),
            }
        if self.dynamic is not None:
            out["policy_distance"] = self.policy_distance
        return out

    def state_dict(
        self, max_bytes: int | None = None, replay_file: str | None = None
    ) -> dict[str, Any]:
        """Counters, the buffer's parameters and RNG, and its contents if under `max_bytes`
        (default `run.checkpoint_replay_mb`).

        With `replay_file` (an empty file the driver reserved in the checkpoint folder)
        the process holding the buffer writes the contents there, or keeps them for
        the driver to pull (`replay_chunk`), and the state only describes that file
        (`contents_file`, see `runtime.replay_files`); without it they are inline.
        Arrays become tensors and the RNG state (128-bit integers) a JSON string, so
        that `torch.load(weights_only=True)` reads the checkpoint.
        """
        if max_bytes is None:
            max_bytes = int(self.checkpoint_replay_mb * 2**20)
        with self._cond:
            contents = self.buffer.nbytes <= max_bytes
            state = self.buffer.state_dict(contents=contents and replay_file is None)
            state["rng"] = json.dumps(state["rng"])
            out = {
                "stored": self.stored,
                "checked_at": self._checked_at,
                "contents": contents,
                "buffer": _to_torch(state),
            }
            if contents and replay_file is not None:
                out["contents_file"] = self.buffer.save_contents(replay_file)
            return out

    def checkpoint(self, replay_file: str | None = None) -> dict[str, Any]:
        return {"replay": self.state_dict(replay_file=replay_file)}

    def replay_chunk(self, offset: int, size: int) -> bytes:
        return self.buffer.read_outbox(offset, size)

    def frozen(self) -> AbstractContextManager[Any]:
        return self._cond  # adds wait on it; an RLock underneath, so metrics() re-enters

    def restore(self, state: dict[str, Any]) -> None:
        if "replay" in state:
            self.load_state_dict(state["replay"])

    def close(self) -> None:
        self.buffer.close()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore after the Learner; the updates still owed at the save are forgiven.

        With contents, learning goes on at once. Without, the buffer warms up
        again (`warmup_steps` new transitions, acted by the current policy)
        before updates resume, so that they never sample a handful of transitions.
        """
        # ReplayBuffer.load_state_dict takes the tensors as they are.
        buffer_state = {**state["buffer"], "rng": json.loads(state["buffer"]["rng"])}
        with self._cond:
            self.buffer.load_state_dict(buffer_state)
            if "contents_file" in state:  # `path` and `fetch`: set by the driver on resume
                file = state["contents_file"]
                self.buffer.load_contents(file["path"], int(file["bytes"]), file.get("fetch"))
            self.stored = int(state["stored"])
            self._checked_at = int(state["checked_at"])
            updates = self.learner.counters["updates"]
            warm = self.cfg.warmup_steps if state["contents"] else 0
            self._origin = (self.stored - warm, updates)


def _to_torch(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, dict):
        return {k: _to_torch(v) for k, v in value.items()}
    return value


def make_feed(
    learner: Learner,
    spec: LearningSpec,
    env_info: EnvInfo,
    update_lock: threading.Lock | threading.RLock,
    *,
    num_runners: int,
    num_groups: int,
    capacity: int,
    batch_on: Literal["add", "train"] = "add",
    metric: str = "batch_queue",
    buffer_factory: Callable[..., ReplayBuffer] = ReplayBuffer.from_spaces,
) -> Feed:
    """The feed the learner's algorithm needs: replay for `data == "replay"`, else a
    batch queue of `capacity` items. `buffer_factory` builds the replay buffer (in
    this process by default)."""
    if learner.algorithm.data == "replay":
        streams = StreamMap(num_runners, spec.env.num_envs, num_groups)
        return ReplayFeed(learner, spec, env_info, streams, update_lock, buffer_factory)
    return BatchQueueFeed(
        learner.update, spec.algo.batch_size, capacity, update_lock, batch_on, metric
    )
