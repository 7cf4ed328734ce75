"""`seed`: SEED RL (Espeholt et al. 2020, arXiv 1910.06591).

    EnvRunner x N --(obs, reward, done) per group step--> Learner process:
        ^                                                   InferenceServer (learner's params)
        '------------------- actions ---------------------'        |
                                                           UnrollAssembler -> queue -> trainer

Env runners only step environments. Inference runs in the learner's process
on the learner's own parameters, so there is no weight broadcast. Unrolls are
assembled learner-side, cut into batches of B unrolls and queued with
backpressure: when the trainer falls behind, the queue (SEED's holds one
batch) fills, inference waits, and so do the runners. A short queue keeps the
policy lag small; a long one only buys staleness.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from rlfabric.architectures.base import RunnerArchConfig, TopologySpec
from rlfabric.architectures.runner_pool import RayEnvRunner
from rlfabric.architectures.topology import LearnerAndRunners, learner_options
from rlfabric.envs import EnvInfo
from rlfabric.runtime.acting import RecurrentStates, act_on_requests
from rlfabric.runtime.env_runner import Request
from rlfabric.runtime.faults import call
from rlfabric.runtime.inference import InferenceServer
from rlfabric.runtime.learner_process import LearnerProcess
from rlfabric.runtime.unrolls import UnrollAssembler
from rlfabric.runtime.workers import ThreadPool


class SeedConfig(RunnerArchConfig):
    name: Literal["seed"] = Field("seed", description="registered architecture name")
    inference_min_batch: int = Field(
        1, ge=1, description="envs to wait for (up to the timeout) before a forward pass"
    )
    inference_max_batch: int = Field(1024, ge=1, description="most envs in one forward pass")
    inference_timeout_ms: float = Field(
        2.0, ge=0, description="longest wait for inference_min_batch envs after the first request"
    )


class SeedLearner(LearnerProcess):
    """The learner process: Learner + InferenceServer + unroll assembly + batch queue."""

    def __init__(
        self,
        spec: TopologySpec,
        env_info: EnvInfo,
        frame_budget: int | None,
        state: dict[str, Any] | None,
    ) -> None:
        cfg: SeedConfig = spec.arch
        super().__init__(
            spec,
            env_info,
            frame_budget,
            state,
            capacity=cfg.queue_capacity,
            **learner_options(spec),
        )
        self.states = RecurrentStates(self.learner.algorithm.acting_state)
        self.assembler = UnrollAssembler(spec.algo.unroll_length, spec.algo.return_discount())
        self.server = InferenceServer(
            self._infer_batch,
            min_batch=cfg.inference_min_batch,
            max_batch=cfg.inference_max_batch,
            timeout_s=cfg.inference_timeout_ms / 1000.0,
            stats=self.learner.stats,
        )
        self.server.start()

    def infer(self, request: Request, tally: dict[str, Any]) -> np.ndarray | None:
        """Called by env runners: one group step (and the runner's step counts since its
        last call) in, its actions out (None: stop)."""
        self.learner.record_steps(tally)
        return self.server.infer(request)

    def _infer_batch(self, requests: list[Request]) -> list[np.ndarray]:
        actions = []
        acted_all = act_on_requests(self.learner.act, self.states, requests)
        for request, acted in zip(requests, acted_all):
            unroll = self.assembler.add(
                request["key"], request, acted.action, acted.extras, acted.state
            )
            if unroll is not None:
                self.add_unroll(unroll, request["key"])
            actions.append(acted.action)
        return actions

    def pools(self) -> list[ThreadPool]:
        return [*super().pools(), self.server.batchers]

    def metrics(self, raise_errors: bool = True) -> dict[str, float]:
        metrics = super().metrics(raise_errors)
        metrics["dropped_unrolls"] = self.assembler.dropped_unrolls
        return metrics

    def configure(self, setting: dict[str, int]) -> None:
        """Apply the dynamic adjuster's inference batch size."""
        self.server.max_batch = setting.get("inference_max_batch", self.server.max_batch)

    def stop(self) -> None:
        self._stopping.set()  # first: a batcher blocked on the full queue lets go
        self.server.stop()
        super().stop()


class SeedEnvRunner(RayEnvRunner):
    """Only steps envs: each group step goes to the learner, which answers with actions."""

    def run(self, learner: Any) -> None:
        """Step until the learner answers None; while one group steps, the other infers."""
        pending = [
            learner.infer.remote(self.reset(g), self.tally.take()) for g in range(self.num_groups)
        ]
        while True:
            for group in range(self.num_groups):
                action = call(pending[group], "the learner")
                if action is None:
                    self.close()
                    return
                request = self.step(group, action)
                pending[group] = learner.infer.remote(request, self.tally.take())


class SeedArchitecture(LearnerAndRunners):
    config_cls = SeedConfig
    learner_cls = SeedLearner
    runner_cls = SeedEnvRunner

    def knobs(self) -> dict[str, list[int]]:
        sizes = sorted({2**k for k in range(4, 13)} | {self.spec.arch.inference_max_batch})
        return {**super().knobs(), "inference_max_batch": sizes}

    def setting(self) -> dict[str, int]:
        return {**super().setting(), "inference_max_batch": self.spec.arch.inference_max_batch}
