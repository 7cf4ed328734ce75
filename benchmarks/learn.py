"""Time to solve CartPole-v1 with SEED + V-trace: wall time of `fit()`, Ray start included.

Runs examples/specs/cartpole_seed_vtrace.yaml (no stop condition: the run ends
at CartPole-v1's reward_threshold, a 100-episode mean return of 475) once per
seed and prints env frames and wall time for each, then the median.

    python benchmarks/learn.py                    # seeds 0 1 2
    python benchmarks/learn.py --seeds 0 --spec examples/specs/cartpole_local_vtrace.yaml
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray

from rlfabric import Platform


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="examples/specs/cartpole_seed_vtrace.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--logdir", default="runs/bench-learn")
    parser.add_argument("overrides", nargs="*", help="dotted spec overrides")
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        start = time.perf_counter()  # before Platform: spec checks and Ray start count
        platform = Platform.from_yaml(
            args.spec,
            [*args.overrides, f"run.seed={seed}", f"run.logdir={args.logdir}", "run.display=none"],
        )
        result = platform.fit()
        wall = time.perf_counter() - start
        assert not ray.is_initialized()  # every run starts (and pays for) its own Ray
        m = result.metrics
        rows.append(
            (
                seed,
                m.get("episode_return_mean", float("nan")),
                m["env_frames"],
                wall,
                result.stop_reason,
            )
        )
        print(
            f"seed {seed}: return {rows[-1][1]:.1f}, env frames {m['env_frames']:,}, "
            f"wall {wall:.1f} s ({result.stop_reason})",
            flush=True,
        )
    print(f"\n{'seed':>4} {'return':>8} {'env frames':>12} {'wall s':>8}  stop")
    for seed, ret, frames, wall, reason in rows:
        print(f"{seed:>4} {ret:>8.1f} {frames:>12,} {wall:>8.1f}  {reason}")
    print(
        f"median wall time {statistics.median(r[3] for r in rows):.1f} s, median env frames "
        f"{statistics.median(r[2] for r in rows):,.0f}; spec {args.spec}"
    )


if __name__ == "__main__":
    main()
