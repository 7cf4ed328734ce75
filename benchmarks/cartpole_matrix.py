"""Every architecture x algorithm on CartPole-v1, from its example spec.

For each `examples/specs/cartpole_<arch>_<algo>.yaml`, train until the
100-episode mean return reaches --threshold or --max-frames env frames pass,
and print frames and wall time (Ray start included) to the threshold.

    python benchmarks/cartpole_matrix.py --threshold 195 --max-frames 500000
    python benchmarks/cartpole_matrix.py --algos vtrace --threshold 475 --max-frames 2000000
"""

from __future__ import annotations

import argparse
import time

from rlfabric import Platform


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="seed,impala,ga3c")
    parser.add_argument("--algos", default="vtrace,a3c,ppo")
    parser.add_argument("--threshold", type=float, default=195.0)
    parser.add_argument("--max-frames", type=int, default=500_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logdir", default="runs/bench-matrix")
    args = parser.parse_args()
    rows = []
    for algo in args.algos.split(","):
        for arch in args.archs.split(","):
            spec = f"examples/specs/cartpole_{arch}_{algo}.yaml"
            start = time.perf_counter()
            result = Platform.from_yaml(
                spec,
                [
                    f"run.stop.episode_return_mean={args.threshold}",
                    f"run.stop.env_frames={args.max_frames}",
                    f"run.seed={args.seed}",
                    f"run.logdir={args.logdir}",
                    "run.display=none",
                    "run.checkpoint_interval_s=0",
                ],
            ).fit()
            wall = time.perf_counter() - start
            m = result.metrics
            reached = result.stop_reason.startswith("episode_return_mean")
            rows.append(
                (
                    arch,
                    algo,
                    reached,
                    m["env_frames"],
                    wall,
                    m.get("episode_return_mean", float("nan")),
                )
            )
            print(
                f"{arch:>7} {algo:>7}: {'reached' if reached else 'NOT reached'} "
                f"{args.threshold} with {m['env_frames']:,} frames in {wall:.1f} s "
                f"(return {rows[-1][5]:.1f})",
                flush=True,
            )
    print(f"\nthreshold {args.threshold}, at most {args.max_frames:,} env frames, seed {args.seed}")
    print(f"{'arch':>7} {'algo':>7} {'reached':>8} {'env frames':>11} {'wall s':>7} {'return':>7}")
    for arch, algo, reached, frames, wall, ret in rows:
        print(
            f"{arch:>7} {algo:>7} {'yes' if reached else 'no':>8} {frames:>11,} {wall:>7.1f} "
            f"{ret:>7.1f}"
        )


if __name__ == "__main__":
    main()
