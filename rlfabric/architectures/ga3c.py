"""`ga3c`: GA3C's queues (Babaeizadeh et al. 2017, arXiv 1611.06256; NVlabs/GA3C).

    EnvRunner x N --obs--> prediction queue --> predictor threads (batch, forward)
        ^  |                                          |
        |  '--- unrolls of t_max steps ---> training queue --> trainer threads (batch, update)
        '---------------- actions -----------------'

Runners put observations on the prediction queue and get actions back;
predictor threads block for the first request, then drain whatever else is
waiting up to the prediction batch size, and run one forward pass. Runners
collect their own experiences and put unrolls of t_max steps (the algorithm's
unroll_length) on the training queue; trainer threads concatenate them into
batches and update. The dynamic adjuster (on by default, as in GA3C) changes
the numbers of runners, predictors and trainers to maximise trainings per
second.

Two departures, both for correctness: the algorithm computes the n-step
returns on the learner (runners stay algorithm-agnostic, and the bootstrap
value comes from the current parameters), and updates are serialised by a
lock (PyTorch does not support concurrent optimizer steps on shared
parameters); several trainer threads still overlap batch assembly with the
update, as GA3C's did with its TF session.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import ray
from pydantic import Field

from rlfabric.architectures.runners import (
    LearnerAndRunners,
    LearnerProcess,
    RayEnvRunner,
    RunnerArchConfig,
)
from rlfabric.envs import EnvInfo
from rlfabric.platform.acting import Acted, RecurrentStates, act_on_requests
from rlfabric.platform.env_runner import Request, tally
from rlfabric.platform.inference import InferenceServer
from rlfabric.platform.unrolls import UnrollAssembler
from rlfabric.platform.workers import ThreadPool

if TYPE_CHECKING:
    from rlfabric.platform.spec import ExperimentSpec


class GA3CConfig(RunnerArchConfig):
    name: Literal["ga3c"] = Field("ga3c", description="registered architecture name")
    predictors: int = Field(2, ge=1, description="predictor threads (GA3C default 2)")
    trainers: int = Field(2, ge=1, description="trainer threads (GA3C default 2)")
    max_predictors: int = Field(4, ge=1, description="most predictors the adjuster may run")
    max_trainers: int = Field(4, ge=1, description="most trainers the adjuster may run")
    prediction_max_batch: int = Field(
        128, ge=1, description="most envs per forward pass (GA3C PREDICTION_BATCH_SIZE)"
    )
    training_queue_size: int = Field(
        100,
        ge=1,
        description="env unrolls (columns) the training queue holds: GA3C's MAX_QUEUE_SIZE "
        "of single-agent experiences",
    )
    autotune: bool = Field(
        True, description="GA3C's dynamic adjustment of runners, predictors and trainers"
    )


class GA3CLearner(LearnerProcess):
    """The learner process: prediction queue + predictors, training queue + trainers."""

    queue_metric = "training_queue"

    def __init__(
        self,
        spec: ExperimentSpec,
        env_info: EnvInfo,
        frame_budget: int | None,
        state: dict[str, Any] | None,
    ) -> None:
        cfg: GA3CConfig = spec.arch  # type: ignore[assignment]
        # Runners ship a whole env group per unroll; GA3C's queue counts single-env ones.
        unrolls = max(1, cfg.training_queue_size // (spec.env.num_envs // cfg.env_groups))
        super().__init__(spec, env_info, frame_budget, state, unrolls, trainers=cfg.trainers)
        self.states = RecurrentStates(self.learner.algorithm.initial_state)
        self.server = InferenceServer(
            self._predict,
            min_batch=1,
            max_batch=cfg.prediction_max_batch,
            timeout_s=0.0,
            stats=self.learner.stats,
            num_threads=cfg.predictors,
        )
        self.server.start()

    # -- called by env runners ---------------------------------------------------
    def predict(self, request: Request) -> Acted | None:
        return self.server.infer(request)

    def train(self, unroll: dict[str, np.ndarray], key: tuple[int, int]) -> bool:
        """Put an unroll on the training queue (blocks while full). False once stopping.

        A replay algorithm's unrolls go into the replay buffer instead.
        """
        if self.replay is not None:
            return self.enqueue_unroll(unroll, key)
        return self.put(unroll)

    # -- predictor and trainer threads ----------------------------------------------
    def _predict(self, requests: list[Request]) -> list[Acted]:
        for request in requests:
            self.learner.record_steps(tally(request))
        return act_on_requests(self.learner.act, self.states, requests)

    def train_on(self, unroll: dict[str, np.ndarray]) -> None:
        """A trainer concatenates unrolls into batches of B, then updates."""
        with self._builder_lock:
            batches = self.batch_builder.add(unroll)
        for batch in batches:
            super().train_on(batch)

    def pools(self) -> list[ThreadPool]:
        return [*super().pools(), self.server.batchers]

    # -- called by the driver -------------------------------------------------------
    def configure(self, setting: dict[str, int]) -> None:
        """Apply the dynamic adjuster's predictor and trainer counts."""
        self.server.batchers.resize(setting.get("predictors", self.server.batchers.size))
        self.trainers.resize(setting.get("trainers", self.trainers.size))

    def metrics(self) -> dict[str, float]:
        metrics = super().metrics()
        metrics["predictors"] = self.server.batchers.size
        metrics["trainers"] = self.trainers.size
        return metrics

    def stop(self) -> None:
        self._stopping.set()
        self.server.stop()
        super().stop()


class GA3CEnvRunner(RayEnvRunner):
    """Asks the prediction queue for actions, collects unrolls, feeds the training queue."""

    def __init__(self, spec: ExperimentSpec, env_info: EnvInfo, index: int, seed: int) -> None:
        super().__init__(spec, env_info, index, seed)
        self.assembler = UnrollAssembler(spec.algo.unroll_length)

    def run(self, learner: Any) -> None:
        requests = [self.reset(g) for g in range(self.num_groups)]
        pending = [learner.predict.remote(r) for r in requests]
        in_flight: ray.ObjectRef | None = None
        while True:
            for group in range(self.num_groups):
                reply = ray.get(pending[group])
                if reply is None:
                    self.close()
                    return
                action, extras, state = reply
                request = requests[group]
                unroll = self.assembler.add(request["key"], request, action, extras, state)
                if unroll is not None:
                    if in_flight is not None and not ray.get(in_flight):
                        self.close()
                        return
                    in_flight = learner.train.remote(unroll, request["key"])
                requests[group] = self.step(group, action)
                pending[group] = learner.predict.remote(requests[group])


class GA3CArchitecture(LearnerAndRunners):
    config_cls = GA3CConfig
    learner_cls = GA3CLearner
    runner_cls = GA3CEnvRunner

    def knobs(self) -> dict[str, list[int]]:
        cfg: GA3CConfig = self.spec.arch  # type: ignore[assignment]
        return {
            **super().knobs(),
            "predictors": list(range(1, cfg.max_predictors + 1)),
            "trainers": list(range(1, cfg.max_trainers + 1)),
        }

    def setting(self) -> dict[str, int]:
        cfg: GA3CConfig = self.spec.arch  # type: ignore[assignment]
        return {**super().setting(), "predictors": cfg.predictors, "trainers": cfg.trainers}
