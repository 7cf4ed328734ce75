"""SAC / TD3 dense vs sparse variants (RLx2 and its ablations), or fp32 vs bf16, on one env.

Each run trains with the algorithm's default settings plus the variant's
overrides, for --max-steps agent steps (stopping early once the 100-episode
mean return reaches the highest --thresholds value), then evaluates the final
policy greedily on 10 fresh episodes. It prints, per run: agent steps and
the run's wall time (summed over its resumes) at which the 100-episode mean
first reached each threshold, the final training mean, the evaluation mean,
and the sparse model's size and FLOPs as fractions of dense; then a summary
with each variant's evaluation mean as % of dense (positive-return envs).

Variants (sparsities from --actor / --critic; RLx2's HalfCheetah setting is 90/85):
  dense   no sparsity, the preset's precision (`auto` for the MuJoCo presets: bf16
          where the CPU or GPU has it natively)
  dense_bf16  no sparsity, every network's matmuls under bfloat16 autocast
          (`model.precision: bf16`; learning must not change with it)
  dense_fp32  no sparsity, fp32 whatever the device (`model.precision: fp32`)
  rlx2    RigL topology + delayed 3-step targets + dynamic-capacity buffer (RLx2)
  rigl    RigL topology only (1-step targets, plain buffer)
  set     SET topology (random growth) only
  static  a fixed random sparse topology (ERK), never updated
  rlx2_no_nstep   RLx2 without its multi-step targets (RigL + dynamic buffer)
  rlx2_no_buffer  RLx2 without its dynamic buffer (RigL + delayed 3-step, plain buffer)
  rlx2_paper_buffer  RLx2 with the buffer's bounds and check interval left at the
          paper's (TD3 100k-1M, SAC 200k-3M, a check every 10k steps) while
          --paper-steps or --scale scales the rest: TD3's floor scaled by 0.1 is
          10k transitions, 10 HalfCheetah episodes

RLx2's schedules are set for its runs (topology update every 10k steps, 3-step
targets after 300k updates, buffer checks every 10k steps, buffer bounds 100k-1M
for TD3, 200k-3M for SAC). With --scale they are scaled to this run's length,
keeping their proportions: 100 topology updates per run, 3-step targets after
30% of it, 100 buffer checks, a floor of 10% of the run's steps. With
--paper-steps N every one of them (and the buffer's upper bound) is multiplied
by the same factor, --max-steps / N (the HalfCheetah runs: 300k of the paper's 3M steps,
0.1), except `rlx2_paper_buffer`'s buffer settings; the end of the drop-fraction
schedule is the run's last update either way.

Each run lives in `--logdir/<algo>_<variant>_s<seed>/` and checkpoints every
--checkpoint-s seconds. Run the same command again after an interruption: a
finished run (its row is there, for the same --max-steps) is read back, an
unfinished one (or one given a new --max-steps) resumes from its newest
checkpoint. --thresholds with no value trains every run to --max-steps; --json
writes the comparison (one algorithm) with its curves, and a PNG of them beside it.

With --json each finished run's row is also kept beside it, in
`<json stem>_rows/<algo>_<variant>_s<seed>.json`, and read back from there: commit
those and a comparison longer than one sitting survives the loss of its run
folders (checkpoints are too big to commit). --train VARIANT:SEED ... trains only
those of the missing runs now; the comparison is written from the rows there are,
naming the ones still missing.

    python benchmarks/offpolicy.py --env Pendulum-v1 --algos sac,td3 --variants dense,rigl \\
        --actor 0.9 --critic 0.9 --max-steps 30000 --thresholds -250 -200
    python benchmarks/offpolicy.py --env InvertedPendulum-v5 --algos td3 \\
        --variants dense,rlx2,rigl,set,static --seeds 0 1 2 --max-steps 30000 --scale --jobs 2
    python benchmarks/offpolicy.py --env HalfCheetah-v5 --algos td3 --actor 0.9 --critic 0.85 \\
        --variants dense,rlx2,rigl,set,static --seeds 0 1 --max-steps 300000 \\
        --paper-steps 3000000 --thresholds --jobs 2 --logdir runs/rlx2_300k \\
        --json benchmarks/results/rlx2_halfcheetah_td3_300k.json --train set:1 static:1
    # the same comparison with RLx2's two ablations added (their rows join the others')
    python benchmarks/offpolicy.py --env HalfCheetah-v5 --algos td3 --actor 0.9 --critic 0.85 \\
        --variants dense,rlx2,rigl,set,static,rlx2_no_nstep,rlx2_no_buffer --seeds 0 1 \\
        --max-steps 300000 --paper-steps 3000000 --thresholds --jobs 2 \\
        --logdir runs/rlx2_300k --json benchmarks/results/rlx2_halfcheetah_td3_300k.json
    # SAC's learning under fp32 and bf16 100k steps, two seeds each
    python benchmarks/offpolicy.py --env HalfCheetah-v5 --algos sac \\
        --variants dense_bf16,dense_fp32 --seeds 0 1 --max-steps 100000 --thresholds --jobs 2 \\
        --logdir runs/precision --json benchmarks/results/sac_halfcheetah_precision_100k.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from reproduce import plot_curves

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS
from rlfabric.platform.evaluate import evaluate, load_policy
from rlfabric.platform.reporting import read_records
from rlfabric.runtime.replay import CAPACITY_BOUNDS

#: RLx2 and its ablations (RigL topology each) and which of RLx2's value-learning parts
#: each uses: (delayed multi-step targets, dynamic-capacity buffer). The two ablations
#: tell which part makes RLx2 differ from RigL alone.
RLX2_PARTS = {
    "rlx2": (True, True),
    "rlx2_no_nstep": (False, True),
    "rlx2_no_buffer": (True, False),
    "rlx2_paper_buffer": (True, True),
}

#: RLx2 variants whose buffer bounds and check interval stay the paper's, scaled or not.
PAPER_BUFFER = {"rlx2_paper_buffer"}

VARIANTS = ("dense", "dense_bf16", "dense_fp32", "rigl", "set", "static", *RLX2_PARTS)


#: RLx2's schedule (tyq1024/RLx2 defaults): topology update every `delta` optimizer steps,
#: 3-step targets after `n_step_after` updates, a capacity check every
#: `buffer_check_every` stored steps; the buffer bounds are `CAPACITY_BOUNDS`'.
PAPER_SCHEDULE = {"delta": 10_000, "n_step_after": 300_000, "buffer_check_every": 10_000}


#: The dynamic buffer's entries of `paper_schedule`.
BUFFER_SCHEDULE = ("buffer_check_every", "buffer_min_capacity", "buffer_capacity")


def paper_schedule(algo: str, factor: float) -> dict[str, int]:
    """RLx2's schedule and buffer bounds for `algo`, every one multiplied by `factor`."""
    low, high = CAPACITY_BOUNDS[algo]
    scaled = {**PAPER_SCHEDULE, "buffer_min_capacity": low, "buffer_capacity": high}
    return {key: max(1, round(value * factor)) for key, value in scaled.items()}


