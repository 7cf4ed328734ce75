"""LearnerProcess: what every learner actor holds, whatever the topology.

The Learner (algorithm, counters, checkpoint state), one Feed between acting
and learning (a bounded batch queue on-policy, a replay buffer off-policy:
`runtime.feeds`) and trainer threads that drain it. Topologies subclass it
with what their paper's learner adds (SEED's inference server, IMPALA's
weight publication, GA3C's predictors) and place it in a Ray actor; it does
not know the wiring.

On a GPU, costs left as they are until a GPU run measures them: each update
reads its metrics with `.item()` and its gradient norm's finiteness on the host
(a few syncs per update), and inference and training share the default CUDA
stream, so an inference batch waits for an update's kernels queued before it.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import ray
import torch

from rlfabric.algorithms.base import NOT_WRITABLE_WARNING
from rlfabric.envs import EnvInfo
from rlfabric.runtime.data_parallel import LearnerGroup, device_for_this_actor
from rlfabric.runtime.distributed import host_rendezvous
from rlfabric.runtime.faults import capture_warnings
from rlfabric.runtime.feeds import make_feed
from rlfabric.runtime.learner import Learner
from rlfabric.runtime.replay import ReplayBuffer
from rlfabric.runtime.workers import ThreadPool

if TYPE_CHECKING:
    from rlfabric.runtime.config import LearningSpec


def detached_state(state: Any) -> Any:
    """`state` with every tensor copied to a CPU tensor of its own storage.

    A learner's state leaves its actor through Ray, which serializes the return value after
    the method has returned and the update lock is released: tensors that were the live
    weights could then mix two updates, and CUDA tensors would make a driver without a GPU
    fail to read the checkpoint (a driver with one would open a CUDA context for it). The
    copy is made while the caller holds the lock. CPU tests check the copy
    (tests/test_device_discipline.py); that a CPU-only driver reads a CUDA learner's state
    needs a GPU to show."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: detached_state(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(detached_state(value) for value in state)
    return state


