"""How far bf16 autocast moves a trained policy's log-probabilities from fp32's.

Under IMPALA with `model.precision: auto`, a GPU learner scores pi in bf16 while env
runners on CPUs without native bf16 computed mu in fp32: the importance ratios then
carry this rounding even with no policy lag. The script plays a run's newest
checkpoint for a few hundred steps, scores the visited observations both ways, and
prints the difference of the sampled actions' log-probabilities and how many ratios
it alone would push past the clip.

    python benchmarks/bf16_ratios.py RUN_DIR [--steps 400] [--envs 8]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from rlfabric.envs.factory import make_vector_env
from rlfabric.platform.evaluate import load_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=400, help="vector steps played")
    parser.add_argument("--envs", type=int, default=8)
    args = parser.parse_args()
    spec, algorithm = load_policy(args.run_dir)
    envs = make_vector_env(spec.env, args.envs, 7)
    obs, _ = envs.reset(seed=7)
    visited = []
    for _ in range(args.steps):
        visited.append(obs.copy())
        obs, *_ = envs.step(algorithm.act(obs)[0])
    envs.close()
    batch = torch.as_tensor(np.stack(visited[::4]))  # every 4th step: [T, B, ...]
    log_probs = {}
    for precision in ("fp32", "bf16"):
        algorithm.model.precision = precision
        with torch.no_grad():
            params, _ = algorithm.model(batch)
        log_probs[precision] = torch.log_softmax(params.float(), -1)
    action = torch.distributions.Categorical(logits=log_probs["fp32"]).sample()[..., None]
    diff = (log_probs["bf16"].gather(-1, action) - log_probs["fp32"].gather(-1, action)).flatten()
    off, ratio_off = diff.abs(), (diff.exp() - 1).abs()
    print(
        f"{spec.env.id}, {off.numel()} sampled actions: |log pi_bf16 - log pi_fp32| mean "
        f"{off.mean():.4f}, median {off.median():.4f}, p99 {off.quantile(0.99):.4f}, max "
        f"{off.max():.4f}; ratios past 1 +- 0.1: {ratio_off.gt(0.1).float().mean():.2%}, "
        f"past 1 +- 0.01: {ratio_off.gt(0.01).float().mean():.2%}"
    )


if __name__ == "__main__":
    main()
