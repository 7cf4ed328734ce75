"""`ga3c`: GA3C's queues (Babaeizadeh et al. 2017, arXiv 1611.06256; NVlabs/GA3C).

    EnvRunner x N --obs--> prediction queue --> predictor threads (batch, forward)
        ^  |                                          |
        |  '--- unrolls of t_max steps ---> training queue --> trainer threads (batch, update)
        '---------------- actions -----------------'

Runners put observations on the prediction queue and get actions back;
predictor threads block for the first request, then drain whatever else is
waiting up to the prediction batch size, and run one forward pass. Runners
collect their own experiences (observations, actions, rewards, dones) and
put unrolls of t_max steps (the algorithm's unroll_length) on the training
queue; trainer threads concatenate them into batches and update. What the
policy computed when it acted (behaviour log-probs, policy version, the
recurrent state) never travels to the runner: the learner's process keeps it
per request (`ActedLedger`) and joins it to the unroll that arrives. The
dynamic adjuster (on by default, as in GA3C) changes the numbers of runners,
predictors and trainers to maximise trainings per second.

Two departures, both for correctness: the algorithm computes the n-step
returns on the learner (runners stay algorithm-agnostic, and the bootstrap
value comes from the current parameters), and updates are serialised by a
lock (PyTorch does not support concurrent optimizer steps on shared
parameters); several trainer threads still overlap batch assembly with the
update, as GA3C's did with its TF session.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import ray
from pydantic import Field

from rlfabric.architectures.base import RunnerArchConfig, TopologySpec
from rlfabric.architectures.runner_pool import RayEnvRunner
from rlfabric.architectures.topology import LearnerAndRunners, learner_options
from rlfabric.envs import EnvInfo
from rlfabric.runtime.acting import ActedLedger, RecurrentStates, act_on_requests
from rlfabric.runtime.env_runner import Request
from rlfabric.runtime.faults import call
from rlfabric.runtime.inference import InferenceServer
from rlfabric.runtime.learner_process import LearnerProcess
from rlfabric.runtime.unrolls import UnrollAssembler
from rlfabric.runtime.workers import ThreadPool


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

    def __init__(
        self,
        spec: TopologySpec,
        env_info: EnvInfo,
        frame_budget: int | None,
        state: dict[str, Any] | None,
    ) -> None:
        cfg: GA3CConfig = spec.arch
        # Runners ship a whole env group per unroll; GA3C's queue counts single-env ones.
        unrolls = max(1, cfg.training_queue_size // (spec.env.num_envs // cfg.env_groups))
        super().__init__(
            spec,
            env_info,
            frame_budget,
            state,
            capacity=unrolls,
            trainers=cfg.trainers,
            batch_on="train",
            queue_metric="training_queue",
            **learner_options(spec),
        )
        self.states = RecurrentStates(self.learner.algorithm.acting_state)
        self.acted = ActedLedger()
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
    def predict(self, request: Request, tally: dict[str, Any]) -> np.ndarray | None:
        """One group step (and the runner's step counts since its last call) in, its
        actions out (None: stop)."""
        self.learner.record_steps(tally)
        return self.server.infer(request)

    def train(self, unroll: dict[str, np.ndarray], key: tuple[int, int], run_id: str) -> bool:
        """Put an unroll on the training queue (blocks while full), with what the policy
        computed for its steps. False once stopping."""
        full = self.acted.attach(unroll, key, run_id)
        return full is None or self.add_unroll(full, key)

    # -- predictor threads ----------------------------------------------------------
    def _predict(self, requests: list[Request]) -> list[np.ndarray]:
        acted_all = act_on_requests(self.learner.act, self.states, requests)
        for request, acted in zip(requests, acted_all):
            self.acted.record(request, acted)
        return [acted.action for acted in acted_all]

    def pools(self) -> list[ThreadPool]:
        return [*super().pools(), self.server.batchers]

    # -- called by the driver -------------------------------------------------------
    def configure(self, setting: dict[str, int]) -> None:
        """Apply the dynamic adjuster's predictor and trainer counts."""
        self.server.batchers.resize(setting.get("predictors", self.server.batchers.size))
        self.trainers.resize(setting.get("trainers", self.trainers.size))

    def metrics(self, raise_errors: bool = True) -> dict[str, float]:
        metrics = super().metrics(raise_errors)
        metrics["predictors"] = self.server.batchers.size
        metrics["trainers"] = self.trainers.size
        metrics["dropped_unrolls"] = self.acted.dropped_unrolls
        return metrics

    def stop(self) -> None:
        self._stopping.set()
        self.server.stop()
        super().stop()


class GA3CEnvRunner(RayEnvRunner):
    """Asks the prediction queue for actions, collects unrolls, feeds the training queue."""

    def __init__(self, spec: TopologySpec, env_info: EnvInfo, index: int, seed: int) -> None:
        super().__init__(spec, env_info, index, seed)
        self.assembler = UnrollAssembler(spec.algo.unroll_length, spec.algo.return_discount())

    def run(self, learner: Any) -> None:
        requests = [self.reset(g) for g in range(self.num_groups)]
        pending = [learner.predict.remote(r, self.tally.take()) for r in requests]
        in_flight: ray.ObjectRef | None = None
        while True:
            for group in range(self.num_groups):
                action = call(pending[group], "the learner")
                if action is None:
                    self.close()
                    return
                request = requests[group]
                unroll = self.assembler.add(request["key"], request, action, {})
                if unroll is not None:
                    if in_flight is not None and not call(in_flight, "the learner"):
                        self.close()
                        return
                    in_flight = learner.train.remote(unroll, request["key"], self.run_id)
                requests[group] = self.step(group, action)
                pending[group] = learner.predict.remote(requests[group], self.tally.take())


class GA3CArchitecture(LearnerAndRunners):
    config_cls = GA3CConfig
    learner_cls = GA3CLearner
    runner_cls = GA3CEnvRunner

    def knobs(self) -> dict[str, list[int]]:
        cfg: GA3CConfig = self.spec.arch
        return {
            **super().knobs(),
            "predictors": list(range(1, cfg.max_predictors + 1)),
            "trainers": list(range(1, cfg.max_trainers + 1)),
        }

    def setting(self) -> dict[str, int]:
        cfg: GA3CConfig = self.spec.arch
        return {**super().setting(), "predictors": cfg.predictors, "trainers": cfg.trainers}
