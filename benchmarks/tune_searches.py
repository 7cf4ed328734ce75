"""Searches on Ray Tune, measured as a user runs them: `rlfabric tune` and `rlfabric train`
as whole processes, one after another, on an otherwise idle machine.

- asha: names-only SEED + V-trace on CartPole-v1, 8 trials over `algo.lr` and
  `algo.entropy_cost` under ASHA (4 at a time), then the same 8 values with
  `rlfabric train` in a loop, each run to its end; both wall times side by side.
- pbt: names-only SEED + V-trace on Acrobot-v1, 4 trials over `algo.lr` and
  `algo.entropy_cost` under PBT, then the same 4 starting values (the same
  `tune.seed`) without PBT (FIFO); the population's best and each trial's exploits.
- arch: names-only V-trace on CartPole-v1 with the topology searched
  (`arch.name`), one trial at a time: the topologies side by side.

Every run stops at its frame budget or at the return target. Each case prints its
table and, with `--out DIR`, writes `tune_<case>.json` and the search's `trials.png`
as `tune_<case>.png` there.

    python benchmarks/tune_searches.py asha pbt arch --out benchmarks/results
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import yaml

from rlfabric.models.config import native_bf16
from rlfabric.platform.reporting import read_records

CASES: dict[str, dict[str, Any]] = {
    "asha": {
        "arch": "seed",
        "algo": "vtrace",
        "env": "CartPole-v1",
        "run": {"stop": {"env_frames": 500_000, "episode_return_mean": 475.0}},
        "tune": {
            "num_samples": 8,
            "seed": 0,
            "max_concurrent_trials": 4,
            "scheduler": {"name": "asha", "grace_frames": 50_000},
            "search": {
                "algo.lr": {"loguniform": [1.0e-4, 1.0e-2]},
                "algo.entropy_cost": {"choice": [0.0, 0.01]},
            },
        },
    },
    "pbt": {
        "arch": "seed",
        "algo": "vtrace",
        "env": "Acrobot-v1",
        "run": {"stop": {"env_frames": 400_000}},
        "tune": {
            "num_samples": 4,
            "seed": 0,
            "scheduler": {"name": "pbt", "perturbation_frames": 50_000},
            "search": {
                "algo.lr": {"loguniform": [1.0e-4, 1.0e-2]},
                "algo.entropy_cost": {"uniform": [0.0, 0.02]},
            },
        },
    },
    "arch": {
        "algo": "vtrace",
        "env": "CartPole-v1",
        "run": {"stop": {"env_frames": 500_000, "episode_return_mean": 475.0}},
        "tune": {
            "max_concurrent_trials": 1,
            "scheduler": {"name": "fifo"},
            "search": {"arch.name": {"grid": ["local", "seed", "impala", "ga3c"]}},
        },
    },
}


def rlfabric(*args: str) -> float:
    """Run the `rlfabric` command to its end; its wall time (the whole process)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rlfabric.platform.cli", *args], check=True)
    return time.perf_counter() - start


