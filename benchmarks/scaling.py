"""Throughput with more env runners and more learners, per architecture, on one machine.

Each configuration runs the CartPole V-trace example spec of its architecture
(`examples/specs/cartpole_<arch>_vtrace.yaml`) with IMPALA's batch of 32
unrolls of 20 (as `benchmarks/throughput.py`) for --seconds of wall time and
reports the steady env frames/s and learner samples/s (mean over the second
half of the run, so that Ray start and warm-up are left out), with the CPU
shares Ray hands out: the learners take --learner-cpus each, the runners
share what is left. On a machine with fewer cores than processes the figures
show the cost of oversubscription, which is the point of measuring it here.

    python benchmarks/scaling.py --archs seed,impala,ga3c --runners 1 2 4 --learners 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rlfabric import Platform


def measure(arch: str, runners: int, learners: int, args: argparse.Namespace) -> dict:
    name = f"{arch}_r{runners}_l{learners}"
    overrides = [
        f"resources.num_env_runners={runners}",
        f"resources.num_learners={learners}",
        f"resources.learner_cpus={args.learner_cpus}",
        f"run.stop.wall_time_s={args.seconds}",
        "run.stop.env_frames=1000000000",
        "run.stop.episode_return_mean=1000000",
        f"run.logdir={args.logdir}",
        f"run.name={name}",
        "run.display=none",
        "run.checkpoint_interval_s=0",
        "arch.autotune=false",
        "algo.batch_size=32",  # IMPALA's batch, as benchmarks/throughput.py: the learner
        "algo.unroll_length=20",  # is not the bottleneck at CartPole's tuned batch of 4 x 10
    ]
    result = Platform.from_yaml(f"examples/specs/cartpole_{arch}_vtrace.yaml", overrides).fit()
    lines = (Path(result.logdir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    late = records[len(records) // 2 :]
    return {
        "arch": arch,
        "runners": runners,
        "learners": learners,
        "frames_per_s": statistics.mean(r["env_frames_per_s"] for r in late),
        "samples_per_s": statistics.mean(r["learner_samples_per_s"] for r in late),
        "return": result.metrics.get("episode_return_mean", float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="seed,impala,ga3c")
    parser.add_argument("--runners", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--learner-cpus", type=float, default=0.5)
    parser.add_argument("--logdir", default="runs/bench-scaling")
    args = parser.parse_args()
    rows = []
    for arch in args.archs.split(","):
        for runners in args.runners:
            rows.append(measure(arch, runners, 1, args))
            print(rows[-1], flush=True)
        for learners in args.learners:
            if learners > 1:
                rows.append(measure(arch, args.runners[0], learners, args))
                print(rows[-1], flush=True)
    print(f"\n{args.seconds:.0f} s per run, learner_cpus {args.learner_cpus}")
    print(f"{'arch':>7} {'runners':>8} {'learners':>9} {'frames/s':>10} {'samples/s':>10}")
    for r in rows:
        print(
            f"{r['arch']:>7} {r['runners']:>8} {r['learners']:>9} {r['frames_per_s']:>10,.0f} "
            f"{r['samples_per_s']:>10,.0f}"
        )


if __name__ == "__main__":
    main()
