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

from rlfabric.algorithms import ALGORITHMS
from rlfabric.architectures.base import TopologySpec
from rlfabric.envs import EnvInfo
from rlfabric.errors import RLFabricError
from rlfabric.runtime.env_runner import EnvRunner

log = logging.getLogger(__name__)


class RayEnvRunner(EnvRunner):
    """An EnvRunner built from the spec, as a Ray actor builds it."""

    def __init__(self, spec: TopologySpec, env_info: EnvInfo, index: int, seed: int) -> None:
        torch.set_num_threads(spec.resources.runner_threads)
        super().__init__(spec.env, index, seed, num_groups=spec.arch.env_groups)
        self.spec = spec
        self.env_info = env_info

    def run(self, learner: Any) -> None:
        """Step envs until the learner says stop."""
        raise NotImplementedError

    def pid(self) -> int:
        """The runner's process id (for fault-injection tests and debugging)."""
        return os.getpid()

    def usage(self) -> tuple[float, str]:
        """CPU time of this runner's process and its node (served by a second actor thread)."""
        return time.process_time(), ray.get_runtime_context().get_node_id()


def runner_cpus(spec: TopologySpec) -> float:
    """CPUs per env runner: the spec's, or an equal share of what the learner leaves."""
    res = spec.resources
    if res.cpus_per_env_runner is not None:
        return res.cpus_per_env_runner
    total = ray.cluster_resources().get("CPU", 1.0)
    return round(max(0.05, min(1.0, (total - res.learner_cpus) / max_runners(spec))), 3)


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
        # Two threads: `run` loops in one, the driver's `usage` calls use the other. SPREAD
        # puts runners on as many nodes of a cluster as have room: env stepping scales out.
        self._cls = ray.remote(runner_cls).options(
            num_cpus=runner_cpus(spec), max_concurrency=2, scheduling_strategy="SPREAD"
        )
        self.runners: dict[int, Any] = {}
        self.loops: dict[int, ray.ObjectRef] = {}
        for index in range(spec.resources.num_env_runners):
            self._launch(index)

    def _launch(self, index: int) -> None:
        seed = self.seed + 7919 * self.restarts  # a restarted runner sees new episodes
        runner = self._cls.remote(self.spec, self.env_info, index, seed)
        self.runners[index] = runner
        self.loops[index] = runner.run.remote(self.learner)

    def check(self) -> None:
        """Replace runners whose loop ended with an error (a crash or an env exception)."""
        done, _ = ray.wait(list(self.loops.values()), num_returns=len(self.loops), timeout=0)
        for index, ref in list(self.loops.items()):
            if ref not in done:
                continue
            try:
                ray.get(ref)
                reason = "its loop returned"
            except Exception as err:  # RayActorError, or RayTaskError from the env
                reason = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            self.restarts += 1
            limit = self.spec.arch.max_runner_restarts
            if self.restarts > limit:
                raise RLFabricError(
                    f"env runner {index} failed ({reason}) after {self.restarts - 1} runner "
                    f"restarts; arch.max_runner_restarts={limit}"
                )
            log.warning("env runner %d stopped (%s); starting a new one", index, reason)
            ray.kill(self.runners[index], no_restart=True)
            self._launch(index)

    @property
    def size(self) -> int:
        return len(self.runners)

    def usage(self) -> tuple[float, int]:
        """CPU seconds the live runners' processes used so far, and how many nodes hold them."""
        usage = ray.get([r.usage.remote() for r in self.runners.values()])
        return float(sum(cpu for cpu, _ in usage)), len({node for _, node in usage})

    def resize(self, size: int) -> None:
        """Start runners up to `size`, or retire the newest ones beyond it."""
        for index in range(self.size, size):
            self._launch(index)
        for index in range(self.size - 1, size - 1, -1):
            ray.kill(self.runners.pop(index), no_restart=True)
            del self.loops[index]

    def stop(self) -> None:
        """Wait briefly for the loops (the learner has told them to stop), then kill."""
        ray.wait(list(self.loops.values()), num_returns=len(self.loops), timeout=10)
        for actor in self.runners.values():
            ray.kill(actor, no_restart=True)
