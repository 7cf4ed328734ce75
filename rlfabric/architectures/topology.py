"""The driver's side of the topologies with a learner actor and env runner actors.

SEED, IMPALA and GA3C share it: start the learner actor (in a placement
group with its data-parallel workers, on a GPU where there is one), then the
runner pool, and each reporting interval replace crashed runners, read the
learner's metrics and let the dynamic adjuster act. Each topology file only
names its two actor classes and what its paper adds.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

import ray

from rlfabric.algorithms import ALGORITHMS
from rlfabric.architectures.base import Architecture, TopologySpec
from rlfabric.architectures.learner_group import (
    in_bundle,
    learner_bundles,
    start_workers,
    stop_workers,
)
from rlfabric.architectures.replay_actor import RemoteReplayBuffer, replay_contents_served
from rlfabric.architectures.runner_pool import (
    RayEnvRunner,
    RunnerPool,
    check_fits,
    learner_cpus,
    max_runners,
    runner_cpus,
    wait_until_started,
)
from rlfabric.errors import ActorError, RLFabricError
from rlfabric.runtime.autotune import DynamicAdjuster
from rlfabric.runtime.config import ResourcesConfig
from rlfabric.runtime.faults import call
from rlfabric.runtime.replay import ReplayBuffer

log = logging.getLogger(__name__)


def learner_options(spec: TopologySpec) -> dict[str, Any]:
    """`LearnerProcess` keyword arguments every topology passes the same way."""
    replay_actor = spec.resources.replay_actor
    return {
        "env_groups": spec.arch.env_groups,
        "buffer_factory": (
            RemoteReplayBuffer.from_spaces if replay_actor else ReplayBuffer.from_spaces
        ),
    }


class LearnerAndRunners(Architecture):
    """A learner actor and a pool of env runner actors: what SEED, IMPALA and GA3C share.

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
            self._ask(self.learner.configure.remote(setting))
            self._window = (now, metrics["learner_samples"])
        metrics.update({f"autotune_{k}": v for k, v in self.adjuster.setting.items()})

    def start(self, state: dict[str, Any] | None = None) -> None:
        spec = self.spec
        res = spec.resources
        gpus = learner_gpus(res, ray.cluster_resources().get("GPU", 0.0))
        self.workers: list[Any] = []
        self._worker_exits: list[ray.ObjectRef] = []  # calls that fail when a worker dies
        self.learner_group = learner_bundles(spec, gpus) if res.num_learners > 1 else None
        cpus = learner_cpus(spec)
        asks = {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}
        check_fits("learner", asks)  # before anything starts: what can never be placed
        check_fits("env runner", {"CPU": runner_cpus(spec)})
        if self.learner_group is not None:
            ready, _ = ray.wait([self.learner_group.ready()], timeout=spec.run.start_timeout_s)
            if not ready:
                raise RLFabricError(
                    f"the placement group of {res.num_learners} learners, each asking for "
                    f"{asks}, was not placed within {spec.run.start_timeout_s:.0f} s; the "
                    f"cluster has {ray.cluster_resources()} with {ray.available_resources()} "
                    "free. Lower resources.num_learners / learner_cpus or add nodes"
                )
        learner_cls = ray.remote(self.learner_cls).options(
            num_cpus=cpus,
            num_gpus=gpus,
            scheduling_strategy=(
                None if self.learner_group is None else in_bundle(self.learner_group, 0)
            ),
            # one thread per runner group call plus the driver's calls (its wait between
            # reports among them)
            max_concurrency=max_runners(spec) * spec.arch.env_groups + 5,
        )
        budget = self.stop_conditions.env_frames
        seed = spec.run.seed + (state["counters"]["agent_steps"] if state else 0)
        try:
            with replay_contents_served(state) as learner_state:
                self.learner = learner_cls.remote(spec, self.env_info, budget, learner_state)
                if self.learner_group is None:
                    # No data-parallel peers to join first: the runners' processes start
                    # (import, make their envs) while the learner's does, not after it;
                    # their first calls wait in the learner's queue. Seconds off every start.
                    self.runners = RunnerPool(
                        spec, self.env_info, self.runner_cls, self.learner, seed
                    )
                wait_until_started([self.learner], "learner", asks, spec.run.start_timeout_s)
            if self.learner_group is not None:
                self.workers = start_workers(
                    spec, self.env_info, budget, self.learner, self.learner_group, gpus
                )
                self._worker_exits = [worker.watch.remote() for worker in self.workers]
                self.runners = RunnerPool(spec, self.env_info, self.runner_cls, self.learner, seed)
            self.runners.wait_started()
        except Exception:
            self._stop_runners(wait_s=0)  # they would wait for a learner that never came
            raise
        self._stop_seen = False
        self._start_autotune()

    def step(self) -> dict[str, float]:
        interval = self.spec.run.report_interval_s
        if self._stop_seen:  # the driver went on after one: wait as if none were seen
            time.sleep(interval)
        else:
            target = self.stop_conditions.episode_return_mean
            self._stop_seen = self._ask(self.learner.wait_for_stop.remote(interval, target))
        try:
            self._check_learners()
            self.runners.check()
            metrics = self._with_runners(self._ask(self.learner.metrics.remote()))
        except ActorError as err:
            if not err.died and self._worker_exits:
                # A peer's death reaches learner 0 first as a failed all-reduce: name the
                # death, which a restart mends, if Ray reports it within seconds.
                self._check_learners(wait_s=5.0)
            raise
        for line in self._ask(self.learner.take_warnings.remote()):
            log.warning("the learner: %s", line)
        if self.adjuster is not None:
            self._autotune(metrics)
        return metrics

    def snapshot(self, replay_file: str | None = None) -> tuple[dict[str, float], dict[str, Any]]:
        metrics, state = self._ask(self.learner.snapshot.remote(replay_file))
        return self._with_runners(metrics), state

    def replay_chunk(self, offset: int, size: int) -> bytes:
        return self._ask(self.learner.replay_chunk.remote(offset, size))

    def _with_runners(self, metrics: dict[str, float]) -> dict[str, float]:
        metrics["runner_restarts"] = self.runners.restarts
        metrics["runners_cpu_s"], metrics["runner_nodes"] = self.runners.usage()
        return metrics

    def _ask(self, ref: ray.ObjectRef) -> Any:
        """The learner's answer, within run.actor_timeout_s; its failure named."""
        return call(ref, "the learner", self.spec.run.actor_timeout_s)

    def _check_learners(self, wait_s: float = 0.0) -> None:
        """Raise naming a data-parallel learner that died (within `wait_s`): learner 0
        would otherwise wait for it in the all-reduce, holding the update lock."""
        if not self._worker_exits:
            return
        done, _ = ray.wait(self._worker_exits, num_returns=1, timeout=wait_s)
        for index, ref in enumerate(self._worker_exits, start=1):
            if ref in done:
                call(ref, f"data-parallel learner {index}")  # raises: it died

    def get_state(self) -> dict[str, Any]:
        return self._ask(self.learner.get_state.remote())

    def policy_weights(self) -> dict[str, Any]:
        return self._ask(self.learner.policy_weights.remote())

    def _stop_runners(self, wait_s: float) -> None:
        """Stop the runner pool if one was created; a failed start leaves none for stop()."""
        runners = self.__dict__.pop("runners", None)
        if runners is not None:
            runners.stop(wait_s=wait_s)

    def stop(self) -> None:
        if hasattr(self, "learner"):
            try:
                ray.get(self.learner.stop.remote(), timeout=30)
            except Exception as err:  # already dead: nothing left to stop gracefully
                log.debug("learner stop: %s", err)
            self._stop_runners(wait_s=10.0)
            ray.kill(self.learner, no_restart=True)
            del self.learner
        if hasattr(self, "learner_group"):  # also when the learners were never placed
            stop_workers(self.workers, self.learner_group)
            del self.learner_group


def learner_gpus(res: ResourcesConfig, cluster_gpus: float) -> float:
    """The GPUs each learner asks Ray for: `num_gpus_per_learner`, or 0 (the learners
    train on CPU, with a warning) where the cluster has fewer GPUs than all the
    learners together ask for; data-parallel learners never share one."""
    gpus = res.num_gpus_per_learner
    total = gpus * res.num_learners
    if gpus and cluster_gpus < total:
        asked = f" x num_learners={res.num_learners} = {total:g}" if res.num_learners > 1 else ""
        log.warning(
            "resources.num_gpus_per_learner=%s%s but the cluster has %s GPUs: the learner "
            "trains (and serves inference) on CPU",
            gpus,
            asked,
            cluster_gpus,
        )
        return 0.0
    return gpus
