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
import time
import warnings
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import ray
import torch
from pydantic import Field

from rlfabric.architectures.base import ArchConfig, Architecture
from rlfabric.envs import EnvInfo
from rlfabric.platform.env_runner import EnvRunner, Request
from rlfabric.platform.errors import RLFabricError
from rlfabric.platform.inference import InferenceServer
from rlfabric.platform.learner import Learner
from rlfabric.platform.unrolls import BatchBuilder, UnrollAssembler

if TYPE_CHECKING:
    from rlfabric.platform.spec import ExperimentSpec

log = logging.getLogger(__name__)


class SeedConfig(ArchConfig):
    name: Literal["seed"] = Field("seed", description="registered architecture name")
    env_groups: int = Field(2, ge=1, description="env groups per runner that step alternately")
    inference_min_batch: int = Field(
        1, ge=1, description="envs to wait for (up to the timeout) before a forward pass"
    )
    inference_max_batch: int = Field(1024, ge=1, description="most envs in one forward pass")
    inference_timeout_ms: float = Field(
        2.0, ge=0, description="longest wait for inference_min_batch envs after the first request"
    )
    queue_capacity: int = Field(
        1, ge=1, description="batches queued for the trainer (backpressure)"
    )
    max_runner_restarts: int = Field(
        100, ge=0, description="env runner crashes tolerated before the run fails"
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
        obs = [r["obs"] for r in requests]
        action, extras = self.learner.act(obs[0] if len(obs) == 1 else np.concatenate(obs))
        actions, start = [], 0
        for request in requests:
            self.learner.record_steps(request)
            rows = slice(start, start + len(request["obs"]))
            start = rows.stop
            unroll = self.assembler.add(
                request["key"], request, action[rows], {k: v[rows] for k, v in extras.items()}
            )
            if unroll is not None:
                for batch in self.batch_builder.add(unroll):
                    self._enqueue(batch)
            actions.append(action[rows])
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

    def get_state(self) -> dict[str, Any]:
        with self._update_lock:
            return self.learner.state_dict()

    def stop(self) -> None:
        self._stopping.set()
        self.server.stop()
        self._trainer.join(timeout=10.0)


class SeedEnvRunner(EnvRunner):
    """An EnvRunner whose loop sends each group step to the learner and waits for actions."""

    def __init__(self, *args: Any, torch_threads: int = 1, **kwargs: Any) -> None:
        torch.set_num_threads(torch_threads)
        super().__init__(*args, **kwargs)

    def run(self, server: Any) -> None:
        """Step until the server answers None; while one group steps, the other infers."""
        pending = [server.infer.remote(self.reset(g)) for g in range(self.num_groups)]
        while True:
            for group in range(self.num_groups):
                action = ray.get(pending[group])
                if action is None:
                    self.close()
                    return
                pending[group] = server.infer.remote(self.step(group, action))


def runner_cpus(spec: ExperimentSpec) -> float:
    """CPUs per env runner: the spec's, or an equal share of what the learner leaves."""
    res = spec.resources
    if res.cpus_per_env_runner is not None:
        return res.cpus_per_env_runner
    total = ray.cluster_resources().get("CPU", 1.0)
    return round(max(0.05, min(1.0, (total - res.learner_cpus) / res.num_env_runners)), 3)


class SeedArchitecture(Architecture):
    config_cls = SeedConfig

    def start(self, state: dict[str, Any] | None = None) -> None:
        spec = self.spec
        cfg: SeedConfig = spec.arch  # type: ignore[assignment]
        res = spec.resources
        concurrency = res.num_env_runners * cfg.env_groups + 4
        self.learner = (
            ray.remote(SeedLearner)
            .options(num_cpus=res.learner_cpus, max_concurrency=concurrency)
            .remote(spec, self.env_info, self.stop_conditions.env_frames, state)
        )
        self._runner_cls = ray.remote(SeedEnvRunner).options(num_cpus=runner_cpus(spec))
        self.restarts = 0
        self.runners: dict[int, Any] = {}
        self.loops: dict[int, ray.ObjectRef] = {}
        self._seed = spec.run.seed + (state["counters"]["agent_steps"] if state else 0)
        for index in range(res.num_env_runners):
            self._launch(index)

    def _launch(self, index: int) -> None:
        spec = self.spec
        seed = self._seed + 7919 * self.restarts  # a restarted runner sees new episodes
        runner = self._runner_cls.remote(
            spec.env,
            index,
            seed,
            num_groups=spec.arch.env_groups,
            torch_threads=spec.resources.torch_threads,
        )
        self.runners[index] = runner
        self.loops[index] = runner.run.remote(self.learner)

    def _check_runners(self) -> None:
        """Replace env runners whose loop ended with an error (a crash or an env exception)."""
        done, _ = ray.wait(list(self.loops.values()), num_returns=len(self.loops), timeout=0)
        for index, ref in list(self.loops.items()):
            if ref not in done:
                continue
            try:
                ray.get(ref)
                reason = "its loop returned"
            except Exception as err:  # RayActorError, RayTaskError from the env
                reason = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            self.restarts += 1
            if self.restarts > self.spec.arch.max_runner_restarts:
                raise RLFabricError(
                    f"env runner {index} failed ({reason}) and {self.restarts - 1} runners were "
                    f"restarted already; arch.max_runner_restarts="
                    f"{self.spec.arch.max_runner_restarts}"
                )
            log.warning("env runner %d stopped (%s); starting a new one", index, reason)
            ray.kill(self.runners[index], no_restart=True)
            self._launch(index)

    def step(self) -> dict[str, float]:
        time.sleep(self.spec.run.report_interval_s)
        self._check_runners()
        metrics = ray.get(self.learner.metrics.remote())
        metrics["runner_restarts"] = self.restarts
        return metrics

    def get_state(self) -> dict[str, Any]:
        return ray.get(self.learner.get_state.remote())

    def stop(self) -> None:
        if not hasattr(self, "learner"):
            return
        try:
            ray.get(self.learner.stop.remote(), timeout=30)
            ray.wait(list(self.loops.values()), num_returns=len(self.loops), timeout=10)
        except Exception as err:  # already dead: nothing left to stop gracefully
            log.debug("learner stop: %s", err)
        for actor in [*self.runners.values(), self.learner]:
            ray.kill(actor, no_restart=True)
        del self.learner
