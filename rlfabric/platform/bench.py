"""`rlfabric bench`: one spec under several architectures, side by side, same machine.

Runs the spec once per (architecture, algorithm), one after another, and
prints a table of env frames/s, time and frames to a return threshold, mean
inference batch, policy lag and each role's CPU share; writes `bench.json`
and `bench.png` (return against wall time and against env frames).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from rlfabric.platform.facade import Platform
from rlfabric.platform.reporting import read_records
from rlfabric.platform.spec import ExperimentSpec, apply_overrides


def example_spec(env_id: str, arch: str, algo: str, folder: Path) -> Path | None:
    """`examples/specs/<env>_<arch>_<algo>.yaml` (e.g. cartpole_ga3c_a3c.yaml), if it exists.

    Per-env settings live in those YAML files, not in code: without a spec of
    its own, a bench run starts from the example tuned for its pair.
    """
    env = env_id.split("/")[-1].split("-")[0].lower()
    path = folder / f"{env}_{arch}_{algo}.yaml"
    return path if path.is_file() else None


def plan_bench(
    base: dict[str, Any] | None,
    env_id: str,
    archs: list[str],
    algos: list[str],
    frames: int,
    outdir: Path,
    overrides: list[str],
    examples: Path = Path("examples/specs"),
) -> list[ExperimentSpec]:
    """One validated spec per (algo, arch): every bad input fails before any run starts.

    With `base` None, each pair starts from its example spec where there is one.
    """
    specs = []
    for algo in algos:
        for arch in archs:
            start = base
            if start is None:
                example = example_spec(env_id, arch, algo, examples)
                start = yaml.safe_load(example.read_text()) if example else {}
            data = apply_overrides(start, [f"env.id={env_id}", *overrides])
            algo_section = data.get("algo") if isinstance(data.get("algo"), dict) else {}
            if algo_section.get("name", algo) != algo:
                algo_section = {}  # the base spec's fields belong to another algorithm
            arch_section = data.get("arch") if isinstance(data.get("arch"), dict) else {}
            if arch_section.get("name", arch) != arch:
                arch_section = {}
            run = data.get("run") if isinstance(data.get("run"), dict) else {}
            data.update(
                algo={**algo_section, "name": algo},
                arch={**arch_section, "name": arch},
                run={
                    **run,
                    "stop": {"env_frames": frames},
                    "logdir": str(outdir),
                    "name": f"{arch}_{algo}",
                    "display": "plain",
                    "checkpoint_interval_s": 0,
                },
            )
            specs.append(ExperimentSpec.build(data))
    return specs


def run_bench(
    specs: list[ExperimentSpec], threshold: float | None, outdir: Path
) -> list[dict[str, Any]]:
    """Fit each spec in turn; write bench.json and bench.png; return one row per run."""
    outdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in specs:
        result = Platform(spec).fit()
        rows.append(_row(spec.arch.name, spec.algo.name, result.logdir, threshold, spec))
    (outdir / "bench.json").write_text(json.dumps(rows, indent=2))
    _plot(rows, outdir / "bench.png")
    return rows


def _row(
    arch: str, algo: str, logdir: str, threshold: float | None, spec: ExperimentSpec
) -> dict[str, Any]:
    records = read_records(Path(logdir) / "metrics.jsonl")
    steady = records[len(records) // 3 :] or records
    last = records[-1]

    def mean(key: str) -> float | None:
        values = [r[key] for r in steady if key in r]
        return float(np.mean(values)) if values else None

    reached = next(
        (
            r
            for r in records
            if threshold is not None
            and r.get("episode_return_mean", -np.inf) >= threshold
            and r.get("episodes", 0) >= spec.run.return_window
        ),
        None,
    )
    wall, cpus = last["wall_time_s"], os.cpu_count() or 1
    return {
        "arch": arch,
        "algo": algo,
        "env": spec.env.id,
        "env_frames": last["env_frames"],
        "wall_time_s": wall,
        "env_frames_per_s": last["env_frames"] / wall,
        "final_return": last.get("episode_return_mean"),
        "threshold": threshold,
        "return_window": spec.run.return_window,
        "time_to_threshold_s": reached["wall_time_s"] if reached else None,
        "frames_to_threshold": reached["env_frames"] if reached else None,
        "inference_batch_envs": mean("inference_batch_envs"),
        "policy_lag": mean("policy_lag"),
        "learner_cpu_share": last.get("learner_cpu_s", 0.0) / (wall * cpus),
        "runners_cpu_share": last.get("runners_cpu_s", 0.0) / (wall * cpus),
        "curve": [
            (r["wall_time_s"], r["env_frames"], r["episode_return_mean"])
            for r in records
            if "episode_return_mean" in r
        ],
        "logdir": logdir,
    }


def format_table(rows: list[dict]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"{'arch':<8}{'algo':<8}{'frames/s':>10}{'frames':>11}{'return':>8}"
        f"{'t to thr s':>11}{'fr to thr':>11}{'inf batch':>10}{'lag':>7}"
        f"{'CPU learner':>12}{'CPU runners':>12}"
    ]
    for r in rows:
        lines.append(
            f"{r['arch']:<8}{r['algo']:<8}{r['env_frames_per_s']:>10,.0f}{r['env_frames']:>11,}"
            f"{fmt(r['final_return'], '.1f'):>8}{fmt(r['time_to_threshold_s'], '.1f'):>11}"
            f"{fmt(r['frames_to_threshold'], ','):>11}{fmt(r['inference_batch_envs'], '.1f'):>10}"
            f"{fmt(r['policy_lag'], '.1f'):>7}{r['learner_cpu_share']:>12.0%}"
            f"{r['runners_cpu_share']:>12.0%}"
        )
    threshold = rows[0]["threshold"] if rows else None
    window = rows[0]["return_window"] if rows else 100
    lines.append(
        f"(thr: {window}-episode mean return {threshold}; CPU shares of all "
        f"{os.cpu_count()} cores over the run)"
    )
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    by_time, by_frames = fig.subplots(1, 2)
    for r in rows:
        if not r["curve"]:
            continue
        wall, frames, ret = zip(*r["curve"])
        label = f"{r['arch']} + {r['algo']}"
        by_time.plot(wall, ret, label=label)
        by_frames.plot(frames, ret, label=label)
    by_time.set_xlabel("wall time s")
    by_frames.set_xlabel("env frames")
    for ax in (by_time, by_frames):
        ax.set_ylabel(f"mean return (last {rows[0]['return_window']} episodes)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    env = rows[0]["env"] if rows else ""
    fig.suptitle(f"rlfabric bench: {env}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
