"""rlfabric against Stable-Baselines3 where SB3 is at home, both in one invocation.

Two small-run figures, each taken side by side on this machine so that the ratio
compares like with like:

- **CartPole-v1 to a 100-episode mean of 475**: the whole process of a names-only
  rlfabric run (`Platform(arch=..., algo="vtrace", env="CartPole-v1").fit()`: Python's
  start, imports, Ray's start and stop included) against SB3's A2C with its defaults
  on 8 envs (`make_vec_env`, `A2C("MlpPolicy")`) stopped by a callback at the same
  mean over the same 100 episodes. Median over `--seeds`; the ratio is SB3's time
  over ours (above 1: rlfabric is faster).
- **SAC on HalfCheetah-v5, agent steps per second after warm-up**: names-only SEED +
  SAC and SB3's SAC with its defaults, one update per step, each given the machine
  for `--sac-seconds` once past `--sac-warmup` agent steps (ours are random for the
  first 5,000). The ratio is ours over SB3's.

SB3 goes into its own folder (`benchmarks/.sb3/`, `pip install --no-deps --target`)
and runs on this venv's torch, gymnasium and numpy, so that both sides use the same
builds of what they share. Run it on a quiet machine: it times.

    python benchmarks/vs_sb3.py                                # both, 3 seeds
    python benchmarks/vs_sb3.py --tasks cartpole --seeds 0 1 2 --out benchmarks/results/vs_sb3.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from offpolicy_speed import in_run  # this script's folder is first on sys.path

SB3_VERSION = "2.9.2"
SB3_DIR = Path(__file__).parent / ".sb3"

# argv: arch, seed, logdir. Prints the run's stop reason and frames as JSON.
_RLFABRIC_CARTPOLE = r"""
import json, sys
from rlfabric import Platform
arch, seed, logdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
result = Platform(
    arch=arch, algo="vtrace", env="CartPole-v1",
    run={"seed": seed, "logdir": logdir, "display": "none"},
).fit()
print(json.dumps({"reason": result.stop_reason, "env_frames": result.metrics["env_frames"],
                  "return": result.metrics.get("episode_return_mean")}))
"""

# argv: seed, target, most steps. SB3's A2C, its defaults, 8 envs; stops at the target.
_SB3_CARTPOLE = r"""
import json, sys
import numpy as np
from stable_baselines3 import A2C
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
seed, target, most = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])

class AtTarget(BaseCallback):
    def _on_step(self) -> bool:
        episodes = self.model.ep_info_buffer  # the last 100 episodes
        return not (len(episodes) == 100 and np.mean([e["r"] for e in episodes]) >= target)

model = A2C("MlpPolicy", make_vec_env("CartPole-v1", n_envs=8, seed=seed), seed=seed)
model.learn(total_timesteps=most, callback=AtTarget())
episodes = model.ep_info_buffer
mean = float(np.mean([e["r"] for e in episodes]))
print(json.dumps({"reason": "target" if mean >= target else "steps",
                  "env_frames": model.num_timesteps, "return": mean}))
"""

# argv: seed, warm-up steps, seconds. SB3's SAC, its defaults; steps/s after warm-up.
_SB3_SAC = r"""
import json, sys, time
import gymnasium as gym
from stable_baselines3 import SAC
from stable_baselines3.common.callbacks import BaseCallback
seed, warmup, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

class Window(BaseCallback):
    start = None
    def _on_step(self) -> bool:
        now = time.perf_counter()
        if self.start is None and self.num_timesteps >= warmup:
            self.start = (now, self.num_timesteps)
        if self.start is not None and now - self.start[0] >= seconds:
            self.end = (now, self.num_timesteps)
            return False
        return True

