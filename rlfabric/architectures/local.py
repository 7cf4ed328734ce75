"""`local`: the whole loop in one process, no Ray.

For debugging and for deterministic tests: one EnvRunner, inference and
learning run in turn, so a seed fixes the run. It assembles unrolls exactly
as SEED's learner does and hands them to the same Feed, so it is the serial
reference of SEED.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Literal

import torch
from pydantic import Field

from rlfabric.architectures.base import ArchConfig, Architecture
from rlfabric.runtime.acting import RecurrentStates, act_on_requests
from rlfabric.runtime.env_runner import EnvRunner, Request
from rlfabric.runtime.feeds import make_feed
from rlfabric.runtime.learner import Learner, available_device
from rlfabric.runtime.unrolls import UnrollAssembler


class LocalConfig(ArchConfig):
    name: Literal["local"] = Field("local", description="registered architecture name")


class LocalArchitecture(Architecture):
    config_cls = LocalConfig
    uses_ray = False

    def start(self, state: dict[str, Any] | None = None) -> None:
        spec = self.spec
        torch.set_num_threads(spec.resources.learner_threads)
        # resources.num_gpus_per_learner: one process, so the learner simply takes the GPU
        # (no Ray to place it; the CPU, with a warning, where torch sees none).
        device = available_device("cuda") if spec.resources.num_gpus_per_learner else "cpu"
        self.learner = Learner(spec, self.env_info, self.stop_conditions.env_frames, device)
        if state is not None:
            self.learner.load_state_dict(state)
        seed = spec.run.seed + self.learner.counters["agent_steps"]  # resumed runs see new episodes
        self.runner = EnvRunner(spec.env, index=0, seed=seed)
        self.states = RecurrentStates(self.learner.algorithm.acting_state)
        self.assembler = UnrollAssembler(spec.algo.unroll_length, spec.algo.return_discount())
        # One process: an unbounded queue, drained right after each unroll.
        self.feed = make_feed(
            self.learner,
            spec,
            self.env_info,
            threading.Lock(),
            num_runners=1,
            num_groups=self.runner.num_groups,
            capacity=0,
        )
        if state is not None:
            self.feed.restore(state)
        self._running = threading.Event()  # never set: one process, nothing to stop
        self._stop_seen = False  # a stop condition the learner counts held (step())
        self.pending: list[Request] = [self.runner.reset(g) for g in range(self.runner.num_groups)]

    def step(self) -> dict[str, float]:
        deadline = time.perf_counter() + self.spec.run.report_interval_s
        target = self.stop_conditions.episode_return_mean
        met = self._stop_seen  # the driver went on after one: step the whole interval
        while time.perf_counter() < deadline:
            for group, request in enumerate(self.pending):
                self.pending[group] = self._step_group(group, request)
            if not met and self.learner.stop_met(target):
                self._stop_seen = True
                break
        return self._metrics()

    def _metrics(self) -> dict[str, float]:
        return {**self.learner.metrics(), **self.feed.metrics()}

    def snapshot(self, replay_file: str | None = None) -> tuple[dict[str, float], dict[str, Any]]:
        # One thread: nothing moves in between.
        return self._metrics(), self.get_state(replay_file)

    def replay_chunk(self, offset: int, size: int) -> bytes:
        return self.feed.replay_chunk(offset, size)

    def _step_group(self, group: int, request: Request) -> Request:
        learner = self.learner
        learner.record_steps(self.runner.tally.take())
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
        if unroll is not None:
            self.feed.add_unroll(unroll, request["key"], self._running)
            while self.feed.train_step(timeout=0):  # every update the new data allows
                pass
        return self.runner.step(group, action)

    def policy_weights(self) -> dict[str, Any]:
        return self.learner.algorithm.get_weights()

    def get_state(self, replay_file: str | None = None) -> dict[str, Any]:
        return {**self.learner.state_dict(), **self.feed.checkpoint(replay_file)}

    def stop(self) -> None:
        if hasattr(self, "runner"):
            self.runner.close()
