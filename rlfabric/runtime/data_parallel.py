"""The learners of a data-parallel group (`resources.num_learners: N`), as runtime pieces.

    learner 0 (inference, unroll assembly, feed, checkpoints)
        | batch -> shards 1..N-1 ---> LearnerWorker x (N-1): algorithm only
        | shard 0: its own update        all-reduce of gradients at every optimizer step
        '-------------------------------------------------------'

Learner 0 is the architecture's own learner process; `LearnerGroup` is its
side of the group. The workers hold only the algorithm. Every update,
learner 0 sends shards 1..N-1 of the batch to the workers and trains on
shard 0, and every optimizer step all-reduces the gradients
(`runtime.distributed`), so the N learners hold identical weights
throughout. Where the learners are placed is the architecture's business
(`architectures.learner_group`).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch

from rlfabric.envs import EnvInfo
from rlfabric.runtime.distributed import GradientAllReduce, join_group, shard_batch
from rlfabric.runtime.faults import call
from rlfabric.runtime.learner import make_algorithm

if TYPE_CHECKING:
    from rlfabric.runtime.config import LearningSpec
    from rlfabric.runtime.learner import Learner


def device_for_this_actor() -> str:
    """cuda where Ray gave this actor a GPU and torch sees one, else cpu."""
    return "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"


class LearnerWorker:
    """Learners 1..N-1: the algorithm, updated on the shards learner 0 sends."""

    def __init__(self, spec: LearningSpec, env_info: EnvInfo, frame_budget: int | None) -> None:
        torch.set_num_threads(spec.resources.learner_threads)
        self.device = device_for_this_actor()
        self.algorithm = make_algorithm(spec, env_info, frame_budget, self.device)
        self.timeout_s = spec.run.actor_timeout_s
        self.start_timeout_s = spec.run.start_timeout_s

    def ready(self) -> bool:
        return True

    def pid(self) -> int:
        """The worker's process id (for fault-injection tests and debugging)."""
        return os.getpid()

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        """Never returns: the driver holds this call to learn at once of the worker's death
        (the call then fails), in its own thread beside the updates."""
        threading.Event().wait()

    def join(self, address: str, rank: int, world_size: int, state: dict[str, Any]) -> None:
        """Start from learner 0's algorithm state (weights, optimizer), then join the group."""
        self.algorithm.load_state_dict(state)
        timeouts = {"timeout_s": self.timeout_s, "rendezvous_s": self.start_timeout_s}
        join_group(address, rank, world_size, self.device, **timeouts)
        self.algorithm.grad_sync = GradientAllReduce(world_size, self.algorithm.loss_reduction)

    def update(self, shard: dict[str, np.ndarray], progress: tuple[int, float | None]) -> None:
        self.algorithm.set_progress(*progress)
        self.algorithm.update(shard)

    def weights(self) -> dict[str, np.ndarray]:
        return self.algorithm.get_weights()


class LearnerGroup:
    """Learner 0's side: joins the group, and cuts each batch for the workers (actor
    handles of `LearnerWorker`)."""

    def __init__(
        self, learner: Learner, workers: list[Any], timeout_s: float, start_timeout_s: float
    ) -> None:
        self.learner = learner
        self.workers = workers
        self.timeout_s = timeout_s  # of each collective
        self.start_timeout_s = start_timeout_s  # of the rendezvous: peers may still be starting

    def join(self, address: str, store: Any) -> None:
        """Join as rank 0 through the rendezvous store learner 0 hosts (`host_rendezvous`)."""
        world = len(self.workers) + 1
        algorithm = self.learner.algorithm
        join_group(
            address, 0, world, str(algorithm.device), self.timeout_s, store, self.start_timeout_s
        )
        algorithm.grad_sync = GradientAllReduce(world, algorithm.loss_reduction)
        self.learner.peers = self.dispatch

    def dispatch(
        self, batch: dict[str, np.ndarray], progress: tuple[int, float | None]
    ) -> tuple[dict[str, np.ndarray], Any]:
        """Send shards 1..N-1 (and the run's progress, for the schedules) to the workers;
        return shard 0 and a wait for them."""
        shards = shard_batch(batch, len(self.workers) + 1)
        refs = [w.update.remote(s, progress) for w, s in zip(self.workers, shards[1:])]
        return shards[0], lambda: self._wait(refs)

    def _wait(self, refs: list[ray.ObjectRef]) -> None:
        """The workers' updates; a dead worker named (the driver restarts the group)."""
        for rank, ref in enumerate(refs, start=1):
            call(ref, f"data-parallel learner {rank}", self.timeout_s)
