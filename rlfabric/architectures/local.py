"""`local`: the whole loop in one process, no Ray.

For debugging and for deterministic tests: one EnvRunner, inference and
learning run in turn, so a seed fixes the run. It assembles unrolls and
batches exactly as SEED's learner does, so it is the serial reference of SEED.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Literal

import torch
from pydantic import Field

from rlfabric.architectures.base import ArchConfig, Architecture
from rlfabric.platform.acting import RecurrentStates, act_on_requests
from rlfabric.platform.env_runner import EnvRunner, Request, tally
from rlfabric.platform.learner import Learner
from rlfabric.platform.replay_feed import ReplayFeed
from rlfabric.platform.unrolls import BatchBuilder, UnrollAssembler


class LocalConfig(ArchConfig):
    name: Literal["local"] = Field("local", description="registered architecture name")


class LocalArchitecture(Architecture):
    config_cls = LocalConfig
    uses_ray = False

    def start(self, state: dict[str, Any] | None = None) -> None:
        spec = self.spec
        torch.set_num_threads(spec.resources.torch_threads)
        self.learner = Learner(spec, self.env_info, self.stop_conditions.env_frames)
        if state is not None:
            self.learner.load_state_dict(state)
        seed = spec.run.seed + self.learner.counters["agent_steps"]  # resumed runs see new episodes
        self.runner = EnvRunner(spec.env, index=0, seed=seed)
        self.states = RecurrentStates(self.learner.algorithm.initial_state)
        self.assembler = UnrollAssembler(spec.algo.unroll_length)
        self.batches = BatchBuilder(spec.algo.batch_size)
        self.replay = ReplayFeed.for_learner(
            self.learner, spec, self.env_info, 1, self.runner.num_groups, threading.Lock(), state
        )
        self._running = threading.Event()  # never set: one process, nothing to stop
        self.pending: list[Request] = [self.runner.reset(g) for g in range(self.runner.num_groups)]

    def step(self) -> dict[str, float]:
        deadline = time.perf_counter() + self.spec.run.report_interval_s
        budget = self.stop_conditions.env_frames
        while time.perf_counter() < deadline:
            for group, request in enumerate(self.pending):
                self.pending[group] = self._step_group(group, request)
            if budget and self.learner.counters["env_frames"] >= budget:
                break
        metrics = self.learner.metrics()
        if self.replay is not None:
            metrics.update(self.replay.metrics())
        return metrics

    def _step_group(self, group: int, request: Request) -> Request:
        learner = self.learner
        learner.record_steps(tally(request))
        start = time.perf_counter()
        (acted,) = act_on_requests(learner.act, self.states, [request])
        action = acted.action
        learner.stats.add_many(
            {
                "inference_ms": 1000.0 * (time.perf_counter() - start),
                "inference_batch_envs": len(action),
            }
        )
        unroll = self.assembler.add(request["key"], request, action, acted.extras, acted.state)
        if unroll is not None and self.replay is not None:
            self.replay.add_unroll(unroll, request["key"], self._running)
            while self.replay.train_step(timeout=0):  # every update the new data is owed
                pass
        elif unroll is not None:
            for batch in self.batches.add(unroll):
                learner.update(batch)
        return self.runner.step(group, action)

    def policy_weights(self) -> dict[str, Any]:
        return self.learner.algorithm.get_weights()

    def get_state(self) -> dict[str, Any]:
        state = self.learner.state_dict()
        if self.replay is not None:
            state["replay"] = self.replay.state_dict()
        return state

    def stop(self) -> None:
        if hasattr(self, "runner"):
            self.runner.close()