def variant_overrides(variant: str, algo: str, args: argparse.Namespace, updates: int) -> list[str]:
    """Spec overrides of one variant; `updates` is the run's expected learner updates."""
    if variant == "dense":
        return []
    if variant in ("dense_bf16", "dense_fp32"):
        return [f"model.precision={variant.removeprefix('dense_')}"]
    method = "rigl" if variant in RLX2_PARTS else variant
    n_step, dynamic_buffer = RLX2_PARTS.get(variant, (False, False))
    out = [f"sparse.actor={args.actor}", f"sparse.critic={args.critic}", f"sparse.method={method}"]
    schedule = paper_schedule(algo, args.max_steps / args.paper_steps) if args.paper_steps else None
    if schedule:
        out.append(f"sparse.delta={schedule['delta']}")
    elif args.scale:
        out.append(f"sparse.delta={max(1, updates // 100)}")
    if n_step:
        if schedule:
            after = schedule["n_step_after"]
        else:
            after = int(0.3 * updates) if args.scale else PAPER_SCHEDULE["n_step_after"]
        out += ["algo.n_step=3", f"algo.n_step_after={after}"]
    if dynamic_buffer:
        out.append("algo.dynamic_buffer=true")
        if variant in PAPER_BUFFER or schedule:
            buffer = paper_schedule(algo, 1.0) if variant in PAPER_BUFFER else schedule
            out += [f"algo.{key}={buffer[key]}" for key in BUFFER_SCHEDULE]
        elif args.scale:
            out += [
                f"algo.buffer_check_every={max(1, args.max_steps // 100)}",
                f"algo.buffer_min_capacity={max(1, args.max_steps // 10)}",
            ]
    return out


