"""Names-only runs must learn: every (env, arch, algo) with nothing but its names.

Each run is `Platform(env=..., arch=..., algo=...)` plus only the stop conditions
and the seed, so every other value comes from the preset for the pair (or the
algorithm's defaults). Wall time includes Ray's start. Each row is the median
over --seeds seeds; a row misses when the median run misses the return target
within the budget (a run that never reaches it counts as infinitely slow), or its
median wall time is over the row's limit. The whole table prints at the end, and
the exit status is 1 if a row missed.

    python benchmarks/defaults.py                                  # the whole matrix
    python benchmarks/defaults.py --envs CartPole-v1 --archs seed --algos vtrace --seeds 1
    python benchmarks/defaults.py --envs CartPole-v1 --algos vtrace,a3c,ppo \
        --json benchmarks/results/defaults_cartpole.json             # the names-only matrix:
    python benchmarks/defaults.py --envs Pendulum-v1 --algos sac,td3 \
        --json benchmarks/results/defaults_pendulum_offpolicy.json   # its two envs

`--set section.field=value ...` applies overrides on top of the names, for ablations
(what a preset value buys); such rows are no names-only rows, and say so (`+set`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlfabric import Platform
from rlfabric.architectures import ARCHITECTURES


@dataclass(frozen=True)
class Target:
    """What names-only runs of one env must reach, and within what."""

    env: str
    algos: tuple[str, ...]
    archs: tuple[str, ...]
    return_mean: float | None  # None: report what the budget reaches, no pass/fail
    window: int  # episodes in the mean (run.return_window)
    env_frames: int  # budget
    wall_s: dict[tuple[str, str], float] = field(default_factory=dict)  # (arch, algo) -> limit


ON_POLICY = ("vtrace", "a3c", "ppo")
OFF_POLICY = ("sac", "td3")
ALL_ARCHS = tuple(ARCHITECTURES)

#: The names-only acceptance matrix: every classic-control id, and a short look at
#: the Atari and MuJoCo presets (their learning runs are benchmarks/reproduce.py's).
TARGETS = [
    Target("CartPole-v1", ON_POLICY, ALL_ARCHS, 475.0, 100, 1_000_000, {("seed", "vtrace"): 20.0}),
    Target("Acrobot-v1", ON_POLICY, ALL_ARCHS, -100.0, 100, 1_000_000),
    # frameskip 1: env frames are agent steps.
    Target("Pendulum-v1", OFF_POLICY, ALL_ARCHS, -200.0, 10, 15_000, {("seed", "sac"): 45.0}),
    Target("Pendulum-v1", ON_POLICY, ALL_ARCHS, -200.0, 10, 1_000_000),
    Target("MountainCarContinuous-v0", OFF_POLICY, ALL_ARCHS, 90.0, 10, 50_000),
    Target("MountainCarContinuous-v0", ON_POLICY, ALL_ARCHS, 90.0, 10, 1_000_000),
    Target("MountainCar-v0", ON_POLICY, ALL_ARCHS, -110.0, 100, 2_000_000),
    Target("ALE/Pong-v5", ON_POLICY, ("seed",), None, 10, 200_000),
    Target("HalfCheetah-v5", OFF_POLICY, ("seed",), None, 10, 20_000),
    Target("HalfCheetah-v5", ON_POLICY, ("seed",), None, 10, 300_000),
]


@dataclass
class Run:
    frames: float  # env frames when the target was first reached; inf if never
    wall_s: float  # Ray start included
    final_return: float
    preset: str


def run_one(
    env: str,
    arch: str,
    algo: str,
    target: Target,
    seed: int,
    logdir: str,
    overrides: list[str] | None = None,
) -> Run:
    start = time.perf_counter()
    platform = Platform(
        overrides=overrides,
        env=env,
        arch=arch,
        algo=algo,
        run={
            "seed": seed,
            "return_window": target.window,
            "stop": {"episode_return_mean": target.return_mean, "env_frames": target.env_frames},
            "display": "none",
            "checkpoint_interval_s": 0,
            "logdir": logdir,
        },
    )
    result = platform.fit()
    wall = time.perf_counter() - start
    hit = result.target.env_frames if result.target else None
    final = result.final_return_mean
    return Run(
        frames=float(hit) if hit is not None else float("inf"),
        wall_s=wall,
        final_return=final if final is not None else float("nan"),
        preset=platform.spec.preset + ("+set" if overrides else ""),
    )


def row(env: str, arch: str, algo: str, target: Target, runs: list[Run]) -> dict:
    frames = statistics.median(r.frames for r in runs)
    wall = statistics.median(r.wall_s for r in runs)
    limit = target.wall_s.get((arch, algo))
    reached = target.return_mean is None or frames <= target.env_frames
    ok = reached and (limit is None or wall <= limit)
    return {
        "env": env,
        "arch": arch,
        "algo": algo,
        "preset": runs[0].preset,
        "reached": f"{sum(r.frames < float('inf') for r in runs)}/{len(runs)}",
        "frames": frames,
        "wall_s": wall,
        "limit": limit,
        "final": statistics.median(r.final_return for r in runs),
        "target": target.return_mean,
        "ok": ok,
        "runs": [asdict(r) for r in runs],
    }


def finite(value: object) -> object:
    """`value` with every infinite float (a missed target) as None: JSON has no inf."""
    if isinstance(value, float) and math.isinf(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def format_table(rows: list[dict]) -> str:
    pw = max([15] + [len(r["preset"]) for r in rows])  # "+set" rows run longer
    head = (
        f"{'env':<24} {'arch':<7} {'algo':<7} {'preset':<{pw}} {'reached':>7} "
        f"{'frames to target':>16} {'wall s':>7} {'final':>8} {'target':>7}  ok"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        frames = "missed" if r["frames"] == float("inf") else f"{r['frames']:,.0f}"
        if r["target"] is None:
            frames = "(no target)"
        wall = f"{r['wall_s']:.1f}" + (f"/{r['limit']:.0f}" if r["limit"] else "")
        lines.append(
            f"{r['env']:<24} {r['arch']:<7} {r['algo']:<7} {r['preset']:<{pw}} "
            f"{r['reached']:>7} {frames:>16} {wall:>7} {r['final']:>8.1f} "
            f"{'-' if r['target'] is None else format(r['target'], '.0f'):>7}  "
            f"{'yes' if r['ok'] else 'NO'}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--envs",
        default=",".join(dict.fromkeys(t.env for t in TARGETS)),
        help="comma-separated env ids",
    )
    parser.add_argument("--archs", help="comma-separated subset (default: each env's)")
    parser.add_argument("--algos", help="comma-separated subset (default: each env's)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per row")
    parser.add_argument("--logdir", default="runs/defaults")
    parser.add_argument("--json", type=Path, help="also write the rows, each seed's run in each")
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides (ablations)"
    )
    args = parser.parse_args()
    rows = []
    envs = args.envs.split(",")
    unknown = set(envs) - {t.env for t in TARGETS}
    if unknown:
        parser.error(f"no targets for {sorted(unknown)}; known: {sorted({t.env for t in TARGETS})}")
    for target in (t for env in envs for t in TARGETS if t.env == env):
        env = target.env
        archs = [a for a in target.archs if not args.archs or a in args.archs.split(",")]
        algos = [a for a in target.algos if not args.algos or a in args.algos.split(",")]
        for algo in algos:
            for arch in archs:
                runs = []
                for seed in range(args.seeds):
                    runs.append(run_one(env, arch, algo, target, seed, args.logdir, args.set))
                    r = runs[-1]
                    print(
                        f"{env} {arch} {algo} seed {seed}: frames to target {r.frames:,.0f}, "
                        f"{r.wall_s:.1f} s, final {r.final_return:.1f} ({r.preset})",
                        flush=True,
                    )
                rows.append(row(env, arch, algo, target, runs))
    print()
    print(format_table(rows))
    missed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(missed)}/{len(rows)} rows reached their targets")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/defaults.py " + " ".join(sys.argv[1:])
        args.json.write_text(json.dumps({"command": command, "rows": finite(rows)}, indent=1))
        print(f"wrote {args.json}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
