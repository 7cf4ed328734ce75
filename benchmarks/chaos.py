"""Chaos: names-only runs that lose their learner, an env runner or their driver, and still learn.

Each case runs `rlfabric train` three times in this invocation, one after another:

- undisturbed: the case's spec until its return target (or its frame cap);
- learner chaos: the same run with the learner's process SIGKILLed twice and one env
  runner's once, at times drawn from `--seed` between 15% and 85% of the undisturbed
  run's learning time, after its start-up (a kill whose time comes after the run
  ended is reported as not made; a learner kill waits until the restarted learner has
  reported progress, since one killed again before that ends the run by design: no
  restart loop); the driver restarts the topology from the newest checkpoint;
- driver chaos: the same run with `run.resume=auto`, its whole process group (the
  driver and the Ray it started) SIGKILLed at one such time, then the same command
  again, which continues from the run folder's newest checkpoint.

The processes are found by their Ray process titles (`ray::SeedLearner`,
`ray::SeedEnvRunner`) among the driver's descendants (Linux /proc). Checkpoints
every `--checkpoint-s` seconds in every run (the default, 60 s, is longer than these
runs). The script prints, per run, the kills, the restarts Ray and the driver made,
the frames lost, the frames and wall time to the target, and the wall time of the
whole run (for driver chaos: both commands, the time between them included); with
`--out` it writes them as JSON.

    python benchmarks/chaos.py                         # both cases, seed 0
    python benchmarks/chaos.py --cases cartpole --seed 3 --out benchmarks/results/chaos.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlfabric.platform.facade import TargetHit
from rlfabric.platform.reporting import read_records


@dataclass(frozen=True)
class Case:
    spec: dict[str, Any]  # names only, plus the target and a frame cap
    target: float
    window: int  # episodes in the return mean the target is judged on


CASES = {
    "cartpole": Case(
        {"arch": "seed", "algo": "vtrace", "env": "CartPole-v1"}, target=475.0, window=100
    ),
    "pendulum": Case(
        {"arch": "seed", "algo": "sac", "env": "Pendulum-v1"}, target=-200.0, window=10
    ),
}


def _spec(case: Case, cap: int, checkpoint_s: float) -> dict[str, Any]:
    spec = dict(case.spec)
    spec["run"] = {
        "display": "plain",
        "checkpoint_interval_s": checkpoint_s,
        "return_window": case.window,
        "stop": {"episode_return_mean": case.target, "env_frames": cap},
    }
    return spec


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found += children
        frontier += children
    return found


def _find(root: int, title: str) -> int | None:
    """A descendant of `root` whose Ray process title starts with `title`."""
    for pid in _descendants(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if cmdline.startswith(title):
            return pid
    return None


def _command(spec_file: Path, logdir: Path, name: str, resume: bool) -> list[str]:
    rlfabric = str(Path(sys.executable).parent / "rlfabric")
    command = [rlfabric, "train", str(spec_file), f"run.logdir={logdir}", f"run.name={name}"]
    return command + (["run.resume=auto"] if resume else [])


def _train(
    command: list[str], out: Path, kills: list[tuple[float, str]], folder: Path
) -> tuple[int, list[dict[str, Any]]]:
    """Run `command`; at each (seconds, what) kill `what`: 'learner', 'env runner' or
    'driver' (the whole process group, which ends the run). Return its exit code and
    the kills made."""
    made = []
    started = time.perf_counter()
    records = folder / "metrics.jsonl"
    progress_at_kill = -1  # records in metrics.jsonl when the learner was last killed
    with out.open("a") as log:
        driver = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
        pending = sorted(kills)
        while driver.poll() is None:
            time.sleep(0.1)
            if not pending or time.perf_counter() - started < pending[0][0]:
                continue
            at, what = pending.pop(0)
            if what == "driver":
                os.killpg(driver.pid, signal.SIGKILL)
                made.append({"what": what, "at_s": round(at, 1), "pid": driver.pid})
                continue
            title = {"learner": "ray::SeedLearner", "env runner": "ray::SeedEnvRunner"}[what]
            pid = _find(driver.pid, title)
            # A learner killed again before its restarted self reported progress would end
            # the run by design (no restart loop): such a kill waits for 3 new records.
            reported = len(read_records(records)) if records.is_file() else 0
            if pid is None or (what == "learner" and reported < progress_at_kill + 3):
                pending.insert(0, (at + 1.0, what))  # between a death and its restart
                continue
            if what == "learner":
                progress_at_kill = reported
            os.kill(pid, signal.SIGKILL)
            made.append({"what": what, "at_s": round(time.perf_counter() - started, 1), "pid": pid})
    return driver.returncode, made


def _summary(
    folder: Path, case: Case, wall_s: float, kills: list[dict[str, Any]], planned: int
) -> dict[str, Any]:
    records = read_records(folder / "metrics.jsonl")
    hit = TargetHit(case.target)
    for record in records:
        hit.observe(record, case.window)
    last = records[-1]
    return {
        "reached": hit.env_frames is not None,
        "frames_to_target": hit.env_frames,
        "wall_time_to_target_s": None if hit.wall_time_s is None else round(hit.wall_time_s, 1),
        "final_return": round(last.get("episode_return_mean", float("nan")), 2),
        "env_frames": last["env_frames"],
        "kills_planned": planned,
        "kills": kills,
        "learner_restarts": last.get("learner_restarts", 0),
        # run.log, not the metrics: a learner restart starts a new runner pool's count
        "runner_restarts": len(
            re.findall(r"env runner \d+ died", (folder / "run.log").read_text())
        ),
        "frames_lost": last.get("frames_lost", 0),
        "wall_s": round(wall_s, 1),
        "learning_s": round(last["wall_time_s"], 1),  # from the first step on
    }


def run_case(name: str, case: Case, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    spec_file = work / f"{name}.yaml"
    spec_file.write_text(yaml.safe_dump(_spec(case, args.max_frames, args.checkpoint_s)))
    rng = random.Random(args.seed)
    results: dict[str, Any] = {}

    start = time.perf_counter()
    command = _command(spec_file, work, f"{name}_undisturbed", False)
    _train(command, work / "train.log", [], work / f"{name}_undisturbed")
    base = _summary(work / f"{name}_undisturbed", case, time.perf_counter() - start, [], 0)
    results["undisturbed"] = base
    # Kills land while it learns: after the start (Ray, actors), within 15-85% of the rest.
    lead, span = base["wall_s"] - base["learning_s"], base["learning_s"]

    def when() -> float:
        return lead + rng.uniform(0.15 * span, 0.85 * span)

    plan = [(when(), "learner"), (when(), "learner"), (when(), "env runner")]
    start = time.perf_counter()
    command = _command(spec_file, work, f"{name}_learner", False)
    _, made = _train(command, work / "train.log", plan, work / f"{name}_learner")
    wall = time.perf_counter() - start
    results["learner_chaos"] = _summary(work / f"{name}_learner", case, wall, made, len(plan))

    command = _command(spec_file, work, f"{name}_driver", True)
    folder = work / f"{name}_driver"
    start = time.perf_counter()
    _, made = _train(command, work / "train.log", [(when(), "driver")], folder)
    before = read_records(folder / "metrics.jsonl")
    killed_at = before[-1]["env_frames"] if before else 0
    _train(command, work / "train.log", [], folder)
    wall = time.perf_counter() - start
    driver = _summary(folder, case, wall, made, 1)
    # Where the second command took up the run (none: it died before its first checkpoint).
    resumed = re.search(
        r"resumed from \S+ at ([\d,]+) env frames", (folder / "run.log").read_text()
    )
    driver["resumed_at_frames"] = int(resumed.group(1).replace(",", "")) if resumed else 0
    driver["frames_lost"] = killed_at - driver["resumed_at_frames"]  # past the checkpoint
    results["driver_chaos"] = driver
    return results


def _line(case: str, run: str, r: dict[str, Any]) -> str:
    kills = ", ".join(f"{k['what']} at {k['at_s']}s" for k in r["kills"]) or "none"
    frames = f"{r['frames_to_target']:,.0f}" if r["reached"] else "not reached"
    to_target = f"{r['wall_time_to_target_s']}s" if r["reached"] else "-"
    return (
        f"{case:<9} {run:<14} target {frames:>11} frames, {to_target:>7} | final "
        f"{r['final_return']:>8} | kills: {kills} ({len(r['kills'])} of {r['kills_planned']}) | "
        f"learner restarts {r['learner_restarts']}, runner restarts {r['runner_restarts']}, "
        f"frames lost {r['frames_lost']} | wall {r['wall_s']}s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--seed", type=int, default=0, help="of the kill times")
    parser.add_argument("--checkpoint-s", type=float, default=5.0)
    parser.add_argument("--max-frames", type=int, default=2_000_000, help="frame cap per run")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--workdir",
        type=Path,
        help="keep the run folders and train.log here (default: a "
        "temporary folder, removed at the end)",
    )
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="chaos_") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.cases:
            results[name] = run_case(name, CASES[name], args, work)
            for run, r in results[name].items():
                print(_line(name, run, r), flush=True)
    if args.out:
        meta = {"seed": args.seed, "checkpoint_interval_s": args.checkpoint_s}
        args.out.write_text(json.dumps({**meta, "cases": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
