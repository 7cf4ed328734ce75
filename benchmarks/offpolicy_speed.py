"""Learner updates/s of SAC (or TD3) at the default size, per precision x threads x critics.

One standalone `update()` of the algorithm as the learner runs it (replay batch to
tensors, critic, actor and temperature steps, soft target update) on random batches of
HalfCheetah's sizes (17-dim observations, 6-dim actions), with the default networks
(2x256 ReLU MLPs, twin critics, batch 256, Adam). Variants: `model.precision` fp32 or
bf16, torch threads, and the twin critics as separate networks or one batched ensemble
(`algo.ensemble_critics`). Rounds interleave the variants so that load from other
processes spreads over all of them; each row gives the median and the best round (on a
shared machine the best is the nearer to what a quiet one does), the fp32 / 1-thread /
separate-critics baseline's median beside it, and the speed-up of the medians.

    python benchmarks/offpolicy_speed.py                       # SAC, threads 1 and all CPUs
    python benchmarks/offpolicy_speed.py --algo td3 --threads 1 2 4 --seconds 5 --rounds 5
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from rlfabric.algorithms import ALGORITHMS, Algorithm
from rlfabric.models import ModelConfig
from rlfabric.runtime.config import available_cpus

OBS_DIM, ACTION_DIM = 17, 6  # HalfCheetah-v5


@dataclass(frozen=True)
class Variant:
    precision: str
    threads: int
    ensemble: bool

    def __str__(self) -> str:
        critics = "ensemble" if self.ensemble else "separate"
        return f"{self.precision:<5} {self.threads:>2} thr  {critics:<8}"


def build(algo: str, variant: Variant, batch_size: int) -> Algorithm:
    torch.manual_seed(0)
    cls = ALGORITHMS[algo]
    cfg = cls.config_cls(batch_size=batch_size, ensemble_critics=variant.ensemble)
    obs = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)
    act = gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)
    return cls(cfg, obs, act, ModelConfig(precision=variant.precision))


def batches(batch_size: int, count: int = 8) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "obs": rng.normal(size=(batch_size, OBS_DIM)).astype(np.float32),
            "action": rng.uniform(-1, 1, (batch_size, ACTION_DIM)).astype(np.float32),
            "reward": rng.normal(size=batch_size).astype(np.float32),
            "next_obs": rng.normal(size=(batch_size, OBS_DIM)).astype(np.float32),
            "discount": np.full(batch_size, 0.99, np.float32),
        }
        for _ in range(count)
    ]


def updates_per_s(
    algo: Algorithm, data: list[dict[str, np.ndarray]], threads: int, seconds: float
) -> float:
    """Updates/s over `seconds` after a short warm-up, with `threads` torch threads."""
    torch.set_num_threads(threads)
    for batch in data:  # warm-up: allocator, oneDNN kernels, autocast paths
        algo.update(batch)
    count, start = 0, time.perf_counter()
    for batch in itertools.cycle(data):
        algo.update(batch)
        count += 1
        if time.perf_counter() - start >= seconds:
            break
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algo", choices=["sac", "td3"], default="sac")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1, all")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=3.0, help="per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    threads = args.threads or sorted({1, available_cpus()})

    baseline = Variant("fp32", 1, False)
    variants = [Variant(p, t, e) for p in args.precisions for t in threads for e in (False, True)]
    if baseline not in variants:
        variants.insert(0, baseline)
    algos = {v: build(args.algo, v, args.batch_size) for v in variants}
    data = batches(args.batch_size)
    rates: dict[Variant, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            rates[variant].append(
                updates_per_s(algos[variant], data, variant.threads, args.seconds)
            )

    base = statistics.median(rates[baseline])
    print(
        f"{args.algo} updates/s, batch {args.batch_size}, obs {OBS_DIM}, act {ACTION_DIM}, "
        f"median of {args.rounds} rounds x {args.seconds:g} s; torch {torch.__version__}, "
        f"{available_cpus()} CPUs"
    )
    print(
        f"{'variant':<26} {'updates/s':>10} {'best':>8} {'ms/update':>10} "
        f"{'fp32 1 thr sep':>15} {'x':>6}"
    )
    for variant in variants:
        rate = statistics.median(rates[variant])
        print(
            f"{variant!s:<26} {rate:>10.1f} {max(rates[variant]):>8.1f} {1000 / rate:>10.2f} "
            f"{base:>15.1f} {rate / base:>6.2f}"
        )


if __name__ == "__main__":
    main()