class LearnerProcess:
    """The Learner, its Feed and trainer threads.

    `env_groups` (per runner) and `resources.num_env_runners` size a replay
    feed's streams; `capacity`, `batch_on` and `queue_metric` shape a batch
    queue (see `runtime.feeds.BatchQueueFeed`); `buffer_factory` builds a
    replay buffer (in this process, or in its own actor).
    """

    def __init__(
        self,
        spec: LearningSpec,
        env_info: EnvInfo,
        frame_budget: int | None,
        state: dict[str, Any] | None,
        *,
        env_groups: int,
        capacity: int,
        trainers: int = 1,
        batch_on: Literal["add", "train"] = "add",
        queue_metric: str = "batch_queue",
        buffer_factory: Callable[..., ReplayBuffer] = ReplayBuffer.from_spaces,
    ) -> None:
        self.warnings = capture_warnings()
        torch.set_num_threads(spec.resources.learner_threads)
        # Inference threads need the GIL for a moment between torch ops while a trainer
        # runs; Python's default 5 ms switch interval would add up to 5 ms per op.
        sys.setswitchinterval(0.0005)
        # Requests and unrolls arrive as read-only arrays from Ray's object store; we only read.
        warnings.filterwarnings("ignore", message=NOT_WRITABLE_WARNING)
        # A GPU Ray gave this actor (resources.num_gpus_per_learner) trains and infers.
        self.device = device_for_this_actor()
        self.learner = Learner(spec, env_info, frame_budget, self.device)
        if state is not None:
            self.learner.load_state_dict(state)
        self.timeout_s = spec.run.actor_timeout_s  # of a data-parallel group's collectives
        self.start_timeout_s = spec.run.start_timeout_s  # of its rendezvous
        self.num_learners = spec.resources.num_learners
        # One optimizer step at a time, never during a checkpoint or a metrics read (a
        # read mid-step would see weights between the step and their re-masking, and
        # cache that topology's FLOPs); re-entrant: `snapshot` reads metrics holding it.
        self._update_lock = threading.RLock()
        self._stopping = threading.Event()
        self.feed = make_feed(
            self.learner,
            spec,
            env_info,
            self._update_lock,
            num_runners=spec.resources.num_env_runners,
            num_groups=env_groups,
            capacity=capacity,
            batch_on=batch_on,
            metric=queue_metric,
            buffer_factory=buffer_factory,
        )
        if state is not None:
            self.feed.restore(state)
        self.trainers = ThreadPool(self.feed.train_step, "trainer")
        self.trainers.resize(trainers)

    def add_unroll(self, unroll: dict[str, np.ndarray], key: tuple[int, int]) -> bool:
        """Hand an unroll from env group `key` to the feed (may block). False once stopping."""
        return self.feed.add_unroll(unroll, key, self._stopping)

    def pools(self) -> list[ThreadPool]:
        return [self.trainers]

    # -- called by the driver -----------------------------------------------------
    def ready(self) -> bool:
        """Answers once the constructor has finished (the driver waits for it)."""
        return True

    def group_address(self) -> str:
        """Host the data-parallel group's rendezvous on this node; its address."""
        ip = ray.util.get_node_ip_address()
        address, self._rendezvous = host_rendezvous(ip, self.num_learners, self.start_timeout_s)
        return address

    def policy_weights(self) -> dict[str, np.ndarray]:
        return self.learner.algorithm.get_weights()

    def algorithm_state(self) -> dict[str, Any]:
        with self._update_lock:
            return detached_state(self.learner.algorithm.state_dict())

    def join_learners(self, address: str, workers: list[Any]) -> None:
        """Become learner 0 of a data-parallel group (`runtime.data_parallel`)."""
        group = LearnerGroup(self.learner, workers, self.timeout_s, self.start_timeout_s)
        group.join(address, self._rendezvous)

    def wait_for_stop(self, timeout_s: float, return_target: float | None) -> bool:
        """The driver's wait between reports (`Learner.wait_for_stop`)."""
        return self.learner.wait_for_stop(timeout_s, return_target)

    def metrics(self, raise_errors: bool = True) -> dict[str, float]:
        """The learner's figures; first raises the error a trainer or batcher thread
        stopped with, unless `raise_errors` is off (the final checkpoint after it)."""
        for pool in self.pools():
            if raise_errors and pool.error is not None:
                raise pool.error
        with self._update_lock:
            metrics = self.learner.metrics()
        metrics["learner_on_gpu"] = float(self.device == "cuda")
        metrics.update(self.feed.metrics())
        return metrics

    def configure(self, setting: dict[str, int]) -> None:
        """Apply the dynamic adjuster's learner-side knobs (none by default)."""

    def take_warnings(self) -> list[str]:
        """This process's warnings since the last call, for the driver to log."""
        return self.warnings.take()

    def get_state(self, replay_file: str | None = None) -> dict[str, Any]:
        with self._update_lock:
            # The feed's part is already its own: replay contents go to `replay_file` or are
            # CPU arrays, which a copy here would only double (up to checkpoint_replay_mb).
            learner = detached_state(self.learner.state_dict())
            return {**learner, **self.feed.checkpoint(replay_file)}

    def snapshot(self, replay_file: str | None = None) -> tuple[dict[str, float], dict[str, Any]]:
        """Metrics and checkpoint state of one moment, for a checkpoint and the metrics
        record written with it: no update, replay add or step count between the two.
        A replay buffer writes its contents to `replay_file` (`Feed.checkpoint`)."""
        with self._update_lock, self.feed.frozen(), self.learner.frozen():
            # No error raised: a run a trainer's error ended still saves its last state.
            state = self.get_state(replay_file)  # the update lock is reentrant
            return self.metrics(raise_errors=False), state

    def replay_chunk(self, offset: int, size: int) -> bytes:
        """A chunk of the replay contents a snapshot left to pull (`Feed.replay_chunk`)."""
        return self.feed.replay_chunk(offset, size)

    def stop(self) -> None:
        self._stopping.set()
        for pool in self.pools():
            pool.stop()
        self.feed.close()