def run_name(job: dict[str, Any]) -> str:
    """The run's folder name, and its kept row's file name."""
    return f"{job['algo']}_{job['variant']}_s{job['seed']}"


def saved_row(job: dict[str, Any]) -> dict[str, Any] | None:
    """The finished row of `job` (from the kept rows, else its run folder), if it was
    trained to the same --max-steps; a row for another budget is resumed to this one."""
    paths = [Path(job["logdir"]) / run_name(job) / "row.json"]
    if job["rows"]:
        paths.insert(0, job["rows"] / f"{run_name(job)}.json")
    for path in paths:
        if path.exists():
            row = json.loads(path.read_text())
            if row["max_steps"] == job["max_steps"]:
                return row
    return None


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """Train (or resume) and evaluate one (algo, variant, seed); runs in its own process.
    The row is saved as `row.json` in the run folder, and in the kept rows, once complete."""
    torch.set_num_threads(job["threads"])
    folder = Path(job["logdir"]) / run_name(job)
    overrides = [
        f"run.stop.env_frames={job['max_steps']}",
        f"run.seed={job['seed']}",
        f"run.logdir={job['logdir']}",
        f"run.name={folder.name}",
        f"run.checkpoint_interval_s={job['checkpoint_s']}",
        "run.display=none",
        f"resources.torch_threads={job['threads']}",
        *job["overrides"],
    ]
    if job["thresholds"]:
        overrides.append(f"run.stop.episode_return_mean={max(job['thresholds'])}")
    checkpoints = folder / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        platform = Platform.resume(folder, overrides)
    else:
        spec = {"env": {"id": job["env"], "num_envs": 2}, "arch": job["arch"], "algo": job["algo"]}
        platform = Platform(spec, overrides=overrides)
    result = platform.fit()
    records = read_records(folder / "metrics.jsonl")
    reached = []  # (threshold, agent steps, wall s) or (threshold, None, None): JSON-safe
    for threshold in job["thresholds"]:
        hit = next((r for r in records if r.get("episode_return_mean", -1e18) >= threshold), None)
        reached.append(
            (
                threshold,
                *((None, None) if hit is None else (hit["agent_steps"], hit["wall_time_s"])),
            )
        )
    _, policy = load_policy(result.logdir)
    evaluation = evaluate(policy, platform.spec.env, episodes=10)
    m = result.metrics
    every = max(1, len(records) // 200)
    row = {
        **{k: job[k] for k in ("algo", "variant", "seed", "max_steps")},
        "steps": m["agent_steps"],
        "wall_s": records[-1]["wall_time_s"],  # over every resume of the run
        "train_return": m.get("episode_return_mean", float("nan")),
        "eval_return": evaluation.mean,
        "reached": reached,
        "sparsity": (m.get("sparsity_actor", 0.0), m.get("sparsity_critic", 0.0)),
        "params": int(m.get("params_actor", 0) + m.get("params_critic", 0)),
        "inference_flops": m.get("inference_flops_fraction", 1.0),
        "train_flops": m.get("train_flops_fraction", 1.0),
        "curve": [
            (r["agent_steps"], r["episode_return_mean"])
            for r in records[::every]
            if r.get("episode_return_mean") is not None
        ],
    }
    (folder / "row.json").write_text(json.dumps(row))
    if job["rows"]:
        job["rows"].mkdir(parents=True, exist_ok=True)
        (job["rows"] / f"{run_name(job)}.json").write_text(json.dumps(row) + "\n")
    return row


def comparison(
    rows: list[dict[str, Any]], missing: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """The issue-12 result: per variant the greedy evaluation over the seeds that have
    finished, and the sizes; `missing` names the runs not finished yet."""
    dense = [r for r in rows if r["variant"] == "dense"]
    variants = {}
    for variant in args.variants.split(","):
        mine = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["seed"])
        if not mine:
            continue
        variants[variant] = {
            "eval_return_mean": statistics.mean(r["eval_return"] for r in mine),
            "per_seed": [
                {k: r[k] for k in ("seed", "eval_return", "train_return", "steps", "wall_s")}
                for r in mine
            ],
            "params": mine[0]["params"],
            "params_fraction": mine[0]["params"] / dense[0]["params"] if dense else None,
            "train_flops_fraction": mine[0]["train_flops"],
            "inference_flops_fraction": mine[0]["inference_flops"],
        }
    (algo,) = args.algos.split(",")
    factor = args.max_steps / args.paper_steps if args.paper_steps else None
    return {
        "env": args.env,
        "algo": algo,
        "arch": args.arch,
        "sparsity": {"actor": args.actor, "critic": args.critic},
        "agent_steps": args.max_steps,
        "schedule": {
            "paper_steps": args.paper_steps,
            "factor": factor,
            **(paper_schedule(algo, factor) if factor else {}),
        },
        "variants": variants,
        "missing": missing,
        "curves": {f"{r['variant']} s{r['seed']}": r["curve"] for r in rows},
        "command": "python benchmarks/offpolicy.py " + " ".join(sys.argv[1:]),
    }


def report(row: dict[str, Any]) -> None:
    """One run's line: thresholds reached, returns, sizes."""
    hits = "  ".join(
        f"{t:g}: " + ("not reached" if steps is None else f"{steps:,} steps {wall:.0f} s")
        for t, steps, wall in row["reached"]
    )
    print(
        f"{row['algo']:>4} {row['variant']:>14} seed {row['seed']}: {row['steps']:,} steps "
        f"{row['wall_s']:.0f} s | {hits} | train {row['train_return']:.0f} "
        f"eval {row['eval_return']:.0f} | sparsity {row['sparsity'][0]:.2f}/"
        f"{row['sparsity'][1]:.2f}, {row['params']:,} params, inference FLOPs "
        f"{row['inference_flops']:.3f}, training FLOPs {row['train_flops']:.3f} of dense",
        flush=True,
    )


def plot(result: dict[str, Any], path: Path) -> None:
    plot_curves(
        result["curves"],
        path,
        xlabel="agent steps",
        ylabel="mean training return (last 100 episodes)",
        title=f"{result['env']} {result['algo']}: {', '.join(result['variants'])}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="Pendulum-v1")
    parser.add_argument("--algos", default="sac,td3")
    parser.add_argument("--variants", default="dense,rigl")
    parser.add_argument("--actor", type=float, default=0.9, help="actor sparsity")
    parser.add_argument("--critic", type=float, default=0.85, help="critic sparsity")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--max-steps", type=int, default=30_000)
    parser.add_argument(
        "--thresholds", type=float, nargs="*", default=[-250.0], help="none: no early stop"
    )
    parser.add_argument("--scale", action="store_true", help="scale RLx2's schedules to the run")
    parser.add_argument(
        "--paper-steps",
        type=int,
        default=None,
        help="scale RLx2's schedules and buffer bounds by --max-steps / this (one factor)",
    )
    parser.add_argument("--checkpoint-s", type=float, default=300.0)
    parser.add_argument("--json", type=Path, default=None, help="write the comparison here")
    parser.add_argument("--arch", default="local")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one process each)")
    parser.add_argument("--logdir", default="runs/bench-offpolicy")
    parser.add_argument(
        "--train",
        nargs="+",
        default=None,
        metavar="VARIANT:SEED",
        help="train only these of the missing runs now (default: every missing run); "
        "give spec overrides before it",
    )
    parser.add_argument("overrides", nargs="*", help="dotted spec overrides for every run")
    args = parser.parse_args()
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}; allowed: {', '.join(VARIANTS)}")
    if args.scale and args.paper_steps:
        parser.error("--scale and --paper-steps are two ways to scale; give one")
    if args.json and "," in args.algos:
        parser.error("--json writes one algorithm's comparison; give one in --algos")
    threads = 1 if args.jobs > 1 else 2
    rows_dir = args.json.with_name(f"{args.json.stem}_rows") if args.json else None
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
                        "checkpoint_s": args.checkpoint_s,
                        "rows": rows_dir,
                        "overrides": [
                            *variant_overrides(variant, algo, args, updates),
                            *args.overrides,
                        ],
                    }
                )
    scaling = (
        f"x{args.max_steps / args.paper_steps:g} of the paper's" if args.paper_steps else args.scale
    )
    print(
        f"{args.env}, arch {args.arch}, at most {args.max_steps:,} agent steps, sparsity "
        f"actor {args.actor} / critic {args.critic}, scaled schedules: {scaling}, "
        f"{args.jobs} run(s) at once, {threads} torch thread(s) each",
        flush=True,
    )
    wanted = None if args.train is None else set(args.train)
    if wanted is not None:
        unknown = wanted - {f"{job['variant']}:{job['seed']}" for job in jobs}
        if unknown:
            parser.error(f"--train names runs not in --variants x --seeds: {sorted(unknown)}")
    rows, missing, to_train = [], [], []
    for job in jobs:
        row = saved_row(job)
        if row is not None:
            rows.append(row)
            report(row)
        elif wanted is None or f"{job['variant']}:{job['seed']}" in wanted:
            to_train.append(job)
        else:
            missing.append(run_name(job))
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for row in pool.map(run_one, to_train):
            rows.append(row)
            report(row)
    print(
        f"\n{'algo':>4} {'variant':>14} {'eval mean':>10} {'eval sd':>8} {'% dense':>8} "
        f"{'params':>9} {'infer FLOPs':>12} {'train FLOPs':>12}"
    )
    for algo in args.algos.split(","):
        dense = [r["eval_return"] for r in rows if r["algo"] == algo and r["variant"] == "dense"]
        for variant in args.variants.split(","):
            mine = [r for r in rows if r["algo"] == algo and r["variant"] == variant]
            if not mine:
                continue
            evals = [r["eval_return"] for r in mine]
            mean = statistics.mean(evals)
            sd = statistics.stdev(evals) if len(evals) > 1 else 0.0
            pct = (
                f"{100 * mean / statistics.mean(dense):.1f}"
                if dense and statistics.mean(dense) > 0
                else "-"
            )
            print(
                f"{algo:>4} {variant:>14} {mean:>10.1f} {sd:>8.1f} {pct:>8} "
                f"{mine[0]['params']:>9,} {mine[0]['inference_flops']:>12.3f} "
                f"{mine[0]['train_flops']:>12.3f}"
            )

    if missing:
        print(f"\nnot trained yet: {', '.join(missing)}")
    if args.json:
        result = comparison(rows, missing, args)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, args.json.with_suffix(".png"))
        print(f"\nwrote {args.json} and {args.json.with_suffix('.png')}")


if __name__ == "__main__":
    main()
