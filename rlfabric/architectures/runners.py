"""The actors the Ray topologies share: env runners, the learner process, the driver.

An env runner that dies (its process killed, or its env raising) is replaced
by a new actor with a new run id; the learner drops its partial unroll, and
training goes on. Too many crashes end the run with a clear error. Every
learner actor is a `LearnerProcess`: the Learner, a bounded queue whose
blocking `put` is the backpressure on runners, and trainer threads.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import ray
import torch
from pydantic import Field

from rlfabric.algorithms import ALGORITHMS
from rlfabric.architectures.base import ArchConfig, Architecture
from rlfabric.architectures.learner_group import (
    LearnerGroup,
    device_for_this_actor,
    group_address,
    in_bundle,
    learner_bundles,
    start_workers,
    stop_workers,
)
from rlfabric.architectures.replay_actor import RemoteReplayBuffer
from rlfabric.envs import EnvInfo
from rlfabric.platform.autotune import DynamicAdjuster
from rlfabric.platform.env_runner import EnvRunner
from rlfabric.platform.errors import RLFabricError
from rlfabric.platform.learner import Learner
from rlfabric.platform.replay import ReplayBuffer
from rlfabric.platform.replay_feed import ReplayFeed
from rlfabric.platform.unrolls import BatchBuilder
from rlfabric.platform.workers import ThreadPool

if TYPE_CHECKING:
    from rlfabric.platform.spec import ExperimentSpec

log = logging.getLogger(__name__)


class RunnerArchConfig(ArchConfig):
    """Fields of every topology with env runner actors."""

    env_groups: int = Field(2, ge=1, description="env groups per runner that step alternately")
    queue_capacity: int = Field(
        1, ge=1, description="batches queued for the trainer (backpressure)"
    )
    max_runner_restarts: int = Field(
        100, ge=0, description="env runner crashes tolerated before the run fails"
    )
    autotune: bool = Field(
        False,
        description="GA3C's dynamic adjuster: random-walk the worker counts (and batch sizes) "
        "every autotune_interval_s, keeping a change only if learner throughput did not fall",
    )
    autotune_interval_s: float = Field(20.0, gt=0, description="seconds per adjuster window")
    max_env_runners: int = Field(
        4, ge=1, description="most env runners the adjuster may run (with autotune)"
    )


class LearnerProcess:
    """What every learner actor has: the Learner, a bounded queue and trainer threads.

    The queue holds batches by default (`enqueue_unroll` cuts unrolls into
    batches of B); GA3C's holds unrolls and overrides `train_on`. A full queue
    blocks the caller: that is the backpressure that keeps the policy lag small.
    For a replay algorithm, unrolls go into a `ReplayFeed` instead and trainer
    threads sample it; the feed's update-to-data ratio is the backpressure.
    """

    queue_metric = "batch_queue"

    def __init__(
        self,
        spec: ExperimentSpec,
        env_info: EnvInfo,
        frame_budget: int | None,
        state: dict[str, Any] | None,
        queue_capacity: int,
        trainers: int = 1,
    ) -> None:
        torch.set_num_threads(spec.resources.torch_threads)
        # Inference threads need the GIL for a moment between torch ops while a trainer
        # runs; Python's default 5 ms switch interval would add up to 5 ms per op.
        sys.setswitchinterval(0.0005)
        # Requests and unrolls arrive as read-only arrays from Ray's object store; we only read.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        # A GPU Ray gave this actor (resources.num_gpus_per_learner) trains and infers.
        self.device = device_for_this_actor()
        self.learner = Learner(spec, env_info, frame_budget, self.device)
        if state is not None:
            self.learner.load_state_dict(state)
        self.queue: queue.Queue[dict[str, np.ndarray]] = queue.Queue(queue_capacity)
        self.batch_builder = BatchBuilder(spec.algo.batch_size)
        self._builder_lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._stopping = threading.Event()
        self.replay = ReplayFeed.for_learner(
            self.learner,
            spec,
            env_info,
            spec.resources.num_env_runners,
            spec.arch.env_groups,
            self._update_lock,
            state,
            RemoteReplayBuffer.from_spaces
            if spec.resources.replay_actor
            else ReplayBuffer.from_spaces,
        )
        self.trainers = ThreadPool(self._train_step, "trainer")
        self.trainers.resize(trainers)

    def put(self, item: dict[str, np.ndarray]) -> bool:
        """Queue `item`, blocking while the queue is full; False once stopping."""
        while not self._stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def enqueue_unroll(self, unroll: dict[str, np.ndarray], key: tuple[int, int]) -> bool:
        """Cut unrolls into batches of B and queue each (or store them for replay).

        `key` is the (runner index, env group) the unroll came from. False once stopping.
        """
        if self.replay is not None:
            return self.replay.add_unroll(unroll, key, self._stopping)
        with self._builder_lock:
            batches = self.batch_builder.add(unroll)
        return all(self.put(batch) for batch in batches)

    def _train_step(self) -> None:
        if self.replay is not None:
            self.replay.train_step()
            return
        try:
            item = self.queue.get(timeout=0.1)
        except queue.Empty:
            return
        self.train_on(item)

    def train_on(self, batch: dict[str, np.ndarray]) -> None:
        with self._update_lock:  # one optimizer step at a time, and never mid-checkpoint
            self.learner.update(batch)

    def pools(self) -> list[ThreadPool]:
        return [self.trainers]

    # -- called by the driver -----------------------------------------------------
    def ready(self) -> bool:
        """Answers once the constructor has finished (the driver waits for it)."""
        return True

    def group_address(self) -> str:
        return group_address()

    def policy_weights(self) -> dict[str, np.ndarray]:
        return self.learner.algorithm.get_weights()

    def algorithm_state(self) -> dict[str, Any]:
        with self._update_lock:
            return self.learner.algorithm.state_dict()

    def join_learners(self, address: str, workers: list[Any]) -> None:
        """Become learner 0 of a data-parallel group (`architectures.learner_group`)."""
        LearnerGroup(self.learner, workers).join(address)

    def metrics(self) -> dict[str, float]:
        for pool in self.pools():
            if pool.error is not None:
                raise pool.error
        metrics = self.learner.metrics()
        metrics["learner_on_gpu"] = float(self.device == "cuda")
        if self.replay is not None:
            metrics.update(self.replay.metrics())
        else:
            metrics[self.queue_metric] = self.queue.qsize()
        return metrics

    def configure(self, setting: dict[str, int]) -> None:
        """Apply the dynamic adjuster's learner-side knobs (none by default)."""

    def get_state(self) -> dict[str, Any]:
        with self._update_lock:
            state = self.learner.state_dict()
            if self.replay is not None:
                state["replay"] = self.replay.state_dict()
            return state

    def stop(self) -> None:
        self._stopping.set()
        for pool in self.pools():
            pool.stop()
        if isinstance(getattr(self.replay, "buffer", None), RemoteReplayBuffer):
            self.replay.buffer.close()


