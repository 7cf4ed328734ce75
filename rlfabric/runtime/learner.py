"""Learner: owns the Algorithm and the run's counters, stats and RNG.

One Learner lives in whichever process trains (the SEED learner actor, the
local architecture's only process). It counts env frames and agent steps from
the steps it is told about, keeps the return window (run.return_window episodes), runs updates
and produces checkpoint state. Frames and agent steps are counted separately:
env_frames = agent_steps x frameskip (Atari's action repeat).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlfabric.algorithms import ALGORITHMS, Algorithm
from rlfabric.envs import EnvInfo
from rlfabric.errors import RLFabricError
from rlfabric.observations import batch_len
from rlfabric.runtime.acting import UniformActions
from rlfabric.runtime.stats import IntervalStats

if TYPE_CHECKING:
    from rlfabric.runtime.config import LearningSpec

log = logging.getLogger(__name__)

COUNTERS = (
    "env_frames",  # emulator frames: agent_steps x frameskip
    "agent_steps",  # decisions that stepped an env (autoreset steps excluded)
    "episodes",
    "updates",
    "learner_samples",  # agent steps consumed by updates
    "env_requests",  # group vector steps received: one remote call each under SEED
    "env_vector_steps",  # env steps received, autoreset steps included
    "weight_syncs",  # weight versions loaded by env runners (IMPALA)
    "skipped_updates",  # updates with a NaN/inf loss or gradient, whose steps were skipped
)


def rng_state() -> dict[str, Any]:
    """Every RNG the learner process uses, in types `torch.load(weights_only=True)` accepts."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": random.getstate(),
        # A CUDA learner's minibatch shuffles (randperm on the device) draw from it, so a
        # resume continues the same stream; absent where this process never started CUDA.
        **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_initialized() else {}),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda")
    # A CUDA run resumed on a CPU (or on fewer GPUs) has no such generators to restore.
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def available_device(device: str) -> str:
    """`device` if torch can use it here, else "cpu" with a warning."""
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            log.warning("%s is not available in this process: using the CPU", device)
            return "cpu"
    return device


def make_algorithm(
    spec: LearningSpec,
    env_info: EnvInfo,
    frame_budget: int | None,
    device: str = "cpu",
    *,
    sparse: bool = True,
) -> Algorithm:
    """The spec's algorithm on the env's spaces, sparse where `spec.sparse` says (RLx2).

    The topology freezes after `sparse.t_end` updates, or by default after the
    updates the run's frame budget makes (RLx2: at the end of training). A copy
    that only acts (`sparse=False`: env runners, inference, evaluation) needs no
    masks: the weights it loads are already zero where masked.
    """
    if device.startswith("cuda"):
        # TF32 for float32 matmuls (Ampere and later; the heads and losses of a bf16 run,
        # all of an fp32 one): about 8x the fp32 rate at bf16-like rounding, as JAX does.
        torch.set_float32_matmul_precision("high")
    algorithm = ALGORITHMS[spec.algo.name](
        spec.algo, env_info.observation_space, env_info.action_space, spec.model, device
    )
    if sparse and spec.sparse.enabled:
        steps = frame_budget // env_info.frameskip if frame_budget else None
        total = algorithm.expected_updates(steps) if steps is not None else None
        algorithm.sparsify(spec.sparse, total, spec.run.seed)
    return algorithm


