"""Cost of one Atari learner update with the Nature CNN against IMPALA's deep ResNet.

The update a names-only `Platform(arch="seed", algo=ALGO, env="ALE/Pong-v5")` run makes
(its preset's batch, passes, optimizer and precision), once with `model.torso: cnn`
(the preset's) and once with `model.torso: impala_cnn`, on the same batch of random
observations. Rounds interleave the two so that load from other processes spreads over
both; each row gives the median and the best round, and the ResNet's cost as a multiple
of the Nature CNN's, with each torso's parameter count.

    python benchmarks/torso_cost.py                         # vtrace and a3c, all CPUs
    python benchmarks/torso_cost.py --algos vtrace --rounds 9
"""

from __future__ import annotations

import statistics

import torch
from conv_layout import parse_args, random_batch, time_updates

from rlfabric import Platform
from rlfabric.runtime.learner import make_algorithm

TORSOS = ("cnn", "impala_cnn")


def main() -> None:
    args = parse_args(__doc__)
    for algo_name in args.algos:
        platforms = {
            torso: Platform(arch="seed", algo=algo_name, env=args.env, model={"torso": torso})
            for torso in TORSOS
        }
        algos = {}
        for torso, platform in platforms.items():
            torch.manual_seed(0)
            algos[torso] = make_algorithm(platform.spec, platform.env_info, 10_000_000)
        batch = random_batch(platforms["cnn"], algos["cnn"])
        times, _ = time_updates(algos, batch, args.rounds, args.seconds)
        spec = platforms["cnn"].spec
        print(
            f"{args.env} {algo_name} ({spec.preset}): {spec.algo.batch_size} unrolls x "
            f"{spec.algo.unroll_length} steps, precision {spec.model.precision}, "
            f"{args.threads} threads, {args.rounds} rounds"
        )
        base = statistics.median(times["cnn"])
        for torso, ms in times.items():
            median = statistics.median(ms)
            params = sum(p.numel() for p in algos[torso].model.torso.parameters())
            print(
                f"  {torso:<10} {params:>9,} torso params  median {median:9.2f} ms/update, "
                f"best {min(ms):9.2f}, x{median / base:.2f} of cnn"
            )


if __name__ == "__main__":
    main()
