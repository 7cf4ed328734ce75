"""`impala`: IMPALA's actor-learner (Espeholt et al. 2018, arXiv 1802.01561).

    EnvRunner x N (CPU copy of the policy) --whole unrolls + behaviour logp--> Learner
        ^                                                                    |
        '---------- weights: one object per version, fetched every k unrolls '

Env runners act with their own copy of the policy and ship whole unrolls
(T+1 observations, actions, rewards, dones, behaviour log-probs and the policy
version that acted) to the learner. The learner cuts them into batches of B
unrolls and trains; a bounded queue pushes back on runners when it falls
behind. The learner puts its weights into Ray's object store once per
version that a runner asks for, so N runners share one copy. V-trace corrects
for the policy lag, which the learner measures and reports.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Literal

import numpy as np
import ray
from pydantic import Field

from rlfabric.architectures.base import RunnerArchConfig, TopologySpec
from rlfabric.architectures.runner_pool import RayEnvRunner
from rlfabric.architectures.topology import LearnerAndRunners, learner_options
from rlfabric.envs import EnvInfo
from rlfabric.observations import batch_len
from rlfabric.runtime.acting import RecurrentStates, UniformActions, act_on_requests
from rlfabric.runtime.faults import call
from rlfabric.runtime.learner import make_algorithm
from rlfabric.runtime.learner_process import LearnerProcess
from rlfabric.runtime.unrolls import UnrollAssembler


class ImpalaConfig(RunnerArchConfig):
    name: Literal["impala"] = Field("impala", description="registered architecture name")
    weights_every: int = Field(
        1, ge=1, description="runners fetch new weights every this many unrolls they ship"
    )


class ImpalaLearner(LearnerProcess):
    """The learner process: batch queue + trainer thread + weight publication."""

    def __init__(
        self,
        spec: TopologySpec,
        env_info: EnvInfo,
        frame_budget: int | None,
        state: dict[str, Any] | None,
    ) -> None:
        super().__init__(
            spec,
            env_info,
            frame_budget,
            state,
            capacity=spec.arch.queue_capacity,
            **learner_options(spec),
        )
        self._weights_lock = threading.Lock()
        self._published: tuple[int, ray.ObjectRef] | None = None
        self._publish_wanted = False  # a runner asked while an update held the lock
        self.learner.on_update = self._publish_if_wanted

    def submit(
        self, unroll: dict[str, np.ndarray], tally: dict[str, Any], key: tuple[int, int]
    ) -> bool:
        """Called by env runners: one unroll and the runner's step counts since its last
        call; blocks while the feed pushes back. False: stop."""
        self.learner.record_steps(tally)
        return self.add_unroll(unroll, key)

    def weights(self) -> list[Any]:
        """[version, ref to the weights]: one object store copy per version asked for.

        Wrapped in a list so that Ray hands the runner the reference, not the
        weights, and the runner fetches them only if the version is new.

        Weights and version are read under the update lock: an update steps the
        weights before it counts the version, so a read in between would tag new (or
        half-stepped) weights with the old version. While an update holds the lock, the
        runner gets the version published last, without waiting, and the update
        publishes its own at its end; trainers that run back to back (replay) would
        otherwise never leave the lock free for a runner's read.
        """
        with self._weights_lock:
            if self._update_lock.acquire(blocking=self._published is None):
                try:
                    self._publish()
                finally:
                    self._update_lock.release()
            else:
                self._publish_wanted = True
            assert self._published is not None
            return list(self._published)

    def _publish(self) -> None:
        """Put the current weights in the object store if their version is new; the
        caller holds the update lock."""
        version = self.learner.policy_version
        if self._published is None or self._published[0] != version:
            self._published = (version, ray.put(self.learner.algorithm.get_weights()))

    def _publish_if_wanted(self) -> None:
        """The end of an update (under its lock): publish if a runner asked during it."""
        if self._publish_wanted:
            self._publish_wanted = False
            self._publish()


class ImpalaEnvRunner(RayEnvRunner):
    """Acts with a local CPU copy of the policy and ships whole unrolls."""

    def __init__(self, spec: TopologySpec, env_info: EnvInfo, index: int, seed: int) -> None:
        super().__init__(spec, env_info, index, seed)
        self.algorithm = make_algorithm(spec, env_info, None, "cpu", sparse=False)
        self.assembler = UnrollAssembler(spec.algo.unroll_length, spec.algo.return_discount())
        self.states = RecurrentStates(self.algorithm.acting_state)
        self.version = -1
        # The loop sets weights and version together; `policy_weights` (another thread of
        # this actor) must never read one without the other.
        self._weights_lock = threading.Lock()
        # A replay algorithm's warm-up: random actions until the learner's first update.
        self.explore = (
            UniformActions(env_info.action_space, seed) if self.algorithm.data == "replay" else None
        )

    def _act(
        self, obs: np.ndarray, state: np.ndarray | None, first: np.ndarray
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        if self.explore is not None and self.version == 0:
            action, extras, state = self.explore(batch_len(obs))
        else:
            action, extras, state = self.algorithm.act(obs, state, first)
        extras["policy_version"] = np.full(len(action), self.version, np.int64)
        return action, extras, state

    def policy_weights(self) -> list[Any]:
        """[version, the weights this runner acts with]: the learner's of that version,
        observation statistics included (for tests and debugging)."""
        with self._weights_lock:
            return [self.version, self.algorithm.get_weights()]

    def _sync_weights(self, learner: Any) -> None:
        version, ref = call(learner.weights.remote(), "the learner")
        if version != self.version:
            weights = call(ref, "the learner")
            with self._weights_lock:
                self.algorithm.set_weights(weights)
                self.version = version
            self.tally.weight_syncs += 1

    def run(self, learner: Any) -> None:
        """Act, step and ship unrolls until the learner says stop."""
        self._sync_weights(learner)
        every = self.spec.arch.weights_every
        shipped = 0
        in_flight: ray.ObjectRef | None = None
        pending = [self.reset(g) for g in range(self.num_groups)]
        while True:
            for group in range(self.num_groups):
                request = pending[group]
                start = time.perf_counter()
                (acted,) = act_on_requests(self._act, self.states, [request])
                self.tally.inference_s += time.perf_counter() - start
                action = acted.action
                unroll = self.assembler.add(
                    request["key"], request, action, acted.extras, acted.state
                )
                if unroll is not None:
                    if in_flight is not None and not call(
                        in_flight, "the learner"
                    ):  # one in flight
                        self.close()
                        return
                    in_flight = learner.submit.remote(unroll, self.tally.take(), request["key"])
                    shipped += 1
                    if shipped % every == 0:
                        self._sync_weights(learner)
                pending[group] = self.step(group, action)


class ImpalaArchitecture(LearnerAndRunners):
    config_cls = ImpalaConfig
    learner_cls = ImpalaLearner
    runner_cls = ImpalaEnvRunner