def search(name: str, spec: dict[str, Any], logdir: Path) -> tuple[float, list[dict[str, Any]]]:
    """`rlfabric tune` on `spec` as run `name`; its wall time and trials.csv rows."""
    path = logdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**spec, "run": {**spec["run"], "logdir": str(logdir)}}))
    wall = rlfabric("tune", str(path), f"run.name={name}")
    with (logdir / name / "trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        lineage = read_records(logdir / name / row["trial"] / "lineage.jsonl")
        row["start_values"] = lineage[0]["config"] if lineage else None
    return wall, rows


def case_asha(logdir: Path) -> dict[str, Any]:
    spec = CASES["asha"]
    wall, rows = search("asha", spec, logdir)
    base = {k: v for k, v in spec.items() if k != "tune"}
    base["run"] = {**base["run"], "logdir": str(logdir), "display": "plain"}
    (logdir / "train.yaml").write_text(yaml.safe_dump(base))
    loop = []
    for i, row in enumerate(rows):
        values = [f"{k}={row[k]}" for k in spec["tune"]["search"]]
        seconds = rlfabric("train", str(logdir / "train.yaml"), *values, f"run.name=loop{i}")
        last = read_records(logdir / f"loop{i}" / "metrics.jsonl")[-1]
        loop.append(
            {
                "values": values,
                "wall_s": round(seconds, 1),
                "env_frames": last["env_frames"],
                "final": last.get("episode_return_mean"),
            }
        )
    loop_wall = sum(r["wall_s"] for r in loop)
    print(f"\nASHA search: {wall:.1f} s for 8 trials; the same values in a loop: {loop_wall:.1f} s")
    print(f"{'values':<48} {'ASHA final':>10} {'status':<40} {'loop final':>10} {'loop s':>7}")
    for row, seq in zip(rows, loop):
        print(
            f"{' '.join(seq['values']):<48} {row['final'] or '-':>10} {row['status'][:40]:<40} "
            f"{seq['final'] if seq['final'] is not None else '-':>10} {seq['wall_s']:>7}"
        )
    best = max(float(r["final"]) for r in rows if r["final"])
    return {
        "search_wall_s": round(wall, 1),
        "loop_wall_s": round(loop_wall, 1),
        "speedup": round(loop_wall / wall, 2),
        "best_final": best,
        "trials": rows,
        "loop": loop,
    }


def case_pbt(logdir: Path) -> dict[str, Any]:
    spec = CASES["pbt"]
    wall, rows = search("pbt", spec, logdir)
    fifo_spec = {**spec, "tune": {**spec["tune"], "scheduler": {"name": "fifo"}}}
    fifo_wall, fifo_rows = search("fifo", fifo_spec, logdir)
    same_start = sorted(map(json.dumps, (r["start_values"] for r in rows))) == sorted(
        map(json.dumps, (r["start_values"] for r in fifo_rows))
    )

    def best(trials: list[dict[str, Any]]) -> float:
        return max(float(r["final"]) for r in trials if r["final"])

    exploits = sum(int(r["exploits"]) for r in rows)
    print(
        f"\nPBT: best {best(rows):.1f} ({exploits} exploits, {wall:.0f} s); "
        f"the same 4 starting values without PBT: best {best(fifo_rows):.1f} ({fifo_wall:.0f} s); "
        f"same starting values: {same_start}"
    )
    return {
        "pbt_best_final": best(rows),
        "fifo_best_final": best(fifo_rows),
        "exploits": exploits,
        "same_starting_values": same_start,
        "pbt_wall_s": round(wall, 1),
        "fifo_wall_s": round(fifo_wall, 1),
        "pbt_trials": rows,
        "fifo_trials": fifo_rows,
    }


def case_arch(logdir: Path) -> dict[str, Any]:
    wall, rows = search("arch", CASES["arch"], logdir)
    print(f"\ntopologies searched, one at a time: {wall:.0f} s")
    for row in rows:
        print(
            f"{row['arch.name']:<7} final {row['final']:>6}  frames {row['env_frames']:>8}  "
            f"run {float(row['wall_time_s']):.1f} s  {row['status']}"
        )
    return {"search_wall_s": round(wall, 1), "trials": rows}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    parser.add_argument("--out", type=Path, help="folder for tune_<case>.json and .png")
    parser.add_argument("--logdir", type=Path, help="run folders (default: a temporary one)")
    parser.add_argument(
        "--frames",
        type=int,
        help="a smaller frame budget per trial (scheduler periods a tenth of it), for a "
        "smoke check; results then are not the benchmark's",
    )
    args = parser.parse_args()
    if args.frames:
        for spec in CASES.values():
            spec["run"]["stop"]["env_frames"] = args.frames
            scheduler = spec["tune"]["scheduler"]
            for period in ("grace_frames", "perturbation_frames"):
                if period in scheduler:
                    scheduler[period] = args.frames // 10
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="rlfabric-tune-"))
    logdir.mkdir(parents=True, exist_ok=True)
    run = {"asha": case_asha, "pbt": case_pbt, "arch": case_arch}
    for case in args.cases:
        result = run[case](logdir)
        if args.out is None:
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(logdir / case / "trials.png", args.out / f"tune_{case}.png")
        record = {
            "case": case,
            "command": f"python benchmarks/tune_searches.py {case} --out {args.out}",
            "spec": CASES[case],
            "date": date.today().isoformat(),
            "machine": {
                "cpu": cpu_model(),
                "cpus": os.cpu_count(),
                "native_bf16": native_bf16("cpu"),
            },
            **result,
        }
        (args.out / f"tune_{case}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out / f'tune_{case}.json'}")


if __name__ == "__main__":
    main()