window = Window()
SAC("MlpPolicy", gym.make("HalfCheetah-v5"), seed=seed).learn(10**9, callback=window)
(t0, s0), (t1, s1) = window.start, window.end
print(json.dumps({"steps_per_s": (s1 - s0) / (t1 - t0), "steps": s1 - s0}))
"""


def install_sb3() -> None:
    """SB3 alone into its own folder; everything it needs is already in this venv."""
    if (SB3_DIR / "stable_baselines3").is_dir():
        return
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
         str(SB3_DIR), f"stable-baselines3=={SB3_VERSION}"],
        check=True,
    )  # fmt: skip


def child(
    code: str, *args: object, sb3: bool = False, timeout_s: float = 900
) -> tuple[dict, float]:
    """Run `code` in a fresh interpreter; its last stdout line (JSON) and its wall time."""
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    if sb3:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SB3_DIR), env.get("PYTHONPATH")]))
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True, text=True, env=env, timeout=timeout_s,
    )  # fmt: skip
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), wall


def cartpole(seeds: list[int], archs: list[str]) -> dict:
    """Whole-process seconds to 475 for each side; interleaved per seed so that a drift
    in the machine's speed touches every side alike."""
    times: dict[str, list[float]] = {name: [] for name in [*archs, "sb3_a2c"]}
    with tempfile.TemporaryDirectory() as logdir:
        for seed in seeds:
            for arch in archs:
                out, wall = child(_RLFABRIC_CARTPOLE, arch, seed, logdir)
                _check_target(f"rlfabric {arch} seed {seed}", out)
                times[arch].append(wall)
                print(f"  {arch:8s} seed {seed}: {wall:6.1f} s, {out['env_frames']:,} frames")
            out, wall = child(_SB3_CARTPOLE, seed, 475.0, 2_000_000, sb3=True)
            _check_target(f"sb3 a2c seed {seed}", out)
            times["sb3_a2c"].append(wall)
            print(f"  sb3 a2c  seed {seed}: {wall:6.1f} s, {out['env_frames']:,} frames")
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "seconds": times,
        "median_s": medians,
        "sb3_over_ours": {arch: medians["sb3_a2c"] / medians[arch] for arch in archs},
    }


def _check_target(what: str, out: dict) -> None:
    if out["return"] is None or out["return"] < 475:
        raise RuntimeError(f"{what} stopped below 475 ({out}): its time would not compare")


def sac(seed: int, warmup: int, seconds: float) -> dict:
    ours = in_run("sac", seed, warmup, seconds)  # names-only SEED + SAC, a fresh process
    print(f"  rlfabric seed+sac: {ours['steps_per_s']:.1f} agent steps/s")
    theirs, _ = child(_SB3_SAC, seed, warmup, seconds, sb3=True, timeout_s=seconds * 4)
    print(f"  sb3 sac:           {theirs['steps_per_s']:.1f} agent steps/s")
    return {
        "rlfabric": ours,
        "sb3": theirs,
        "ours_over_sb3": ours["steps_per_s"] / theirs["steps_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks", nargs="+", choices=["cartpole", "sac"], default=["cartpole", "sac"]
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--archs", nargs="+", default=["seed", "local"])
    parser.add_argument(
        "--sac-warmup", type=int, default=6_000, help="agent steps before the window"
    )
    parser.add_argument("--sac-seconds", type=float, default=100.0, help="the measured window")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    install_sb3()
    results: dict = {"machine": _machine(), "sb3": SB3_VERSION}
    if "cartpole" in args.tasks:
        print(f"CartPole-v1 to 475, whole process, seeds {args.seeds}:")
        results["cartpole"] = figures = cartpole(args.seeds, args.archs)
        for arch in args.archs:
            print(
                f"{arch:8s} median {figures['median_s'][arch]:6.1f} s | sb3 a2c "
                f"{figures['median_s']['sb3_a2c']:6.1f} s | sb3 / ours "
                f"{figures['sb3_over_ours'][arch]:.2f}x"
            )
    if "sac" in args.tasks:
        print(f"SAC on HalfCheetah-v5, agent steps/s over {args.sac_seconds:g} s after warm-up:")
        results["sac"] = figures = sac(args.seeds[0], args.sac_warmup, args.sac_seconds)
        print(f"ours / sb3 {figures['ours_over_sb3']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


def _machine() -> dict:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    models = (ln.split(":", 1)[1].strip() for ln in flags.splitlines() if "model name" in ln)
    model = next(models, "")
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "cpu_bf16": "avx512_bf16" in flags or "amx_bf16" in flags,
        "date": time.strftime("%Y-%m-%d"),
    }


if __name__ == "__main__":
    main()
