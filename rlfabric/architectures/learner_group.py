"""Placing data-parallel learners (`resources.num_learners: N`): learner 0 and N-1 workers.

The learners themselves are runtime pieces (`runtime.data_parallel`):
learner 0 is the architecture's own learner process, the workers hold only
the algorithm and all-reduce gradients with it at every optimizer step.
Under SEED and GA3C inference stays on learner 0 (its weights are
everyone's): env runners talk to one process, and batching stays as large as
one learner's. The learners share a placement group (PACK), so that they sit
on as few nodes as their resources allow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlfabric.architectures.runner_pool import learner_cpus
from rlfabric.envs import EnvInfo
from rlfabric.runtime.data_parallel import LearnerWorker
from rlfabric.runtime.faults import call

if TYPE_CHECKING:
    from rlfabric.runtime.config import LearningSpec


def learner_bundles(spec: LearningSpec, gpus: float) -> PlacementGroup:
    """One PACK placement group for all learners: learner 0 takes bundle 0."""
    res = spec.resources
    bundle: dict[str, float] = {"CPU": learner_cpus(spec)}
    if gpus:
        bundle["GPU"] = gpus
    group = placement_group([dict(bundle) for _ in range(res.num_learners)], strategy="PACK")
    return group


def in_bundle(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index
    )


def start_workers(
    spec: LearningSpec,
    env_info: EnvInfo,
    frame_budget: int | None,
    learner0: Any,
    group: PlacementGroup,
    gpus: float,
) -> list[Any]:
    """Create learners 1..N-1 in their bundles and form the process group with learner 0."""
    res = spec.resources
    workers = [
        ray.remote(concurrency_groups={"watch": 1})(LearnerWorker)  # `watch` beside the updates
        .options(
            num_cpus=learner_cpus(spec),
            num_gpus=gpus,
            scheduling_strategy=in_bundle(group, i),
        )
        .remote(spec, env_info, frame_budget)
        for i in range(1, res.num_learners)
    ]
    timeout_s = spec.run.start_timeout_s
    address = call(learner0.group_address.remote(), "the learner", timeout_s)
    state = learner0.algorithm_state.remote()  # one object store copy for every worker
    joins = [learner0.join_learners.remote(address, workers)] + [
        w.join.remote(address, i + 1, res.num_learners, state) for i, w in enumerate(workers)
    ]  # all at once: each waits in the rendezvous for the others
    for i, ref in enumerate(joins):
        call(ref, "the learner" if i == 0 else f"data-parallel learner {i}", timeout_s)
    return workers


def stop_workers(workers: list[Any], group: PlacementGroup | None) -> None:
    for worker in workers:
        ray.kill(worker, no_restart=True)
    if group is not None:
        remove_placement_group(group)
