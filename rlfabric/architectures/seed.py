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

import logging
import queue
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import ray
import torch
from pydantic import Field

from rlfabric.architectures.runners import LearnerAndRunners, RayEnvRunner, RunnerArchConfig
from rlfabric.envs import EnvInfo
from rlfabric.platform.acting import RecurrentStates, act_on_requests
from rlfabric.platform.env_runner import Request, tally
from rlfabric.platform.inference import InferenceServer
from rlfabric.platform.learner import Learner
from rlfabric.platform.unrolls import BatchBuilder, UnrollAssembler

if TYPE_CHECKING:
    from rlfabric.platform.spec import ExperimentSpec

log = logging.getLogger(__name__)


class SeedConfig(RunnerArchConfig):
    name: Literal["seed"] = Field("seed", description="registered architecture name")
    inference_min_batch: int = Field(
        1, ge=1, description="envs to wait for (up to the timeout) before a forward pass"
    )
    inference_max_batch: int = Field(1024, ge=1, description="most envs in one forward pass")
    inference_timeout_ms: float = Field(
        2.0, ge=0, description="longest wait for inference_min_batch envs after the first request"
    )


class SeedLearner:
    """The learner process: Learner + InferenceServer + unroll queue + trainer thread."""

    def __init__(
        self,
        spec: ExperimentSpec,
        env_info: EnvInfo,
        frame_budget: int | None,
        state: dict[str, Any] | None,
    ) -> None:
        torch.set_num_threads(spec.resources.torch_threads)
        # The batcher thread needs the GIL for a moment between torch ops while the trainer
        # thread runs; Python's default 5 ms switch interval would add up to 5 ms per op.
        sys.setswitchinterval(0.0005)
        # Requests arrive as read-only arrays from Ray's object store; we only read them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        cfg: SeedConfig = spec.arch  # type: ignore[assignment]
        self.learner = Learner(spec, env_info, frame_budget)
        if state is not None:
            self.learner.load_state_dict(state)
        self.states = RecurrentStates(self.learner.algorithm.initial_state)
        self.assembler = UnrollAssembler(spec.algo.unroll_length)
        self.batch_builder = BatchBuilder(spec.algo.batch_size)
        self.batches: queue.Queue[dict[str, np.ndarray]] = queue.Queue(cfg.queue_capacity)
        self.server = InferenceServer(
            self._infer_batch,
            min_batch=cfg.inference_min_batch,
            max_batch=cfg.inference_max_batch,
            timeout_s=cfg.inference_timeout_ms / 1000.0,
            stats=self.learner.stats,
        )
        self._stopping = threading.Event()
        self._update_lock = threading.Lock()
        self._error: BaseException | None = None
        self._trainer = threading.Thread(target=self._train_loop, name="trainer", daemon=True)
        self.server.start()
        self._trainer.start()

    # -- called by env runners ------------------------------------------------
    def infer(self, request: Request) -> np.ndarray | None:
        return self.server.infer(request)

    # -- batcher thread ---------------------------------------------------------
    def _infer_batch(self, requests: list[Request]) -> list[np.ndarray]:
        actions = []
        for request, acted in zip(
            requests, act_on_requests(self.learner.act, self.states, requests)
        ):
            self.learner.record_steps(tally(request))
            unroll = self.assembler.add(
                request["key"], request, acted.action, acted.extras, acted.state
            )
            if unroll is not None:
                for batch in self.batch_builder.add(unroll):
                    self._enqueue(batch)
            actions.append(acted.action)
        return actions

    def _enqueue(self, batch: dict[str, np.ndarray]) -> None:
        while not self._stopping.is_set():
            try:
                self.batches.put(batch, timeout=0.1)
                return
            except queue.Full:
                continue

    # -- trainer thread -----------------------------------------------------------
    def _train_loop(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    batch = self.batches.get(timeout=0.1)
                except queue.Empty:
                    continue
                with self._update_lock:
                    self.learner.update(batch)
        except BaseException as err:  # surfaced to the driver by metrics()
            self._error = err

    # -- called by the driver -------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        if self._error is not None:
            raise self._error
        metrics = self.learner.metrics()
        metrics["batch_queue"] = self.batches.qsize()
        metrics["dropped_unrolls"] = self.assembler.dropped_unrolls
        return metrics

    def configure(self, setting: dict[str, int]) -> None:
        """Apply the dynamic adjuster's inference batch size."""
        self.server.max_batch = setting.get("inference_max_batch", self.server.max_batch)

    def get_state(self) -> dict[str, Any]:
        with self._update_lock:
            return self.learner.state_dict()

    def stop(self) -> None:
        self._stopping.set()
        self.server.stop()
        self._trainer.join(timeout=10.0)


class SeedEnvRunner(RayEnvRunner):
    """Only steps envs: each group step goes to the learner, which answers with actions."""

    def run(self, learner: Any) -> None:
        """Step until the learner answers None; while one group steps, the other infers."""
        pending = [learner.infer.remote(self.reset(g)) for g in range(self.num_groups)]
        while True:
            for group in range(self.num_groups):
                action = ray.get(pending[group])
                if action is None:
                    self.close()
                    return
                pending[group] = learner.infer.remote(self.step(group, action))


class SeedArchitecture(LearnerAndRunners):
    config_cls = SeedConfig
    learner_cls = SeedLearner
    runner_cls = SeedEnvRunner

    def knobs(self) -> dict[str, list[int]]:
        sizes = sorted({2**k for k in range(4, 13)} | {self.spec.arch.inference_max_batch})
        return {**super().knobs(), "inference_max_batch": sizes}

    def setting(self) -> dict[str, int]:
        return {**super().setting(), "inference_max_batch": self.spec.arch.inference_max_batch}
