"""Pong at 10M frames under every topology: one JSON and one plot from the runs' results.

Reads the per-run results `benchmarks/reproduce.py` wrote (`benchmarks/results/pong_*.json`),
takes each curve at 10M env frames (the last point at or before 10.1M), and writes
`atari_pong_10m.json`:

    {"runs": {"<arch>_<algo>[_<variant>]": {"final_return", "env_frames", "frames_to_18",
              "wall_time_s", "frames_per_s", "sticky_actions", "cpu_bf16", "spec",
              "result"}}, "published": [...]}

and `atari_pong_10m.png`: every run's curve to 10M frames, with the published figures
at 10M (REFERENCES.md) as markers. A run longer than 10M frames has its wall time at
10M estimated from its average frames/s. Results written before `reproduce.py` recorded
the CPU's bf16 flag and the resolved spec ran on this project's reference machine (2
cores, AVX512-BF16 and AMX; docs/experiments/atari-pong.md); their spec is rebuilt from the
reproduction's definition.

    python benchmarks/atari_pong.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml
from reproduce import REPRODUCTIONS, RESULTS, SPECS

from rlfabric.platform.spec import ExperimentSpec

BUDGET = 10_000_000
#: A curve point within this much past the budget still counts as "at 10M".
SLACK = 100_000

#: run name -> (result file, what it is). Names-only rows are what a user gets by name.
RUNS = {
    "seed_vtrace": ("pong_seed_vtrace_fixed", "names only: the vtrace/atari preset"),
    "seed_vtrace_seed1": (
        "pong_seed_vtrace_seed1",
        "names only: the vtrace/atari preset, seed 1",
    ),
    "seed_vtrace_target": (
        "pong_seed_vtrace_target10m",
        "names only + algo.pg_clip_target (the clip centred on the learner's policy)",
    ),
    "impala_vtrace": ("pong_impala_vtrace_preset", "names only: the vtrace/atari preset"),
    "ga3c_a3c": ("pong_ga3c_a3c_preset", "names only: the a3c/atari preset"),
    "seed_ppo_cleanrl": ("pong_seed_ppo", "SEED with CleanRL ppo_atari.py's settings"),
    "local_ppo_cleanrl": (
        "pong_local_ppo_cleanrl_sticky",
        "examples/specs/pong_local_ppo_cleanrl.yaml with sticky actions: no policy lag",
    ),
    "local_ppo_cleanrl_nosticky": (
        "pong_local_ppo_cleanrl",
        "examples/specs/pong_local_ppo_cleanrl.yaml: CleanRL's exact setup, no sticky actions",
    ),
    "local_a3c_a2c_nosticky": (
        "pong_local_a3c_a2c",
        "examples/specs/pong_local_a3c_a2c.yaml: OpenAI baselines' A2C setup, no sticky actions",
    ),
    "seed_vtrace_paper": ("pong_seed_vtrace", "examples/specs/pong_seed_vtrace.yaml"),
    "impala_vtrace_paper": ("pong_impala_vtrace", "examples/specs/pong_impala_vtrace.yaml"),
    "ga3c_a3c_paper": ("pong_ga3c_a3c", "examples/specs/pong_ga3c_a3c.yaml"),
}

#: Published returns at 10M frames (REFERENCES.md, read from curves where approximate).
PUBLISHED = [
    {"label": "CleanRL ppo_atari, no sticky", "return": 16.5, "sticky_actions": False},
    {"label": "CleanRL envpool PPO, no sticky", "return": 19.0, "sticky_actions": False},
    {"label": "Cleanba IMPALA/PPO, sticky (low)", "return": 10.0, "sticky_actions": True},
    {"label": "Cleanba IMPALA/PPO, sticky (high)", "return": 12.0, "sticky_actions": True},
    {"label": "baselines A2C, no sticky", "return": -12.0, "sticky_actions": False},
    {"label": "moolib, sticky", "return": 0.0, "sticky_actions": True},
]


def rebuilt_spec(name: str, result: dict[str, Any]) -> ExperimentSpec:
    """The run's resolved spec: recorded in the result, else rebuilt from its reproduction."""
    if result.get("spec"):
        return ExperimentSpec.build(yaml.safe_load(result["spec"]))
    repro = REPRODUCTIONS[name]
    overrides = list(result.get("overrides") or [])
    if isinstance(repro.spec, str):
        return ExperimentSpec.from_yaml(SPECS / repro.spec, overrides)
    return ExperimentSpec.build(dict(repro.spec), overrides)


def at_budget(name: str, what: str, result: dict[str, Any]) -> dict[str, Any]:
    """A run's figures at 10M frames."""
    curve = next(iter(result["curves"].values()))
    inside = [p for p in curve if p[0] <= BUDGET + SLACK]
    frames, final = inside[-1]
    frames_per_s = result["env_frames"] / result["wall_time_s"]
    spec = rebuilt_spec(name, result)
    to_18 = result.get("frames_to_18")
    return {
        "what": what,
        "final_return": round(final, 2),
        "env_frames": int(frames),
        "frames_to_18": to_18 if to_18 is not None and to_18 <= frames else None,
        "wall_time_s": round(
            result["wall_time_s"] if frames == result["env_frames"] else frames / frames_per_s,
            1,
        ),
        "frames_per_s": round(frames_per_s),
        "sticky_actions": spec.env.atari.repeat_action_probability > 0,
        "cpu_bf16": result.get("cpu_bf16", True),
        "spec": spec.to_yaml(),
        "result": f"benchmarks/results/{name}.json",
        "curve": [p for p in curve if p[0] <= BUDGET + SLACK],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    runs = {}
    for key, (name, what) in RUNS.items():
        path = args.results / f"{name}.json"
        if not path.is_file():
            print(f"{key}: {path} not there yet, left out")
            continue
        runs[key] = at_budget(name, what, json.loads(path.read_text()))
    plot_runs(runs, args.results / "atari_pong_10m.png")
    record = {
        "runs": {k: {f: v for f, v in r.items() if f != "curve"} for k, r in runs.items()},
        "published": PUBLISHED,
    }
    (args.results / "atari_pong_10m.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{'run':<28} {'return':>7} {'frames':>11} {'min':>5} {'frames/s':>8} sticky")
    for key, run in runs.items():
        print(
            f"{key:<28} {run['final_return']:>7.2f} {run['env_frames']:>11,} "
            f"{run['wall_time_s'] / 60:>5.0f} {run['frames_per_s']:>8,} {run['sticky_actions']}"
        )


def plot_runs(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Every run's curve to 10M frames; the published figures as markers at 10M."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.8))
    ax = fig.subplots()
    for index, (key, run) in enumerate(runs.items()):
        style = "-" if index < 10 else "--"  # more runs than colours: dashed
        ax.plot(*zip(*run["curve"]), label=key, color=f"C{index % 10}", linestyle=style)
    for ref in PUBLISHED:
        ax.plot(
            BUDGET,
            ref["return"],
            marker="o" if ref["sticky_actions"] else "x",
            markersize=7,
            color="black",
        )
        ax.annotate(
            ref["label"],
            (BUDGET, ref["return"]),
            fontsize=6,
            xytext=(-150, 2),
            textcoords="offset points",
        )
    ax.set_xlabel("env frames")
    ax.set_ylabel("mean return (last 100 episodes)")
    ax.set_title(
        "ALE/Pong-v5 to 10M frames; published at 10M: o sticky actions, x none", fontsize=10
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
