"""The fixed cost of a run: each phase of a names-only run with almost no learning, timed.

Each repetition is a fresh Python process (what `rlfabric train` and a Tune trial
pay) that times, by wrapping the facade's calls: `import rlfabric`, building the
Platform (the spec check makes one env), `ray.init`, the architecture's start
(learner and env runner processes), the learning of `--frames` env frames, the
final checkpoint, the architecture's stop, `ray.shutdown` and the curve (drawn
while Ray shuts down, so the two overlap), and the whole process from its start
to its exit. It prints the median of each phase over `--repeats` runs; `fixed` is
the whole process less the learning.

    python benchmarks/startup.py                      # seed and local, 3 runs each
    python benchmarks/startup.py --archs seed --repeats 5 --out startup.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PHASES = (
    "import rlfabric",
    "Platform()",
    "ray.init",
    "arch.start",
    "learning",
    "final checkpoint",
    "arch.stop",
    "ray.shutdown",
    "curve.png",
    "process",
    "fixed",
)

# Runs in a fresh interpreter: argv[1] the arch, argv[2] the frames, argv[3] a logdir.
_CHILD = r"""
import json, sys, time
start = time.perf_counter()
import rlfabric
from rlfabric.platform import facade, reporting
times = {"import rlfabric": time.perf_counter() - start}

def timed(owner, name, phase):
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times[phase] = times.get(phase, 0.0) + time.perf_counter() - began
            times.setdefault("_ends", {})[phase] = time.perf_counter()
    setattr(owner, name, wrapper)

arch, frames, logdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
arch_cls = facade.ARCHITECTURES[arch]
timed(facade, "init_ray", "ray.init")
timed(arch_cls, "start", "arch.start")
timed(arch_cls, "stop", "arch.stop")
timed(facade.ray, "shutdown", "ray.shutdown")
timed(reporting.Reporter, "plot", "curve.png")
timed(facade.Platform, "_checkpoint", "final checkpoint")  # the last one is the final one
began = time.perf_counter()
platform = facade.Platform(
    arch=arch, algo="vtrace", env="CartPole-v1",
    run={"stop": {"env_frames": frames}, "display": "none", "logdir": logdir,
         "checkpoint_interval_s": 3600},
)
times["Platform()"] = time.perf_counter() - began
platform.fit()
ends = times.pop("_ends")
times["learning"] = ends["final checkpoint"] - times["final checkpoint"] - ends["arch.start"]
times.setdefault("ray.init", 0.0)
times.setdefault("ray.shutdown", 0.0)
print(json.dumps(times))
"""


def run_once(arch: str, frames: int, logdir: Path) -> dict[str, float]:
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, arch, str(frames), str(logdir)],
        capture_output=True,
        text=True,
        check=False,
    )
    process = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{arch} run failed:\n{done.stderr[-3000:]}")
    times = json.loads(done.stdout.strip().splitlines()[-1])
    times["process"] = process
    times["fixed"] = process - times["learning"]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", default=["seed", "local"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frames", type=int, default=1_000, help="env frames learned")
    parser.add_argument("--logdir", type=Path, default=Path("runs/startup"))
    parser.add_argument("--out", type=Path, help="write the medians and every run as JSON")
    args = parser.parse_args()
    results = {}
    for arch in args.archs:
        runs = [run_once(arch, args.frames, args.logdir) for _ in range(args.repeats)]
        medians = {p: statistics.median(r[p] for r in runs) for p in PHASES}
        results[arch] = {"median_s": medians, "runs": runs}
        print(f"{arch}, {args.frames:,} frames, median of {args.repeats} fresh processes:")
        for phase in PHASES:
            print(f"  {phase:<18}{medians[phase]:6.2f} s")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
