"""The driver's peak memory while it checkpoints a full replay buffer.

A learner actor (`LearnerProcess`, SAC) gets a replay buffer of --mib MiB
filled with synthetic transitions (4096-float observations, so that few
transitions fill it fast), then takes a checkpoint the way `Platform` does,
in three ways. For the driver and the learner process each: the rise of the
kernel's peak RSS (VmHWM, reset through /proc/<pid>/clear_refs just before;
Linux only) over the RSS before the checkpoint, and of that the private part
(RssAnon, sampled every millisecond); the rest are pages of Ray's object store
(shared memory, allocated once per node) that the process touched:

- inline: the buffer's contents inside the learner's state, through the
  object store into the driver, which writes them (every checkpoint before
  this change; still what `snapshot()` without a replay file does);
- owner writes: the learner process writes them beside the checkpoint;
- pulled: as on a node that does not see the run folder, the driver pulls
  them in chunks of `CHUNK_BYTES` and writes them.

    python benchmarks/checkpoint_memory.py
    python benchmarks/checkpoint_memory.py --mib 400 --logdir /tmp/ckpt-bench
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import ray

from rlfabric.envs import describe_env
from rlfabric.platform.checkpoint import replay_target, save_checkpoint
from rlfabric.platform.ray_setup import init_ray
from rlfabric.platform.spec import ExperimentSpec
from rlfabric.runtime.learner_process import LearnerProcess

OBS_DIM = 4096
MIB = 2**20


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


class PrivatePeak:
    """The highest RssAnon of each process, sampled every millisecond in a thread."""

    def __init__(self, pids: list[int]) -> None:
        self.peak = {pid: rss_mib(pid, "RssAnon") for pid in pids}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.001):
            for pid in self.peak:
                self.peak[pid] = max(self.peak[pid], rss_mib(pid, "RssAnon"))

    def stop(self) -> dict[int, float]:
        self.done.set()
        self.thread.join()
        return self.peak


def fill(learner: ray.actor.ActorHandle, transitions: int, num_envs: int, length: int) -> None:
    """Store `transitions` synthetic transitions, `length` steps of every env per call."""
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((length + 1, num_envs, OBS_DIM), dtype=np.float32)
    unroll = {
        "obs": obs,
        "is_first": np.zeros((length + 1, num_envs), bool),
        "action": rng.uniform(-2, 2, (length, num_envs, 1)).astype(np.float32),
        "reward": rng.standard_normal((length, num_envs), dtype=np.float32),
        "terminated": np.zeros((length, num_envs), bool),
        "truncated": np.zeros((length, num_envs), bool),
    }
    ref = ray.put(unroll)
    for _ in range(-(-transitions // (length * num_envs))):
        ray.get([learner.add_unroll.remote(ref, (0, 0))])


def checkpoint(learner: ray.actor.ActorHandle, folder: Path, mode: str, frames: int) -> Path:
    """One checkpoint as `Platform._checkpoint` takes it (mode 'inline': as before)."""
    if mode == "inline":
        _, state = ray.get(learner.snapshot.remote())
        return save_checkpoint(folder, state, frames, keep=1)
    with replay_target(folder) as target:
        if mode == "pulled":
            target.unlink()  # the learner's process no longer sees it: it keeps the contents
        _, state = ray.get(learner.snapshot.remote(str(target)))
        return save_checkpoint(
            folder,
            state,
            frames,
            keep=1,
            replay_file=target,
            pull=lambda offset, size: ray.get(learner.replay_chunk.remote(offset, size)),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=400, help="replay contents to checkpoint")
    parser.add_argument("--logdir", default=None, help="checkpoint folder (default: a temp dir)")
    parser.add_argument("--modes", nargs="+", default=["owner writes", "pulled", "inline"])
    args = parser.parse_args()
    per_transition = 2 * 4 * OBS_DIM + 4 + 4 + 2  # obs, next_obs, action, reward, flags
    num_envs, length = 2, 64
    transitions = int(args.mib * MIB) // per_transition
    spec = ExperimentSpec.build(
        {
            "env": {"id": "Pendulum-v1", "num_envs": num_envs},
            "arch": "seed",
            "algo": {
                "name": "sac",
                "hidden": [64],
                "buffer_capacity": transitions,
                "warmup_steps": 10 * transitions,  # no updates: the buffer only fills
            },
            "resources": {"num_env_runners": 1},
        }
    )
    box = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)
    env_info = replace(describe_env(spec.env), observation_space=box)
    init_ray(spec.resources)
    folder = Path(args.logdir or tempfile.mkdtemp(prefix="rlfabric-ckpt-bench-"))
    learner = (
        ray.remote(LearnerProcess)
        .options(num_cpus=0, max_concurrency=4)
        .remote(spec, env_info, None, None, env_groups=1, capacity=1)
    )
    pid = ray.get(learner.__ray_call__.remote(lambda self: os.getpid()))
    start = time.perf_counter()
    fill(learner, transitions, num_envs, length)
    size = ray.get(learner.metrics.remote())["replay_size"]
    print(
        f"replay: {size:,.0f} transitions of {per_transition:,} bytes = "
        f"{size * per_transition / MIB:,.0f} MiB, filled in {time.perf_counter() - start:.0f} s; "
        f"checkpoints in {folder}"
    )
    print("rise during the checkpoint, MiB   driver: RSS  private   learner: RSS  private  seconds")
    pids = [os.getpid(), pid]
    for frames, mode in enumerate(args.modes):
        gc.collect()
        rss = {p: rss_mib(p) for p in pids}
        private = {p: rss_mib(p, "RssAnon") for p in pids}
        for p in pids:
            reset_peak(p)
        sampler = PrivatePeak(pids)
        start = time.perf_counter()
        checkpoint(learner, folder, mode, frames)  # keep=1: it replaces the one before
        seconds = time.perf_counter() - start
        private_peak = sampler.stop()
        row = [f"{mode:<31}"]
        for p in pids:
            peak = rss_mib(p, "VmHWM")
            row.append(f"{peak - rss[p]:>12,.0f}{private_peak[p] - private[p]:>9,.0f}")
        print("".join(row) + f"{seconds:>9.1f}")
    ray.get(learner.stop.remote())
    ray.shutdown()
    if args.logdir is None:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
