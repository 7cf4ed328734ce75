"""Cost of one V-trace learner update, names-only preset, Adam fused vs per-parameter.

The update a names-only `Platform(arch="seed", algo="vtrace", env=ENV)` run makes (its
preset's network, batch and optimizer), on one batch of acted-on observations, timed
standalone on one torch thread. The same algorithm is built twice: with the Adam the
platform uses (`fused=True`: one kernel per step) and with torch's default
per-parameter Adam. Rounds interleave the two so that load from other processes
spreads over both; each row gives the median and the best round.

    python benchmarks/onpolicy_update.py                        # CartPole-v1
    python benchmarks/onpolicy_update.py --env Acrobot-v1 --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from rlfabric import Platform
from rlfabric.runtime.learner import make_algorithm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--updates", type=int, default=200, help="updates per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    platform = Platform(arch="seed", algo="vtrace", env=args.env)
    spec = platform.spec
    if spec.algo.optimizer != "adam":
        parser.error(f"the V-trace preset for {args.env} uses {spec.algo.optimizer}, not adam")
    variants = {}
    for fused in (True, False):
        torch.manual_seed(0)
        algo = make_algorithm(spec, platform.env_info, 1_000_000)
        if not fused:
            algo.optimizer = torch.optim.Adam(
                algo.model.parameters(), lr=spec.algo.lr, eps=spec.algo.eps
            )
        variants["fused" if fused else "per-parameter"] = algo

    T, B = spec.algo.unroll_length, spec.algo.batch_size
    space = platform.env_info.observation_space
    obs = np.stack([np.stack([space.sample() for _ in range(B)]) for _ in range(T + 1)])
    actor = variants["fused"]
    acted = [actor.act(obs[t]) for t in range(T)]
    batch = {
        "obs": obs,
        "is_first": np.zeros((T + 1, B), bool),
        "action": np.stack([a for a, _, _ in acted]),
        "logp": np.stack([extras["logp"] for _, extras, _ in acted]),
        "reward": np.ones((T, B), np.float32),
        "terminated": np.zeros((T, B), bool),
        "truncated": np.zeros((T, B), bool),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for algo in variants.values():  # warm-up
        for _ in range(20):
            algo.update(batch)
    for _ in range(args.rounds):
        for name, algo in variants.items():
            start = time.perf_counter()
            for _ in range(args.updates):
                algo.update(batch)
            times[name].append(1000.0 * (time.perf_counter() - start) / args.updates)
    print(f"{args.env} vtrace ({spec.preset}): batch {B} unrolls x {T} steps, 1 thread")
    base = statistics.median(times["per-parameter"])
    for name, ms in times.items():
        median = statistics.median(ms)
        print(
            f"  Adam {name:<13} median {median:.3f} ms/update, best {min(ms):.3f}, "
            f"x{base / median:.2f} of per-parameter"
        )


if __name__ == "__main__":
    main()
