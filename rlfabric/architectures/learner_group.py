"""Data-parallel learners (`resources.num_learners: N`): learner 0 and N-1 workers.

    learner 0 (inference, unroll assembly, queue or replay, checkpoints)
        | batch -> shards 1..N-1 ---> LearnerWorker x (N-1): algorithm only
        | shard 0: its own update        all-reduce of gradients at every optimizer step
        '-------------------------------------------------------'

Learner 0 is the architecture's own learner process; the workers hold only
the algorithm. Every update, learner 0 sends shards 1..N-1 of the batch to
the workers and trains on shard 0, and every optimizer step all-reduces the
gradients (`platform.distributed`), so the N learners hold identical weights
throughout. Under SEED and GA3C inference stays on learner 0 (its weights are
everyone's): env runners talk to one process, and batching stays as large as
one learner's. The learners share a placement group (PACK), so that they sit
on as few nodes as their resources allow.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlfabric.envs import EnvInfo
from rlfabric.platform.distributed import GradientAllReduce, join_group, shard_batch
from rlfabric.platform.learner import make_algorithm

if TYPE_CHECKING:
    from rlfabric.platform.learner import Learner
    from rlfabric.platform.spec import ExperimentSpec


def device_for_this_actor() -> str:
    """cuda where Ray gave this actor a GPU and torch sees one, else cpu."""
    return "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"


def group_address() -> str:
    """A TCP rendezvous on this node, for the process group (learner 0 hosts it)."""
    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    return f"tcp://{ip}:{port}"


class LearnerWorker:
    """Learners 1..N-1: the algorithm, updated on the shards learner 0 sends."""

    def __init__(self, spec: ExperimentSpec, env_info: EnvInfo, frame_budget: int | None) -> None:
        torch.set_num_threads(spec.resources.torch_threads)
        self.device = device_for_this_actor()
        self.algorithm = make_algorithm(spec, env_info, frame_budget, self.device)

    def ready(self) -> bool:
        return True

    def join(self, address: str, rank: int, world_size: int, state: dict[str, Any]) -> None:
        """Start from learner 0's algorithm state (weights, optimizer), then join the group."""
        self.algorithm.load_state_dict(state)
        join_group(address, rank, world_size, self.device)
        self.algorithm.grad_sync = GradientAllReduce(world_size, self.algorithm.loss_reduction)

    def update(self, shard: dict[str, np.ndarray], progress: float | None) -> None:
        if progress is not None:
            self.algorithm.set_progress(progress)
        self.algorithm.update(shard)

    def weights(self) -> dict[str, np.ndarray]:
        return self.algorithm.get_weights()


class LearnerGroup:
    """Learner 0's side: joins the group, and cuts each batch for the workers."""

    def __init__(self, learner: Learner, workers: list[Any]) -> None:
        self.learner = learner
        self.workers = workers

    def join(self, address: str) -> None:
        world = len(self.workers) + 1
        algorithm = self.learner.algorithm
        join_group(address, 0, world, str(algorithm.device))
        algorithm.grad_sync = GradientAllReduce(world, algorithm.loss_reduction)
        self.learner.peers = self.dispatch

    def dispatch(
        self, batch: dict[str, np.ndarray], progress: float | None
    ) -> tuple[dict[str, np.ndarray], Any]:
        """Send shards 1..N-1 (and the run's progress, for lr annealing) to the workers;
        return shard 0 and a wait for them."""
        shards = shard_batch(batch, len(self.workers) + 1)
        refs = [w.update.remote(s, progress) for w, s in zip(self.workers, shards[1:])]
        return shards[0], lambda: ray.get(refs)


def learner_bundles(spec: ExperimentSpec, gpus: float) -> PlacementGroup:
    """One PACK placement group for all learners: learner 0 takes bundle 0."""
    res = spec.resources
    bundle: dict[str, float] = {"CPU": res.learner_cpus}
    if gpus:
        bundle["GPU"] = gpus
    group = placement_group([dict(bundle) for _ in range(res.num_learners)], strategy="PACK")
    return group


def in_bundle(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index
    )


def start_workers(
    spec: ExperimentSpec,
    env_info: EnvInfo,
    frame_budget: int | None,
    learner0: Any,
    group: PlacementGroup,
    gpus: float,
) -> list[Any]:
    """Create learners 1..N-1 in their bundles and form the process group with learner 0."""
    res = spec.resources
    workers = [
        ray.remote(LearnerWorker)
        .options(num_cpus=res.learner_cpus, num_gpus=gpus, scheduling_strategy=in_bundle(group, i))
        .remote(spec, env_info, frame_budget)
        for i in range(1, res.num_learners)
    ]
    address = ray.get(learner0.group_address.remote())
    state = learner0.algorithm_state.remote()  # one object store copy for every worker
    ray.get(
        [learner0.join_learners.remote(address, workers)]
        + [w.join.remote(address, i + 1, res.num_learners, state) for i, w in enumerate(workers)]
    )
    return workers


def stop_workers(workers: list[Any], group: PlacementGroup | None) -> None:
    for worker in workers:
        ray.kill(worker, no_restart=True)
    if group is not None:
        remove_placement_group(group)
