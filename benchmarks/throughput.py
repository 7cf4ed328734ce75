"""Env frames/s of SEED + V-trace with learning on, beside its two ceilings.

For each env, in one run on the same machine:
  (a) raw stepping: the same number of envs, the same vector env classes, in
      one process, random actions, no policy;
  (b) the learner's model: forward + backward (one V-trace update) at the
      learner's batch size, as agent steps/s and env frames/s;
  (c) SEED RL with learning on for --seconds: env frames/s (steady state,
      the first intervals dropped), and remote calls per env step.

    python benchmarks/throughput.py                       # CartPole-v1 and ALE/Pong-v5
    python benchmarks/throughput.py --envs CartPole-v1 --seconds 20
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS
from rlfabric.envs import describe_env, make_vector_env
from rlfabric.platform.reporting import read_records
from rlfabric.runtime.env_runner import group_sizes

#: Throughput settings per env: IMPALA's batch (32 unrolls of 20) for both;
#: enough envs per group that a remote call carries at least 64 env steps.
SETTINGS = {
    "CartPole-v1": {
        "env": {"id": "CartPole-v1", "num_envs": 256},
        "resources": {"num_env_runners": 1},
        "algo": {
            "name": "vtrace",
            "optimizer": "adam",
            "lr": 1e-3,
            "eps": 1e-5,
            "loss_reduction": "mean",
            "unroll_length": 20,
            "batch_size": 32,
        },
        "model": {"shared_torso": True},  # the figures' network (the seed preset separates)
    },
    "ALE/Pong-v5": {
        "env": {"id": "ALE/Pong-v5", "num_envs": 128},
        "resources": {"num_env_runners": 1, "torch_threads": 2},
        # IMPALA's one pass per batch (the Atari preset takes two, as APPO).
        "algo": {
            "name": "vtrace",
            "reward_clip": 1.0,
            "unroll_length": 20,
            "batch_size": 32,
            "epochs": 1,
        },
        "model": {"precision": "bf16"},
    },
}


def raw_stepping(settings: dict, seconds: float) -> float:
    """Env frames/s of the runner's env groups stepped back to back in one process."""
    platform = Platform(**settings)
    spec, info = platform.spec, platform.env_info
    n = spec.env.num_envs * spec.resources.num_env_runners
    groups = [make_vector_env(spec.env, size, seed=i) for i, size in enumerate(group_sizes(n, 2))]
    for i, envs in enumerate(groups):
        envs.reset(seed=i)
    actions = [np.stack([envs.action_space.sample() for _ in range(64)]) for envs in groups]
    steps, start, k = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for envs, acts in zip(groups, actions):
            envs.step(acts[k % 64])
            steps += envs.num_envs
        k += 1
    elapsed = time.perf_counter() - start
    for envs in groups:
        envs.close()
    return steps * info.frameskip / elapsed


def model_ceiling(settings: dict, seconds: float) -> float:
    """Agent steps/s of V-trace updates (forward + backward + optimizer) at the learner batch."""
    platform = Platform(**settings)
    spec, info = platform.spec, platform.env_info
    torch.set_num_threads(spec.resources.learner_threads)
    algo = ALGORITHMS[spec.algo.name](
        spec.algo, info.observation_space, info.action_space, spec.model
    )
    T, B = spec.algo.unroll_length, spec.algo.batch_size
    obs = np.stack(
        [np.stack([info.observation_space.sample() for _ in range(B)]) for _ in range(T + 1)]
    )
    action = np.stack([np.stack([info.action_space.sample() for _ in range(B)]) for _ in range(T)])
    batch = {
        "obs": obs,
        "action": action,
        "is_first": np.zeros((T + 1, B), bool),
        "reward": np.ones((T, B), np.float32),
        "terminated": np.zeros((T, B), bool),
        "truncated": np.zeros((T, B), bool),
        "logp": np.full((T, B), -1.0, np.float32),
        "policy_version": np.zeros((T, B), np.int64),
    }
    algo.update(batch)  # warm-up
    updates, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        algo.update(batch)
        updates += 1
    return updates * T * B / (time.perf_counter() - start)


def seed_run(settings: dict, seconds: float, logdir: str, arch: str = "seed") -> dict[str, float]:
    """Steady-state means of a run of `arch` with `settings` for `seconds` of wall time."""
    run = {
        "stop": {"wall_time_s": seconds},
        "display": "none",
        "logdir": logdir,
        "checkpoint_interval_s": 0,
    }
    result = Platform(arch=arch, run=run, **settings).fit()
    records = read_records(Path(result.logdir) / "metrics.jsonl")
    steady = records[len(records) // 3 :]  # drop start-up (Ray, actors, first compile)
    m = result.metrics

    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in steady if key in r] or [0.0]))

    return {
        "env_frames_per_s": mean("env_frames_per_s"),
        "learner_samples_per_s": mean("learner_samples_per_s"),
        "calls_per_env_step": m["env_requests"] / max(m["env_vector_steps"], 1),
        "inference_batch_envs": mean("inference_batch_envs"),
        "inference_ms": mean("inference_ms"),
        "learner_step_ms": mean("learner_step_ms"),
        "policy_lag": mean("policy_lag"),
        "env_frames": m["env_frames"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", default="CartPole-v1,ALE/Pong-v5")
    parser.add_argument("--seconds", type=float, default=30.0, help="SEED run length per env")
    parser.add_argument("--logdir", default="runs/bench-throughput")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}")
    rows = []
    for env_id in args.envs.split(","):
        settings = SETTINGS[env_id]
        frameskip = describe_env(Platform(**settings).spec.env).frameskip
        raw = raw_stepping(settings, seconds=5.0)
        model = model_ceiling(settings, seconds=5.0) * frameskip
        seed = seed_run(settings, args.seconds, args.logdir)
        rows.append((env_id, frameskip, raw, model, seed))
        print(
            json.dumps(
                {"env": env_id, "raw_frames_per_s": raw, "model_frames_per_s": model, **seed}
            )
        )
    print()
    header = (
        f"{'env':<14}{'raw env':>12}{'model f+b':>12}{'SEED+learn':>12}{'% of ceiling':>14}"
        f"{'agent st/s':>12}{'calls/step':>12}{'inf batch':>11}{'lag':>7}"
    )
    print(
        "env frames/s"
        + " " * 3
        + "(ceilings: raw stepping in one process; learner forward+backward)"
    )
    print(header)
    for env_id, frameskip, raw, model, seed in rows:
        fps = seed["env_frames_per_s"]
        share = 100 * fps / min(raw, model)
        print(
            f"{env_id:<14}{raw:>12,.0f}{model:>12,.0f}{fps:>12,.0f}{share:>13.0f}%"
            f"{fps / frameskip:>12,.0f}{'1/' + format(1 / seed['calls_per_env_step'], '.0f'):>12}"
            f"{seed['inference_batch_envs']:>11.1f}{seed['policy_lag']:>7.1f}"
        )


if __name__ == "__main__":
    main()
