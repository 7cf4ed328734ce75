"""The papers' headline runs, resumable: Atari Pong with each topology, SAC and TD3 on MuJoCo.

Each reproduction trains one or more seeds in `--logdir/<name>-s<seed>/` and
checkpoints every `--checkpoint-s` seconds. Run the same command again after
an interruption (a session that ended, Ctrl-C, a reboot): a seed whose run
folder holds a checkpoint resumes from it at its frame count, and a seed
whose run already reached its budget is only read back. When every seed is
done, the script writes `benchmarks/results/<name>.json` and `<name>.png`
(the return curves of all seeds on one plot) and prints the result. Each
finished seed's figures and curve are also kept in
`benchmarks/results/<name>_rows/s<seed>.json` (commit them): a later run with the
same budget and overrides reads a kept seed back instead of training it, so the
seeds of one result may come from different sessions. `--jobs 2` trains two seeds
at once, each in its own process.

    python benchmarks/reproduce.py pong_seed_vtrace              # 20M frames, +18 target
    python benchmarks/reproduce.py pong_seed_vtrace_preset       # the same, names only
    python benchmarks/reproduce.py pong_impala_vtrace pong_ga3c_a3c
    python benchmarks/reproduce.py pong_impala_vtrace_preset     # 10M frames, names only
    python benchmarks/reproduce.py pong_ga3c_vtrace_preset       # the same under GA3C
    python benchmarks/reproduce.py halfcheetah_sac --seeds 0 1 --jobs 2  # 300k steps, eval >= 5000
    python benchmarks/reproduce.py hopper_td3 --seeds 0 1
    python benchmarks/reproduce.py --list
    python benchmarks/reproduce.py --progress RUN_DIR [RUN_DIR ...]  # any runs, also unfinished
    python benchmarks/reproduce.py --compare benchmarks/results/pong_*.json --out pong.png
    python benchmarks/reproduce.py --record RUN_DIR --name NAME --reference TEXT  # any Atari run

Pong (`ALE/Pong-v5`, sticky actions, frameskip 4) reports the 100-episode mean
return at the end (`final_return`), the env frames, and the first env frame
count at which the mean reached +18 (`frames_to_18`, null if never). MuJoCo
reports a greedy evaluation of the final policy on 10 fresh episodes per seed
(`per_seed`, `eval_return_mean` over seeds) at `agent_steps`, beside CleanRL's
published 1M-step figure for the same task.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from rlfabric import Platform
from rlfabric.models.config import native_bf16
from rlfabric.platform.evaluate import evaluate, load_policy
from rlfabric.platform.facade import TargetHit
from rlfabric.platform.reporting import read_records

RESULTS = Path(__file__).parent / "results"
SPECS = Path(__file__).parent.parent / "examples" / "specs"


@dataclass(frozen=True)
class Reproduction:
    """One headline run: the spec, its budget in env frames, and what the paper reached."""

    spec: dict[str, Any] | str  # keyword sections, or an example spec file name
    env_frames: int
    kind: str  # "atari": 100-episode training mean; "mujoco": greedy evaluation
    target: float | None  # None: reported beside the reference, no pass/fail
    reference: str
    overrides: list[str] = field(default_factory=list)


REPRODUCTIONS: dict[str, Reproduction] = {
    "pong_seed_vtrace": Reproduction(
        "pong_seed_vtrace.yaml", 20_000_000, "atari", 18.0, "target: +18 within 20M frames"
    ),
    "pong_seed_vtrace_preset": Reproduction(
        {"arch": "seed", "algo": "vtrace", "env": "ALE/Pong-v5"},
        20_000_000,
        "atari",
        18.0,
        "target: +18 within 20M frames (names only: the vtrace/atari preset)",
    ),
    "pong_impala_vtrace_preset": Reproduction(
        {"arch": "impala", "algo": "vtrace", "env": "ALE/Pong-v5"},
        10_000_000,
        "atari",
        18.0,
        "target: +18 within 10M frames (names only: the vtrace/atari preset)",
    ),
    "pong_ga3c_a3c_preset": Reproduction(
        {"arch": "ga3c", "algo": "a3c", "env": "ALE/Pong-v5"},
        10_000_000,
        "atari",
        18.0,
        "target: +18 within 10M frames (names only: the a3c/atari preset)",
    ),
    "pong_ga3c_vtrace_preset": Reproduction(
        {"arch": "ga3c", "algo": "vtrace", "env": "ALE/Pong-v5"},
        10_000_000,
        "atari",
        8.0,
        "target: +8 within 10M frames (names only: the vtrace/atari preset under GA3C)",
    ),
    "pong_seed_ppo": Reproduction(
        "pong_seed_ppo.yaml",
        20_000_000,
        "atari",
        None,
        "SEED + PPO in CleanRL ppo_atari.py's settings, sticky actions: +9.3 at 10M here",
    ),
    "pong_impala_vtrace": Reproduction(
        "pong_impala_vtrace.yaml", 10_000_000, "atari", None, "RLlib IMPALA: 18 at 14M frames"
    ),
    "pong_ga3c_a3c": Reproduction(
        "pong_ga3c_a3c.yaml", 10_000_000, "atari", None, "reported at 10M frames"
    ),
    "halfcheetah_sac": Reproduction(
        {"arch": "seed", "algo": "sac", "env": "HalfCheetah-v5"},
        300_000,
        "mujoco",
        5000.0,
        "CleanRL SAC, HalfCheetah-v4, 1M steps: 9,635",
    ),
    "hopper_td3": Reproduction(
        {"arch": "seed", "algo": "td3", "env": "Hopper-v5"},
        300_000,
        "mujoco",
        None,
        "CleanRL TD3, Hopper-v4, 1M steps: 3,135",
    ),
}


def _platform(repro: Reproduction, overrides: list[str]) -> Platform:
    if isinstance(repro.spec, str):
        return Platform.from_yaml(SPECS / repro.spec, overrides)
    return Platform(repro.spec, overrides=overrides)


def run_seed(
    name: str, repro: Reproduction, seed: int, logdir: Path, checkpoint_s: float, frames: int
) -> Path:
    """Train (or resume, or only read back) one seed for `frames`; return its run folder."""
    folder = logdir / f"{name}-s{seed}"
    overrides = [
        *repro.overrides,
        f"run.seed={seed}",
        f"run.stop.env_frames={frames}",
        f"run.checkpoint_interval_s={checkpoint_s}",
        f"run.logdir={logdir}",
        f"run.name={folder.name}",
        "run.display=plain",
    ]
    records = read_records(folder / "metrics.jsonl") if (folder / "metrics.jsonl").exists() else []
    if records and records[-1].get("env_frames", 0) >= frames:
        print(f"{folder.name}: done ({records[-1]['env_frames']:,} frames), reading it back")
        return folder
    if (folder / "checkpoints").is_dir() and any((folder / "checkpoints").iterdir()):
        print(f"{folder.name}: resuming from its newest checkpoint")
        Platform.resume(folder, overrides).fit()
    else:
        _platform(repro, overrides).fit()
    return folder


def first_reaching(records: list[dict[str, Any]], target: float, window: int = 100) -> int | None:
    """Env frames at the first record whose full `window`-episode mean reached `target`
    (the rule `fit` itself reports the first hit by)."""
    hit = TargetHit(target)
    for record in records:
        hit.observe(record, window)
    return None if hit.env_frames is None else int(hit.env_frames)


def seed_entry(repro: Reproduction, folder: Path) -> dict[str, Any]:
    """One finished seed's figures and curve, read from its run folder (MuJoCo: with a
    greedy evaluation of its final policy, which needs the folder's checkpoint)."""
    records = read_records(folder / "metrics.jsonl")
    last = records[-1]
    entry: dict[str, Any] = {
        "run": folder.name,
        "env_frames": int(last["env_frames"]),
        "agent_steps": int(last["agent_steps"]),
        "wall_time_s": round(float(last["wall_time_s"]), 1),
        "final_return": last.get("episode_return_mean"),
    }
    if repro.kind == "atari":
        entry["frames_to_18"] = first_reaching(records, 18.0)
        # the machine reading the folder is the one that trained it (runs are not moved)
        entry["frames_per_s"] = round(entry["env_frames"] / max(entry["wall_time_s"], 1e-9))
        entry["cpu_bf16"] = native_bf16("cpu")
        spec = folder / "spec.yaml"
        entry["spec"] = spec.read_text() if spec.is_file() else None
    else:
        spec, algorithm = load_policy(folder)
        entry["eval_return"] = evaluate(algorithm, spec.env, 10).mean
    entry["curve"] = [
        [r["env_frames"], r["episode_return_mean"]] for r in records if "episode_return_mean" in r
    ]
    return entry


