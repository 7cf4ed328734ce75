"""Cost of one Atari learner update in torch's default layout against channels-last.

The update a names-only `Platform(arch="seed", algo=ALGO, env="ALE/Pong-v5")` run makes
(its preset's Nature CNN, batch, passes, optimizer and precision), on one batch of
random observations acted on by the model, in three layouts:

- `default`: NCHW, as the models run;
- `cl_input`: the conv stack's input made channels-last (a forward pre-hook on it);
- `cl_model`: that, and the model's weights in channels-last too.

Channels-last lets oneDNN (CPU) and cuDNN (GPU, half precision) skip layout reorders
around each convolution; whether it pays depends on the device and precision, so it
is measured, not assumed. Rounds interleave the variants so that load from other
processes spreads over all of them; each row gives the median and the best round.

    python benchmarks/conv_layout.py                         # vtrace and a3c, all CPUs
    python benchmarks/conv_layout.py --algos a3c --threads 1 --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from rlfabric import Platform
from rlfabric.runtime.learner import make_algorithm

VARIANTS = ("default", "cl_input", "cl_model")


def _channels_last(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
    return (args[0].contiguous(memory_format=torch.channels_last),)


def build(platform: Platform, variant: str) -> Any:
    """The preset's algorithm, its conv stacks fed (and, for cl_model, stored) channels-last."""
    torch.manual_seed(0)
    algo = make_algorithm(platform.spec, platform.env_info, 10_000_000)
    if variant != "default":
        convs = [
            m
            for m in algo.model.modules()
            if isinstance(m, nn.Sequential) and any(isinstance(c, nn.Conv2d) for c in m)
        ]
        if not convs:
            raise SystemExit(f"{platform.spec.preset}: no conv stack to lay out channels-last")
        for conv in convs:
            conv.register_forward_pre_hook(_channels_last)
    if variant == "cl_model":
        algo.model.to(memory_format=torch.channels_last)
    return algo


def random_batch(platform: Platform, algo: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """A time-major batch of the preset's shape, acted on by `algo` (its log-probs kept)."""
    cfg = platform.spec.algo
    T, B = cfg.unroll_length, cfg.batch_size
    shape = platform.env_info.observation_space.shape
    obs = np.random.default_rng(seed).integers(0, 256, (T + 1, B, *shape), dtype=np.uint8)
    acted = [algo.act(obs[t]) for t in range(T)]
    batch = {
        "obs": obs,
        "is_first": np.zeros((T + 1, B), bool),
        "action": np.stack([action for action, _, _ in acted]),
        "reward": np.ones((T, B), np.float32),
        "terminated": np.zeros((T, B), bool),
        "truncated": np.zeros((T, B), bool),
    }
    for key in acted[0][1]:
        batch[key] = np.stack([extras[key] for _, extras, _ in acted])
    return batch


def time_updates(
    algos: dict[str, Any], batch: dict[str, np.ndarray], rounds: int, seconds: float
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Milliseconds per `update(batch)` of each algorithm, one figure per round, and the
    updates per round: after a warm-up update each (oneDNN picks its kernels on first
    use), each variant makes as many updates a round as fill `seconds`, and rounds
    interleave the variants so that load from other processes spreads over all of them."""
    for algo in algos.values():
        algo.update(batch)
    per_round = {}
    for name, algo in algos.items():
        start = time.perf_counter()
        algo.update(batch)
        per_round[name] = max(1, round(seconds / (time.perf_counter() - start)))
    times: dict[str, list[float]] = {name: [] for name in algos}
    for _ in range(rounds):
        for name, algo in algos.items():
            start = time.perf_counter()
            for _ in range(per_round[name]):
                algo.update(batch)
            times[name].append(1000.0 * (time.perf_counter() - start) / per_round[name])
    return times, per_round


def parse_args(doc: str) -> argparse.Namespace:
    """The options of an update-timing script (this one, torso_cost.py); sets the threads."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--env", default="ALE/Pong-v5")
    parser.add_argument("--algos", nargs="+", default=["vtrace", "a3c"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="least time per round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = parse_args(__doc__)
    for algo_name in args.algos:
        platform = Platform(arch="seed", algo=algo_name, env=args.env)
        algos = {variant: build(platform, variant) for variant in VARIANTS}
        batch = random_batch(platform, algos["default"])
        times, per_round = time_updates(algos, batch, args.rounds, args.seconds)
        cfg = platform.spec.algo
        print(
            f"{args.env} {algo_name} ({platform.spec.preset}): {cfg.batch_size} unrolls x "
            f"{cfg.unroll_length} steps, precision {platform.spec.model.precision}, "
            f"{args.threads} threads, {args.rounds} rounds of {per_round['default']} updates"
        )
        base = statistics.median(times["default"])
        for variant, ms in times.items():
            median = statistics.median(ms)
            print(
                f"  {variant:<9} median {median:9.2f} ms/update, best {min(ms):9.2f}, "
                f"x{base / median:.2f} of default"
            )


if __name__ == "__main__":
    main()
