"""Env runner actors and their pool: launch, replace the ones that crash, resize.

An env runner that dies (its process killed, or its env raising) is replaced
by a new actor with a new run id; the learner drops its partial unroll, and
training goes on. Too many crashes end the run with a clear error.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from rlfabric.algorithms import ALGORITHMS
from rlfabric.architectures.base import TopologySpec
from rlfabric.envs import EnvInfo, ensure_registered
from rlfabric.errors import ActorError, RLFabricError
from rlfabric.runtime.config import LearningSpec
from rlfabric.runtime.env_runner import EnvRunner
from rlfabric.runtime.faults import (
    call,
    capture_warnings,
    exception_line,
    name_actor_error,
)

log = logging.getLogger(__name__)


class RayEnvRunner(EnvRunner):
    """An EnvRunner built from the spec, as a Ray actor builds it."""

    def __init__(self, spec: TopologySpec, env_info: EnvInfo, index: int, seed: int) -> None:
        self.warnings = capture_warnings()
        torch.set_num_threads(spec.resources.runner_threads)
        ensure_registered(env_info)  # an env the user registered in the driver
        super().__init__(spec.env, index, seed, num_groups=spec.arch.env_groups)
        self.spec = spec
        self.env_info = env_info

    def run(self, learner: Any) -> None:
        """Step envs until the learner says stop."""
        raise NotImplementedError

    def pid(self) -> int:
        """The runner's process id (for fault-injection tests and debugging)."""
        return os.getpid()

    def ready(self) -> bool:
        """Answers once the constructor (the envs included) has finished."""
        return True

    def usage(self) -> tuple[float, str, int, list[str]]:
        """CPU time of this runner's process, its node, its group steps so far and its
        warnings since the last call (served by a second actor thread, so it answers
        while `run` waits on a wedged env)."""
        node = ray.get_runtime_context().get_node_id()
        return time.process_time(), node, self.steps_done, self.warnings.take()


def learner_cpus(spec: LearningSpec) -> float:
    """CPUs per learner: the spec's, or one unless the cluster is too small for each
    learner and each starting env runner to have one; then an equal share of them all,
    so that `num_learners: 2` on a 2-core laptop leaves room for its runners."""
    res = spec.resources
    if res.learner_cpus is not None:
        return res.learner_cpus
    total = ray.cluster_resources().get("CPU", 1.0)
    return round(min(1.0, total / (res.num_learners + res.num_env_runners)), 3)


def runner_cpus(spec: TopologySpec) -> float:
    """CPUs per env runner: the spec's, or an equal share of what the learners leave."""
    res = spec.resources
    if res.cpus_per_env_runner is not None:
        return res.cpus_per_env_runner
    total = ray.cluster_resources().get("CPU", 1.0)
    left = total - res.num_learners * learner_cpus(spec)
    return round(max(0.05, min(1.0, left / max_runners(spec))), 3)


def check_fits(role: str, asks: dict[str, float]) -> None:
    """Fail at once for an actor that asks for more than any node has: Ray would keep it
    pending forever."""
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    if not any(all(node.get(k, 0.0) >= v for k, v in asks.items()) for node in nodes):
        largest = max(nodes, key=lambda node: node.get("CPU", 0.0), default={})
        raise RLFabricError(
            f"each {role} actor asks for {asks}, more than any node of the cluster has (the "
            f"largest: {_cpus_and_gpus(largest)}). Lower resources.learner_cpus / "
            "cpus_per_env_runner / num_gpus_per_learner, or add larger nodes"
        )


def wait_until_started(
    actors: list[Any], role: str, asks: dict[str, float], timeout_s: float
) -> None:
    """Fail naming the resources asked for and free rather than wait forever for actors
    that cannot be placed now; raise an actor's own error if its constructor failed.

    Every actor must offer `ready()`, which answers once its constructor has run.
    """
    refs = [actor.ready.remote() for actor in actors]
    _, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if waiting:
        raise RLFabricError(
            f"{len(waiting)} of {len(refs)} {role} actor(s) did not start within "
            f"{timeout_s:g} s (run.start_timeout_s); each asks for {asks}, the cluster has "
            f"{_cpus_and_gpus(ray.cluster_resources())} with "
            f"{_cpus_and_gpus(ray.available_resources())} free. Lower resources.learner_cpus "
            "/ cpus_per_env_runner / num_gpus_per_learner, or add nodes"
        )
    for actor_index, ref in enumerate(refs):  # a constructor's error (an env that cannot be made)
        call(ref, f"the {role}" if len(refs) == 1 else f"{role} {actor_index}")


def _cpus_and_gpus(resources: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in resources.items() if k in ("CPU", "GPU")}


def max_runners(spec: TopologySpec) -> int:
    """The most env runners this run may have at once (the adjuster may add some)."""
    tunable = spec.arch.autotune and ALGORITHMS[spec.algo.name].data != "replay"
    return max(spec.resources.num_env_runners, spec.arch.max_env_runners if tunable else 0)


