"""SAC / TD3 dense vs sparse variants (RLx2 and its ablations) on one continuous-control env.

Each run trains with the algorithm's default settings plus the variant's
overrides, for --max-steps agent steps (stopping early once the 100-episode
mean return reaches the highest --thresholds value), then evaluates the final
policy greedily on 10 fresh episodes. It prints, per run: agent steps and
wall time (process start of the run included) at which the 100-episode mean
first reached each threshold, the final training mean, the evaluation mean,
and the sparse model's size and FLOPs as fractions of dense; then a summary
with each variant's evaluation mean as % of dense (positive-return envs).

Variants (sparsities from --actor / --critic; RLx2's HalfCheetah setting is 90/85):
  dense   no sparsity
  rlx2    RigL topology + delayed 3-step targets + dynamic-capacity buffer (RLx2)
  rigl    RigL topology only (1-step targets, plain buffer)
  set     SET topology (random growth) only
  static  a fixed random sparse topology (ERK), never updated

RLx2's schedules are set for 1M-step runs (topology update every 10k steps,
3-step targets after 300k updates, buffer checks every 10k steps, buffer
floor 100k). With --scale they are scaled to this run's length, keeping their
proportions: 100 topology updates per run, 3-step targets after 30% of it,
100 buffer checks, a floor of 10% of the run's steps.

    python benchmarks/offpolicy.py --env Pendulum-v1 --algos sac,td3 --variants dense,rigl \\
        --actor 0.9 --critic 0.9 --max-steps 30000 --thresholds -250 -200
    python benchmarks/offpolicy.py --env InvertedPendulum-v5 --algos td3 \\
        --variants dense,rlx2,rigl,set,static --seeds 0 1 2 --max-steps 30000 --scale --jobs 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS
from rlfabric.platform.evaluate import evaluate, load_policy

VARIANTS = ("dense", "rlx2", "rigl", "set", "static")


def variant_overrides(variant: str, args: argparse.Namespace, updates: int) -> list[str]:
    """Spec overrides of one variant; `updates` is the run's expected learner updates."""
    if variant == "dense":
        return []
    method = "rigl" if variant == "rlx2" else variant
    out = [f"sparse.actor={args.actor}", f"sparse.critic={args.critic}", f"sparse.method={method}"]
    if args.scale:
        out.append(f"sparse.delta={max(1, updates // 100)}")
    if variant == "rlx2":
        out += ["algo.n_step=3", "algo.dynamic_buffer=true"]
        if args.scale:
            out += [
                f"algo.n_step_after={int(0.3 * updates)}",
                f"algo.buffer_check_every={max(1, args.max_steps // 100)}",
                f"algo.buffer_min_capacity={max(1, args.max_steps // 10)}",
            ]
        else:
            out.append("algo.n_step_after=300000")
    return out


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """Train and evaluate one (algo, variant, seed); runs in its own process."""
    start = time.perf_counter()
    torch.set_num_threads(job["threads"])
    overrides = [
        f"run.stop.env_frames={job['max_steps']}",
        f"run.stop.episode_return_mean={max(job['thresholds'])}",
        f"run.seed={job['seed']}",
        f"run.logdir={job['logdir']}",
        f"run.name={job['algo']}_{job['variant']}_s{job['seed']}",
        "run.display=none",
        f"resources.torch_threads={job['threads']}",
        *job["overrides"],
    ]
    platform = Platform(
        {"env": {"id": job["env"], "num_envs": 2}, "arch": job["arch"], "algo": job["algo"]},
        overrides=overrides,
    )
    result = platform.fit()
    wall = time.perf_counter() - start
    records = [
        json.loads(line)
        for line in (Path(result.logdir) / "metrics.jsonl").read_text().splitlines()
    ]
    reached = {}
    for threshold in job["thresholds"]:
        hit = next((r for r in records if r.get("episode_return_mean", -1e18) >= threshold), None)
        reached[threshold] = None if hit is None else (hit["agent_steps"], hit["wall_time_s"])
    _, policy = load_policy(result.logdir)
    evaluation = evaluate(policy, platform.spec.env, episodes=10)
    m = result.metrics
    return {
        **{k: job[k] for k in ("algo", "variant", "seed")},
        "steps": m["agent_steps"],
        "wall_s": wall,
        "train_return": m.get("episode_return_mean", float("nan")),
        "eval_return": evaluation.mean,
        "reached": reached,
        "sparsity": (m.get("sparsity_actor", 0.0), m.get("sparsity_critic", 0.0)),
        "params": int(m.get("params_actor", 0) + m.get("params_critic", 0)),
        "inference_flops": m.get("inference_flops_fraction", 1.0),
        "train_flops": m.get("train_flops_fraction", 1.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="Pendulum-v1")
    parser.add_argument("--algos", default="sac,td3")
    parser.add_argument("--variants", default="dense,rigl")
    parser.add_argument("--actor", type=float, default=0.9, help="actor sparsity")
    parser.add_argument("--critic", type=float, default=0.85, help="critic sparsity")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--max-steps", type=int, default=30_000)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[-250.0])
    parser.add_argument("--scale", action="store_true", help="scale RLx2's schedules to the run")
    parser.add_argument("--arch", default="local")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one process each)")
    parser.add_argument("--logdir", default="runs/bench-offpolicy")
    parser.add_argument("overrides", nargs="*", help="dotted spec overrides for every run")
    args = parser.parse_args()
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}; allowed: {', '.join(VARIANTS)}")
    threads = 1 if args.jobs > 1 else 2
    jobs = []
    for algo in args.algos.split(","):
        cfg = ALGORITHMS[algo].config_cls()
        updates = int(max(0, args.max_steps - cfg.warmup_steps) * cfg.updates_per_step)
        for variant in args.variants.split(","):
            for seed in args.seeds:
                jobs.append(
                    {
                        "env": args.env,
                        "arch": args.arch,
                        "algo": algo,
                        "variant": variant,
                        "seed": seed,
                        "max_steps": args.max_steps,
                        "thresholds": args.thresholds,
                        "logdir": args.logdir,
                        "threads": threads,
                        "overrides": [*variant_overrides(variant, args, updates), *args.overrides],
                    }
                )
    print(
        f"{args.env}, arch {args.arch}, at most {args.max_steps:,} agent steps, sparsity "
        f"actor {args.actor} / critic {args.critic}, scaled schedules: {args.scale}, "
        f"{args.jobs} run(s) at once, {threads} torch thread(s) each",
        flush=True,
    )
    rows = []
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for row in pool.map(run_one, jobs):
            rows.append(row)
            hits = "  ".join(
                f"{t:g}: " + ("not reached" if r is None else f"{r[0]:,} steps {r[1]:.0f} s")
                for t, r in row["reached"].items()
            )
            print(
                f"{row['algo']:>4} {row['variant']:>6} seed {row['seed']}: {row['steps']:,} steps "
                f"{row['wall_s']:.0f} s | {hits} | train {row['train_return']:.0f} "
                f"eval {row['eval_return']:.0f} | sparsity {row['sparsity'][0]:.2f}/"
                f"{row['sparsity'][1]:.2f}, {row['params']:,} params, inference FLOPs "
                f"{row['inference_flops']:.3f}, training FLOPs {row['train_flops']:.3f} of dense",
                flush=True,
            )
    print(
        f"\n{'algo':>4} {'variant':>7} {'eval mean':>10} {'eval sd':>8} {'% dense':>8} "
        f"{'params':>9} {'infer FLOPs':>12} {'train FLOPs':>12}"
    )
    for algo in args.algos.split(","):
        dense = [r["eval_return"] for r in rows if r["algo"] == algo and r["variant"] == "dense"]
        for variant in args.variants.split(","):
            mine = [r for r in rows if r["algo"] == algo and r["variant"] == variant]
            evals = [r["eval_return"] for r in mine]
            mean = statistics.mean(evals)
            sd = statistics.stdev(evals) if len(evals) > 1 else 0.0
            pct = (
                f"{100 * mean / statistics.mean(dense):.1f}"
                if dense and statistics.mean(dense) > 0
                else "-"
            )
            print(
                f"{algo:>4} {variant:>7} {mean:>10.1f} {sd:>8.1f} {pct:>8} "
                f"{mine[0]['params']:>9,} {mine[0]['inference_flops']:>12.3f} "
                f"{mine[0]['train_flops']:>12.3f}"
            )


if __name__ == "__main__":
    main()