def row_path(out: Path, name: str, seed: int) -> Path:
    """Where a finished seed's entry is kept (committed with the result), so that a seed
    trained in one session counts in a later one whose run folders are gone."""
    return out / f"{name}_rows" / f"s{seed}.json"


def train_and_record(
    name: str,
    repro: Reproduction,
    seed: int,
    logdir: Path,
    checkpoint_s: float,
    frames: int,
    out: Path,
) -> dict[str, Any]:
    """One seed's entry: read back from its row if one was kept for the same budget and
    overrides; else trained (or resumed) to `frames`, then kept as a row."""
    path = row_path(out, name, seed)
    setting = {"frames": frames, "overrides": repro.overrides}
    if path.exists():
        row = json.loads(path.read_text())
        kept = {k: row.get(k) for k in setting}
        if kept == setting:
            print(f"{name}-s{seed}: done, read back from {path}")
            return row["entry"]
        print(f"{name}-s{seed}: {path} holds a run with {kept}, not {setting}; training again")
    folder = run_seed(name, repro, seed, logdir, checkpoint_s, frames)
    entry = seed_entry(repro, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**setting, "seed": seed, "entry": entry}) + "\n")
    return entry


def summarize(name: str, repro: Reproduction, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The result JSON: the figures the issue names, and each seed's curve."""
    per_seed = [{k: v for k, v in e.items() if k != "curve"} for e in entries]
    result: dict[str, Any] = {
        "name": name,
        "reference": repro.reference,
        "overrides": repro.overrides,
        "curves": {e["run"]: e["curve"] for e in entries},
    }
    if repro.kind == "atari":
        result.update(per_seed[0] if len(per_seed) == 1 else {"per_seed": per_seed})
        finals = [s["final_return"] for s in per_seed]
        result["final_return"] = statistics.median(finals)
    else:
        evals = [s["eval_return"] for s in per_seed]
        result.update(
            eval_return_mean=statistics.fmean(evals),
            per_seed=per_seed,
            agent_steps=min(s["agent_steps"] for s in per_seed),
        )
    return result


def run_records(folder: Path) -> list[dict[str, Any]]:
    """The metrics records of a run folder; ValueError naming the folder if it has none."""
    records = read_records(folder / "metrics.jsonl")
    if not records:
        raise ValueError(f"{folder}: no records in {folder / 'metrics.jsonl'} (not a run folder?)")
    return records


def record(folder: Path, name: str, reference: str, out: Path) -> dict[str, Any]:
    """Any Atari run folder as a result (a probe of other settings, or a run forked from
    another's checkpoint, which no reproduction's spec describes): its figures and curve
    as a reproduction's, with the folder's resolved `spec.yaml` in place of overrides;
    written as `out/<name>.json` and `.png`. `reference` says what the run was.

    Raises ValueError naming the folder when it holds no metrics."""
    run_records(folder)
    repro = Reproduction({}, 0, "atari", None, reference)
    result = summarize(name, repro, [seed_entry(repro, folder)])
    del result["overrides"]
    spec = folder / "spec.yaml"
    result["spec"] = spec.read_text() if spec.is_file() else None
    out.mkdir(parents=True, exist_ok=True)
    plot(result, out / f"{name}.png")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


#: The frame counts at which `--progress` reads a run's curve.
PROGRESS_MARKS = (1e6, 2e6, 3e6, 4e6, 6e6, 8e6, 10e6, 15e6, 20e6)


def progress(folder: Path) -> str:
    """One table row for a run folder, finished or not: the window's mean return and the
    policy entropy at the first record at or past each mark, then where the run is.

    Raises ValueError naming the folder when it holds no metrics yet (a mistyped path, or
    a run that has not logged its first record)."""
    records = run_records(folder)
    cells = []
    for mark in PROGRESS_MARKS:
        reached = [r for r in records if r["env_frames"] >= mark and "episode_return_mean" in r]
        if not reached:
            break
        entropy = [r["entropy"] for r in records if r["env_frames"] <= mark and "entropy" in r]
        cell = f"{mark / 1e6:.0f}M {reached[0]['episode_return_mean']:.2f}"
        cells.append(cell + (f" (H {entropy[-1]:.2f})" if entropy else ""))
    last = records[-1]
    end = (
        f"end {int(last['env_frames']):,} frames, {int(last['updates']):,} updates, "
        f"return {last.get('episode_return_mean', float('nan')):.2f}"
    )
    return f"{folder.name}: " + " | ".join([*cells, end])


def plot_curves(
    curves: dict[str, list], path: Path, *, xlabel: str, ylabel: str, title: str
) -> None:
    """One line per run (`curves`: name -> [(x, y), ...]) on one plot, saved as `path`;
    benchmarks/offpolicy.py draws its comparison with it too.

    Runs named `<group> s<seed>` (offpolicy.py's "rigl s0") share their group's colour
    and differ by line style, so a comparison of many variants stays readable past the
    ten colours of the cycle; any other name is a group of its own. A long title wraps.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    groups: dict[str, int] = {}  # group -> runs drawn so far
    colors: dict[str, str] = {}
    for run, points in curves.items():
        if points:
            head, _, tail = run.rpartition(" ")
            group = head if head and tail[:1] == "s" and tail[1:].isdigit() else run
            colors.setdefault(group, f"C{len(colors) % 10}")
            style = ("-", "--", ":", "-.")[groups.get(group, 0) % 4]
            groups[group] = groups.get(group, 0) + 1
            ax.plot(*zip(*points), label=run, color=colors[group], linestyle=style)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(textwrap.fill(title, 80), fontsize=10 if len(title) > 60 else None)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7 if len(curves) > 4 else None)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_returns(curves: dict[str, list], path: Path, title: str) -> None:
    """Return curves by env frames, as every reproduction result holds them."""
    plot_curves(
        curves, path, xlabel="env frames", ylabel="mean return (last 100 episodes)", title=title
    )


def plot(result: dict[str, Any], path: Path) -> None:
    plot_returns(result["curves"], path, f"{result['name']} ({result['reference']})")


def compare(files: list[Path], path: Path) -> list[str]:
    """Every run's curve in the result JSONs `files` on one plot saved as `path` (Pong under
    each topology, say), and one line per run: its last point.

    A run named as one already drawn (offpolicy.py's "dense s0" in two results) is
    labelled with its file's name too. Raises ValueError naming a file that is missing or
    holds no curves."""
    curves: dict[str, list] = {}
    for file in files:
        try:
            runs = json.loads(file.read_text())["curves"]
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"{file}: not a result with curves ({err!r})") from err
        for run, points in runs.items():
            curves[f"{file.stem}: {run}" if run in curves else run] = points
    plot_returns(curves, path, ", ".join(file.stem for file in files))
    return [
        f"{run}: {points[-1][0]:,.0f} frames, return {points[-1][1]:.2f}"
        for run, points in curves.items()
        if points
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="reproductions to run (see --list)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--logdir", type=Path, default=Path("runs/reproduce"))
    parser.add_argument("--checkpoint-s", type=float, default=300.0)
    parser.add_argument(
        "--jobs", type=int, default=1, help="seeds trained at once, each in its own process"
    )
    parser.add_argument(
        "--frames",
        type=int,
        help="a shorter budget, for a smoke check: results then go to --logdir, not results/",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="spec overrides on top of the reproduction's (e.g. model.precision=fp32 on a CPU "
        "without AVX512-BF16); pass the same ones when resuming. The result records them",
    )
    parser.add_argument("--list", action="store_true", help="list the reproductions and exit")
    parser.add_argument(
        "--progress",
        type=Path,
        nargs="+",
        metavar="RUN_DIR",
        help="print each run folder's return and entropy at 1M, 2M, ... frames and exit "
        "(reads metrics.jsonl only: also runs still going, and runs of any spec)",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        metavar="RESULT_JSON",
        help="draw every run of these results on one plot (--out) and exit",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "compare.png", help="the --compare plot"
    )
    parser.add_argument(
        "--record",
        type=Path,
        metavar="RUN_DIR",
        help="write the Atari run in RUN_DIR, of any spec, as results/<--name>.json and .png "
        "(its figures, curve and resolved spec) and exit",
    )
    parser.add_argument("--name", help="--record: the result's name (default: the folder's)")
    parser.add_argument("--reference", default="", help="--record: what the run was")
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="--record: the folder it writes to"
    )
    args = parser.parse_args()
    if args.record:
        try:
            name = args.name or args.record.name
            result = record(args.record, name, args.reference, args.results)
        except ValueError as err:
            parser.error(str(err))
        print(json.dumps({k: v for k, v in result.items() if k not in ("curves", "spec")}))
        return 0
    if args.compare:
        try:
            lines = compare(args.compare, args.out)
        except ValueError as err:
            parser.error(str(err))
        print("\n".join([*lines, f"wrote {args.out}"]))
        return 0
    if args.progress:
        try:
            for folder in args.progress:
                print(progress(folder))
        except ValueError as err:
            parser.error(str(err))
        return 0
    if args.list or not args.names:
        for name, repro in REPRODUCTIONS.items():
            print(f"{name:<20} {repro.env_frames:>12,} frames  {repro.reference}")
        return 0
    unknown = [n for n in args.names if n not in REPRODUCTIONS]
    if unknown:
        parser.error(f"unknown reproduction(s) {unknown}; known: {', '.join(REPRODUCTIONS)}")
    missed = []
    for name in args.names:
        repro = REPRODUCTIONS[name]
        repro = replace(repro, overrides=[*repro.overrides, *args.set])
        frames = args.frames or repro.env_frames
        out = args.logdir if args.frames else RESULTS
        train = partial(
            train_and_record,
            name,
            repro,
            logdir=args.logdir,
            checkpoint_s=args.checkpoint_s,
            frames=frames,
            out=out,
        )
        if args.jobs > 1:  # each seed in its own process (and its own embedded Ray)
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
                entries = list(pool.map(train, args.seeds))
        else:
            entries = [train(seed) for seed in args.seeds]
        result = summarize(name, repro, entries)
        out.mkdir(parents=True, exist_ok=True)
        plot(result, out / f"{name}.png")
        (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        figures = {k: v for k, v in result.items() if k not in ("curves", "per_seed")}
        print(json.dumps(figures))
        score = result.get("eval_return_mean", result.get("final_return"))
        if repro.target is not None and (score is None or score < repro.target):
            missed.append(name)
    if missed:
        print(f"below target: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
