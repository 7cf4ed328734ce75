"""Env frames/s of a names-only run with its learner on one torch thread or on all CPUs.

By default a learner takes as many torch threads as the CPUs Ray reserves for it: one,
on a small machine (`resources.learner_threads`). The idea this measures: while the
learner trains, backpressure holds the env runners, so their CPUs might as well serve
the update. It runs the names-only `Platform(arch=ARCH, algo=ALGO, env=ENV)` for
SECONDS twice per round, as named (the default) and with `resources.learner_cpus` set
to the machine's CPUs less a quarter (rounded: as many threads as CPUs), alternating
over the rounds so that load from other processes spreads over both, and prints the
steady state of each (the first third of the records dropped: Ray's start, actors,
first compile).

    python benchmarks/learner_threads.py                                # SEED + V-trace on Pong
    python benchmarks/learner_threads.py --algo sac --env HalfCheetah-v5
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from throughput import seed_run  # this script's folder is first on sys.path

from rlfabric import Platform
from rlfabric.runtime.config import available_cpus


def steady_run(arch: str, algo: str, env: str, seconds: float, logdir: str, **kw: Any) -> dict:
    """`throughput.seed_run`'s steady state of the names-only run, and the learner's threads."""
    settings = {"algo": algo, "env": env, **kw}
    threads = Platform(arch=arch, **settings).spec.resources.learner_threads
    return {"threads": threads, **seed_run(settings, seconds, logdir, arch=arch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="seed")
    parser.add_argument("--algo", default="vtrace")
    parser.add_argument("--env", default="ALE/Pong-v5")
    parser.add_argument("--seconds", type=float, default=90.0, help="wall time per run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--logdir", default="runs/bench-learner-threads")
    args = parser.parse_args()
    # All but a quarter CPU reserved: rounded, that many threads, and the runners' shares
    # (0.05 CPU at least each, up to 4 runners) still place.
    all_cpus = {"resources": {"learner_cpus": available_cpus() - 0.25}}
    variants = {"default": {}, "all CPUs": all_cpus}
    rows: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, kw in variants.items():
            row = steady_run(args.arch, args.algo, args.env, args.seconds, args.logdir, **kw)
            rows[name].append(row)
            print(name, row, flush=True)
    print(
        f"\n{args.arch} + {args.algo} on {args.env}, names only, {args.seconds:.0f} s runs, "
        f"median of {args.rounds} round(s), steady state:"
    )
    base = statistics.median(r["env_frames_per_s"] for r in rows["default"])
    for name, runs in rows.items():
        fps = statistics.median(r["env_frames_per_s"] for r in runs)
        step = statistics.median(r["learner_step_ms"] for r in runs)
        lag = statistics.median(r["policy_lag"] for r in runs)
        print(
            f"  {name:<10} {runs[0]['threads']} learner threads: {fps:8,.0f} env frames/s "
            f"(x{fps / base:.2f}), learner step {step:8.1f} ms, policy lag {lag:.1f}"
        )


if __name__ == "__main__":
    main()