class RayEnvRunner(EnvRunner):
    """An EnvRunner built from the spec, as a Ray actor builds it."""

    def __init__(self, spec: ExperimentSpec, env_info: EnvInfo, index: int, seed: int) -> None:
        torch.set_num_threads(spec.resources.torch_threads)
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


def runner_cpus(spec: ExperimentSpec) -> float:
    """CPUs per env runner: the spec's, or an equal share of what the learner leaves."""
    res = spec.resources
    if res.cpus_per_env_runner is not None:
        return res.cpus_per_env_runner
    total = ray.cluster_resources().get("CPU", 1.0)
    return round(max(0.05, min(1.0, (total - res.learner_cpus) / max_runners(spec))), 3)


def max_runners(spec: ExperimentSpec) -> int:
    """The most env runners this run may have at once (the adjuster may add some)."""
    tunable = spec.arch.autotune and ALGORITHMS[spec.algo.name].data != "replay"
    return max(spec.resources.num_env_runners, spec.arch.max_env_runners if tunable else 0)


class RunnerPool:
    """`num_env_runners` actors of one runner class, each running `run(learner)`."""

    def __init__(
        self,
        spec: ExperimentSpec,
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


class LearnerAndRunners(Architecture):
    """A learner actor and a pool of env runner actors: what SEED and IMPALA share.

    Subclasses name the two actor classes. The learner actor must offer
    `metrics()`, `get_state()` and `stop()`; once stopped it tells the runners
    to end their loops, which `run(learner)` must then do.
    """

    learner_cls: ClassVar[type]
    runner_cls: ClassVar[type[RayEnvRunner]]

    def knobs(self) -> dict[str, list[int]]:
        """What the dynamic adjuster may change: name -> allowed values, in order.

        Not the runner count of a replay algorithm: its buffer has one stream per env.
        """
        if ALGORITHMS[self.spec.algo.name].data == "replay":
            return {}
        return {"env_runners": list(range(1, self.spec.arch.max_env_runners + 1))}

    def _start_autotune(self) -> None:
        self.adjuster: DynamicAdjuster | None = None
        if not self.spec.arch.autotune:
            return
        knobs = self.knobs()
        if not knobs:
            return
        start = {name: self.setting()[name] for name in knobs}
        self.adjuster = DynamicAdjuster(knobs, start, seed=self.spec.run.seed)
        self._window = (time.perf_counter(), 0)

    def setting(self) -> dict[str, int]:
        """The current values of the knobs (the learner-side ones from the spec)."""
        return {"env_runners": self.runners.size}

    def _autotune(self, metrics: dict[str, float]) -> None:
        """At the end of each window, let the adjuster judge it and apply its next setting."""
        assert self.adjuster is not None
        started, samples = self._window
        now = time.perf_counter()
        if now - started >= self.spec.arch.autotune_interval_s:
            throughput = (metrics["learner_samples"] - samples) / (now - started)
            setting = self.adjuster.step(throughput)
            self.runners.resize(setting.get("env_runners", self.runners.size))
            ray.get(self.learner.configure.remote(setting))
            self._window = (now, metrics["learner_samples"])
        metrics.update({f"autotune_{k}": v for k, v in self.adjuster.setting.items()})

    def start(self, state: dict[str, Any] | None = None) -> None:
        spec = self.spec
        res = spec.resources
        gpus = res.num_gpus_per_learner
        if gpus and ray.cluster_resources().get("GPU", 0.0) < gpus:
            log.warning(
                "resources.num_gpus_per_learner=%s but the cluster has %s GPUs: the learner "
                "trains (and serves inference) on CPU",
                gpus,
                ray.cluster_resources().get("GPU", 0.0),
            )
            gpus = 0.0
        self.workers: list[Any] = []
        self.learner_group = learner_bundles(spec, gpus) if res.num_learners > 1 else None
        if self.learner_group is not None:
            ray.get(self.learner_group.ready(), timeout=120)
        self.learner = (
            ray.remote(self.learner_cls)
            .options(
                num_cpus=res.learner_cpus,
                num_gpus=gpus,
                scheduling_strategy=(
                    None if self.learner_group is None else in_bundle(self.learner_group, 0)
                ),
                # one thread per runner group call plus the driver's calls
                max_concurrency=max_runners(spec) * spec.arch.env_groups + 4,
            )
            .remote(spec, self.env_info, self.stop_conditions.env_frames, state)
        )
        self._wait_until_started(self.learner, "learner")
        if self.learner_group is not None:
            budget = self.stop_conditions.env_frames
            self.workers = start_workers(
                spec, self.env_info, budget, self.learner, self.learner_group, gpus
            )
        seed = spec.run.seed + (state["counters"]["agent_steps"] if state else 0)
        self.runners = RunnerPool(spec, self.env_info, self.runner_cls, self.learner, seed)
        self._start_autotune()

    @staticmethod
    def _wait_until_started(actor: Any, role: str, timeout_s: float = 120.0) -> None:
        """Fail with the cluster's resources rather than wait forever for an actor that
        cannot be placed (it asks for more CPUs or GPUs than are free)."""
        ready, _ = ray.wait([actor.ready.remote()], timeout=timeout_s)
        if not ready:
            raise RLFabricError(
                f"the {role} actor did not start within {timeout_s:.0f} s; the cluster has "
                f"{ray.cluster_resources()} with {ray.available_resources()} free. Lower "
                "resources.learner_cpus / cpus_per_env_runner or add nodes"
            )
        ray.get(ready[0])  # raises the actor's own error if its constructor failed

    def step(self) -> dict[str, float]:
        time.sleep(self.spec.run.report_interval_s)
        self.runners.check()
        metrics = ray.get(self.learner.metrics.remote())
        metrics["runner_restarts"] = self.runners.restarts
        metrics["runners_cpu_s"], metrics["runner_nodes"] = self.runners.usage()
        if self.adjuster is not None:
            self._autotune(metrics)
        return metrics

    def get_state(self) -> dict[str, Any]:
        return ray.get(self.learner.get_state.remote())

    def policy_weights(self) -> dict[str, Any]:
        return ray.get(self.learner.policy_weights.remote())

    def stop(self) -> None:
        if not hasattr(self, "learner"):
            return
        try:
            ray.get(self.learner.stop.remote(), timeout=30)
        except Exception as err:  # already dead: nothing left to stop gracefully
            log.debug("learner stop: %s", err)
        if hasattr(self, "runners"):
            self.runners.stop()
        ray.kill(self.learner, no_restart=True)
        stop_workers(self.workers, self.learner_group)
        del self.learner