class Learner:
    """The Algorithm plus the bookkeeping every architecture needs around it."""

    def __init__(
        self, spec: LearningSpec, env_info: EnvInfo, frame_budget: int | None, device: str = "cpu"
    ) -> None:
        random.seed(spec.run.seed)
        np.random.seed(spec.run.seed)
        torch.manual_seed(spec.run.seed)
        self.algorithm = make_algorithm(spec, env_info, frame_budget, device)
        # Inference on the training weights, or on a copy on its own device, refreshed
        # after every update (resources.inference_device).
        self.inference = self.algorithm
        if spec.resources.inference_device != "learner":
            device = available_device(spec.resources.inference_device)
            self.inference = make_algorithm(spec, env_info, None, device, sparse=False)
            self.inference.model.load_state_dict(self.algorithm.model.state_dict())
        # Replay algorithms act uniformly at random until their first update (the warm-up).
        self.explore = (
            UniformActions(env_info.action_space, spec.run.seed)
            if self.algorithm.data == "replay"
            else None
        )
        self.frameskip = env_info.frameskip
        self.frame_budget = frame_budget
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.returns: deque[float] = deque(maxlen=spec.run.return_window)
        self.lengths: deque[int] = deque(maxlen=spec.run.return_window)
        self.stats = IntervalStats()
        self.max_nonfinite_updates = spec.run.max_nonfinite_updates
        # Called at the end of each applied update, under the caller's update lock (IMPALA
        # publishes the new weights there when a runner asked during the update).
        self.on_update: Callable[[], None] | None = None
        # Set by a group of data-parallel learners: (batch, run progress) -> (this learner's
        # shard, a wait for the others).
        self.peers: Callable[..., tuple[dict[str, np.ndarray], Callable[[], Any]]] | None = None
        self._nonfinite_in_row = 0
        # Counters and windows are touched by several threads; reentrant so that `frozen`
        # can hold it across metrics() and state_dict().
        self._lock = threading.RLock()
        # Notified as steps and episodes are counted: `wait_for_stop` wakes on it.
        self._counted = threading.Condition(self._lock)

    @property
    def policy_version(self) -> int:
        """Number of updates so far: the version of the current parameters."""
        return self.counters["updates"]

    def act(
        self, obs: np.ndarray, state: np.ndarray | None = None, first: np.ndarray | None = None
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        """Sample actions; extras get the policy version that acted (for policy lag)."""
        version = self.policy_version
        if self.explore is not None and version == 0:
            action, extras, state = self.explore(batch_len(obs))
        else:
            action, extras, state = self.inference.act(obs, state, first)
        extras["policy_version"] = np.full(batch_len(obs), version, np.int64)
        return action, extras, state

    def record_steps(self, tally: dict[str, Any]) -> None:
        """Count env steps and finished episodes from a runner's `StepTally.take()`.

        The autoreset step (the observation is an episode's first, reached by
        stepping an env that was done) is no emulator step: it is not counted.
        """
        steps = tally["agent_steps"]
        with self._lock:
            self.counters["env_requests"] += tally["requests"]
            self.counters["env_vector_steps"] += tally["vector_steps"]
            self.counters["agent_steps"] += steps
            self.counters["env_frames"] += steps * self.frameskip
            self.counters["episodes"] += len(tally["episode_returns"])
            self.returns.extend(tally["episode_returns"])
            self.lengths.extend(tally["episode_lengths"])
            self.counters["weight_syncs"] += tally["weight_syncs"]
            self._counted.notify_all()
        if tally["stepped_requests"]:
            self.stats.add("env_step_ms", 1000.0 * tally["env_step_s"] / tally["stepped_requests"])
        if tally["inference_s"]:
            self.stats.add_many(
                {
                    "inference_ms": 1000.0 * tally["inference_s"] / tally["requests"],
                    "inference_batch_envs": tally["vector_steps"] / tally["requests"],
                }
            )

    def stop_met(self, return_target: float | None) -> bool:
        """Whether a stop condition the learner counts holds: the frame budget spent, or a
        full return window (as `platform.facade.stop_reason` wants it) at `return_target`."""
        with self._lock:
            if self.frame_budget and self.counters["env_frames"] >= self.frame_budget:
                return True
            window = self.returns
            return (
                return_target is not None
                and len(window) == window.maxlen
                and float(np.mean(window)) >= return_target
            )

    def wait_for_stop(self, timeout_s: float, return_target: float | None) -> bool:
        """Wait up to `timeout_s`, less once `stop_met`: the driver's wait for its next report,
        which then ends a run at its budget or target rather than up to an interval later."""
        with self._counted:
            return self._counted.wait_for(lambda: self.stop_met(return_target), timeout_s)

    def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        frames = self.counters["env_frames"]
        progress = (frames, frames / self.frame_budget if self.frame_budget else None)
        self.algorithm.set_progress(*progress)
        start = time.perf_counter()
        skipped_before = self.algorithm.nonfinite_steps
        if self.peers is not None:  # data-parallel: the other learners take the other shards
            local, wait = self.peers(batch, progress)
            metrics = self.algorithm.update(local)
            wait()
        else:
            metrics = self.algorithm.update(batch)
        if self.inference is not self.algorithm:
            self.inference.model.load_state_dict(self.algorithm.model.state_dict())
        elapsed = time.perf_counter() - start
        # Skipped means an optimizer step was refused for a non-finite gradient: a
        # non-finite diagnostic of an update that was applied is reported, not a skip.
        if self.algorithm.nonfinite_steps > skipped_before:
            self._skip(metrics)  # the weights did not move: nothing new to publish
            return metrics
        self._nonfinite_in_row = 0
        samples = batch["reward"].size  # [T, B] steps of unrolls, or [B] replay transitions
        with self._lock:
            self.counters["updates"] += 1
            self.counters["learner_samples"] += samples
        if "policy_version" in batch:
            lag = self.policy_version - float(batch["policy_version"].mean())
            metrics = {**metrics, "policy_lag": lag}
        self.stats.add_many({**metrics, "learner_step_ms": 1000.0 * elapsed})
        self.stats.add("learner_busy_s", elapsed)
        if self.on_update is not None:
            self.on_update()
        return metrics

    def _skip(self, metrics: dict[str, float]) -> None:
        """Count an update with a skipped (non-finite) gradient; stop after too many in a row."""
        with self._lock:
            self.counters["updates"] += 1
            self.counters["skipped_updates"] += 1
        self._nonfinite_in_row += 1
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        log.warning("update %d skipped: non-finite %s", self.counters["updates"], bad or "gradient")
        if self._nonfinite_in_row >= self.max_nonfinite_updates:
            raise RLFabricError(
                f"{self._nonfinite_in_row} updates in a row had a NaN or inf loss or gradient "
                f"(last: {bad or 'gradient'}); their steps were skipped, so the weights and the "
                "last checkpoint are intact. Try a lower algo.lr, reward clipping or gradient "
                f"clipping; run.max_nonfinite_updates={self.max_nonfinite_updates}"
            )

    def metrics(self) -> dict[str, float]:
        """Counters, the return window and this interval's means."""
        means, sums = self.stats.collect()
        means.pop("learner_busy_s", None)
        with self._lock:
            out: dict[str, float] = dict(self.counters)
            if self.returns:
                out["episode_return_mean"] = float(np.mean(self.returns))
                out["episode_length_mean"] = float(np.mean(self.lengths))
        out.update(means)
        out.update(self.algorithm.sparse_metrics())
        out["learner_busy_s"] = sums.get("learner_busy_s", 0.0)
        out["learner_cpu_s"] = time.process_time()  # this process, all threads, since start
        return out

    def frozen(self) -> threading.RLock:
        """Held while metrics and state of one moment are taken: no steps counted meanwhile."""
        return self._lock

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "algorithm": self.algorithm.state_dict(),
                "counters": dict(self.counters),
                "returns": list(self.returns),
                "lengths": list(self.lengths),
                "rng": rng_state(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.algorithm.load_state_dict(state["algorithm"])
        with self._lock:
            self.counters.update({k: v for k, v in state["counters"].items() if k in COUNTERS})
            self.returns.extend(state["returns"])
            self.lengths.extend(state["lengths"])
        set_rng_state(state["rng"])
