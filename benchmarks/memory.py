"""RSS of every rlfabric process over a long run: does anything grow?

Starts a run in a background thread (driver, learner and env runner actors),
samples the resident set size of the driver and of every Ray worker process
every --every seconds, and prints, per process, the RSS after the warm-up
(the first sample past --warmup seconds), at the end, and the change. Linux only
(reads /proc).

    python benchmarks/memory.py --minutes 20
    python benchmarks/memory.py --spec examples/specs/cartpole_impala_vtrace.yaml --minutes 5
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

from rlfabric import Platform


def rlfabric_processes() -> dict[int, str]:
    """This driver and the Ray workers hosting rlfabric actors, by process title (Linux /proc)."""
    found = {os.getpid(): "driver"}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if title.startswith("ray::") and ("Learner" in title or "EnvRunner" in title):
            found[int(entry.name)] = title.split()[0]
    return found


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="examples/specs/cartpole_seed_vtrace.yaml")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before the baseline")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--logdir", default="runs/bench-memory")
    args = parser.parse_args()
    seconds = 60 * args.minutes
    platform = Platform.from_yaml(
        args.spec,
        [
            f"run.stop.wall_time_s={seconds}",
            "run.stop.env_frames=1000000000000",
            f"run.logdir={args.logdir}",
            "run.display=none",
        ],
    )
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(r=platform.fit()), daemon=True)
    worker.start()
    samples: dict[int, list[tuple[float, float]]] = {}
    names: dict[int, str] = {}
    start = time.perf_counter()
    while worker.is_alive():
        now = time.perf_counter() - start
        for pid, name in rlfabric_processes().items():
            rss = rss_mib(pid)
            if rss is None:
                continue
            names[pid] = name
            samples.setdefault(pid, []).append((now, rss))
        worker.join(args.every)
    print(
        f"spec {args.spec}, {args.minutes:g} min, env frames {result['r'].metrics['env_frames']:,}"
    )
    print(f"{'process':<28}{'RSS after warm-up MiB':>22}{'RSS at end MiB':>16}{'change':>9}")
    for pid, points in samples.items():
        after = [rss for t, rss in points if t >= args.warmup]
        if len(after) < 2:
            continue
        change = (after[-1] - after[0]) / after[0]
        print(f"{names[pid] + f' ({pid})':<28}{after[0]:>22.1f}{after[-1]:>16.1f}{change:>+9.1%}")


if __name__ == "__main__":
    main()