class RunnerPool:
    """`num_env_runners` actors of one runner class, each running `run(learner)`."""

    def __init__(
        self,
        spec: TopologySpec,
        env_info: EnvInfo,
        runner_cls: type[RayEnvRunner],
        learner: Any,
        seed: int,
    ) -> None:
        self.spec = spec
        self.env_info = env_info
        self.learner = learner
        self.seed = seed
        self.restarts = 0
        self._last: str | None = None  # the last failure's exception, for repeats in a row
        self._same = 0
        # Two threads: `run` loops in one, the driver's `usage` calls use the other. SPREAD
        # puts runners on as many nodes of a cluster as have room: env stepping scales out.
        # Inside a placement group (a Tune trial's) no strategy: the runners then take the
        # group's bundles, where SPREAD would ask the cluster for CPUs the group holds.
        cpus = runner_cpus(spec)
        inside_group = ray.util.get_current_placement_group() is not None
        self._cls = ray.remote(runner_cls).options(
            num_cpus=cpus, max_concurrency=2, scheduling_strategy=None if inside_group else "SPREAD"
        )
        self.runners: dict[int, Any] = {}
        self.loops: dict[int, ray.ObjectRef] = {}
        # index -> (group steps the runner last reported, when that count last changed)
        self.heartbeats: dict[int, tuple[int, float]] = {}
        for index in range(spec.resources.num_env_runners):
            self._launch(index)

    def wait_started(self) -> None:
        """Return once every runner's constructor ran; else kill them all and raise."""
        try:
            wait_until_started(
                list(self.runners.values()),
                "env runner",
                {"CPU": runner_cpus(self.spec)},
                self.spec.run.start_timeout_s,
            )
        except Exception:
            self.stop(wait_s=0)
            raise

    def _launch(self, index: int) -> None:
        seed = self.seed + 7919 * self.restarts  # a restarted runner sees new episodes
        runner = self._cls.remote(self.spec, self.env_info, index, seed)
        self.runners[index] = runner
        self.loops[index] = runner.run.remote(self.learner)
        self.heartbeats[index] = (-1, time.monotonic())

    def check(self) -> None:
        """Replace runners whose loop ended with an error (a crash or an env exception).

        A learner failure that reached a runner's call ends the run with the
        learner's own error: restarting runners cannot mend it. So does an env that
        raises the same exception `max_identical_runner_failures` times in a row.
        """
        done, _ = ray.wait(list(self.loops.values()), num_returns=len(self.loops), timeout=0)
        timeout_s = self.spec.run.runner_timeout_s
        for index, ref in list(self.loops.items()):
            name = f"env runner {index}"
            idle_s = time.monotonic() - self.heartbeats[index][1]
            if ref not in done and idle_s > timeout_s:
                self._count_identical(None, None)
                self._replace(
                    index,
                    f"{name} completed no env step for {idle_s:.0f} s (a wedged env; "
                    f"run.runner_timeout_s={timeout_s:g})",
                )
                continue
            if ref not in done:
                continue
            try:
                ray.get(ref)
                reason, key, error = f"{name}'s loop returned", None, None
            except (RayTaskError, RayActorError) as err:
                error = name_actor_error(err, name)
                if error.actor != name:
                    raise error from None
                # What the env raised, whichever runner: a death (a kill) breaks the row.
                key = exception_line(err.cause) if isinstance(err, RayTaskError) else None
                reason = str(error)
            self._count_identical(key, error)
            self._replace(index, reason)

    def _replace(self, index: int, reason: str) -> None:
        """Count a runner's failure and start a new runner in its place."""
        self.restarts += 1
        limit = self.spec.arch.max_runner_restarts
        if self.restarts > limit:
            raise RLFabricError(
                f"{reason}; that was the runners' failure {self.restarts} (arch."
                f"max_runner_restarts={limit})"
            )
        log.warning("%s; starting a new env runner %d", reason, index)
        ray.kill(self.runners[index], no_restart=True)
        self._launch(index)

    def _count_identical(self, key: str | None, error: ActorError | None) -> None:
        """Count failures in a row that raised the same exception (`key`); end the run at
        the limit with that exception."""
        self._same = self._same + 1 if key is not None and key == self._last else 1
        self._last = key
        limit = self.spec.arch.max_identical_runner_failures
        if key is not None and error is not None and self._same >= limit:
            raise ActorError(
                f"{error}; env runners failed {self._same} times in a row with this same "
                f"error, so restarting will not help (arch.max_identical_runner_failures="
                f"{limit})",
                error.actor,
                error.remote_traceback,
                error.user_error,
            )

    @property
    def size(self) -> int:
        return len(self.runners)

    def usage(self) -> tuple[float, int]:
        """CPU seconds the live runners' processes used so far, and how many nodes hold them;
        notes each runner's heartbeat (its group steps) for `check` and logs its warnings."""
        refs = {r.usage.remote(): index for index, r in self.runners.items()}
        # Answered by a second actor thread, so only a runner that is dying, starting or
        # holding the GIL is late: leave it out (its heartbeat too) rather than wait for it.
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=5.0)
        usage = []
        for ref in done:
            try:
                cpu, node, steps, warnings = ray.get(ref)
            except ray.exceptions.RayError:  # died since check(): the next check replaces it
                continue
            usage.append((cpu, node))
            for line in warnings:
                log.warning("env runner %d: %s", refs[ref], line)
            if steps != self.heartbeats[refs[ref]][0]:
                self.heartbeats[refs[ref]] = (steps, time.monotonic())
        return float(sum(cpu for cpu, _ in usage)), len({node for _, node in usage})

    def resize(self, size: int) -> None:
        """Start runners up to `size`, or retire the newest ones beyond it."""
        for index in range(self.size, size):
            self._launch(index)
        for index in range(self.size - 1, size - 1, -1):
            ray.kill(self.runners.pop(index), no_restart=True)
            del self.loops[index], self.heartbeats[index]

    def stop(self, wait_s: float = 10.0) -> None:
        """Wait briefly for the loops (the learner has told them to stop), then kill."""
        ray.wait(list(self.loops.values()), num_returns=len(self.loops), timeout=wait_s)
        for actor in self.runners.values():
            ray.kill(actor, no_restart=True)
