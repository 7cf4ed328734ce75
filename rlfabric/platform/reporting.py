"""Where metrics go: metrics.jsonl, TensorBoard, a live display and curve.png, and the
trackers `run.loggers` names (W&B, MLflow: `platform.trackers`, off this loop).

One record per report interval. The live display (rich on a terminal, plain
lines otherwise, as under `ray job submit`) shows frames/s, return, losses and
the throughput breakdown: env step time, inference batch and latency, learner
step time, queue depth and policy lag.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from rlfabric.runtime.config import StopConfig

if TYPE_CHECKING:
    from rlfabric.platform.trackers import Trackers

#: (metric, label, format) rows of the live display, in order.
DISPLAY_ROWS = [
    ("env_frames", "env frames", "{:,.0f}"),
    ("agent_steps", "agent steps", "{:,.0f}"),
    ("env_frames_per_s", "env frames/s", "{:,.0f}"),  # shown over RATE_WINDOW_S
    ("episode_return_mean", "return ({window} ep)", "{:.2f}"),
    ("eval_return_mean", "eval return", "{:.2f}"),
    ("episodes", "episodes", "{:,.0f}"),
    ("loss", "loss", "{:.4g}"),
    ("pg_loss", "policy loss", "{:.4g}"),
    ("baseline_loss", "value loss", "{:.4g}"),
    ("entropy", "entropy", "{:.3f}"),
    ("env_step_ms", "env step ms (group)", "{:.3f}"),
    ("inference_batch_envs", "inference batch (envs)", "{:.1f}"),
    ("inference_ms", "inference ms", "{:.3f}"),
    ("learner_step_ms", "learner step ms", "{:.2f}"),
    ("learner_samples_per_s", "learner samples/s", "{:,.0f}"),
    ("batch_queue", "batch queue", "{:.0f}"),
    ("policy_lag", "policy lag (updates)", "{:.2f}"),
    ("wall_time_s", "wall time s", "{:.1f}"),
]


#: Seconds of records over which the display's env frames/s is taken.
RATE_WINDOW_S = 30.0

#: Seconds between the plain display's time breakdown lines (its every-interval line
#: keeps to frames, return and the losses: a log, not a dashboard); the first comes with
#: the first record, so that a short run shows one too.
PLAIN_BREAKDOWN_EVERY_S = 30.0
#: The plain display's every-interval line: DISPLAY_ROWS up to the entropy; the rest
#: (where the time goes) is its breakdown line.
PLAIN_LINE_ROWS = 1 + [key for key, _, _ in DISPLAY_ROWS].index("entropy")


def progress_text(record: dict[str, Any], stop: StopConfig) -> str:
    """How far the run is toward the stop conditions in force, and the time left to the
    nearest of frames and wall time.

    The frames' time left is at the run's average rate (frames over wall time, both
    carried over a resume), not the last interval's: a learner-bound run's frames arrive
    in bursts (PPO on Atari takes seconds per batch while its envs wait), so the interval
    rate swings between 0 and twice the mean and would make the estimate jump or vanish.
    """
    parts, left = [], []
    frames = record.get("env_frames", 0.0)
    wall = record.get("wall_time_s", 0.0)
    # A stop checked once per interval overshoots its budget a little: not past 100%.
    if stop.env_frames:
        parts.append(f"{min(1.0, frames / stop.env_frames):.0%} of {stop.env_frames:,} frames")
        if frames > 0 and wall > 0:
            left.append(max(0.0, stop.env_frames - frames) * wall / frames)
    if stop.wall_time_s:
        parts.append(f"{min(1.0, wall / stop.wall_time_s):.0%} of {stop.wall_time_s:g} s")
        left.append(max(0.0, stop.wall_time_s - wall))
    if stop.episode_return_mean is not None and "episode_return_mean" in record:
        parts.append(f"return {record['episode_return_mean']:.1f} of {stop.episode_return_mean:g}")
    if left:
        minutes, seconds = divmod(int(min(left)), 60)
        # A return target may end the run sooner: the budgets' time left is then a bound.
        bound = "at most " if stop.episode_return_mean is not None else ""
        parts.append(f"{bound}~{minutes // 60}h{minutes % 60:02d}m{seconds:02d}s left")
    return ", ".join(parts)


def windowed_rate(records: list[dict[str, Any]], key: str = "env_frames") -> float | None:
    """`key`'s rate per second over the last `RATE_WINDOW_S` of wall time in `records`,
    or None with less than two records in that window.

    A learner-bound run's frames arrive a batch at a time (PPO on Atari takes seconds
    per batch while its envs wait), so the interval rate in metrics.jsonl swings between
    0 and several times the mean; the display shows the window's rate instead.
    """
    last = records[-1] if records else {}
    if key not in last or "wall_time_s" not in last:
        return None
    first = None
    for i in range(len(records) - 2, -1, -1):  # back from the end: no copy of a long run's list
        record = records[i]
        if record.get("wall_time_s", -math.inf) < last["wall_time_s"] - RATE_WINDOW_S:
            break
        if key in record:
            first = record
    if first is None or last["wall_time_s"] <= first["wall_time_s"]:
        return None
    return (last[key] - first[key]) / (last["wall_time_s"] - first["wall_time_s"])


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Reporter:
    """Writes every record to the logdir's sinks, the trackers and the chosen display."""

    def __init__(
        self,
        logdir: Path,
        display: str,
        title: str,
        stop: StopConfig | None = None,
        return_window: int = 100,
        *,
        tensorboard: bool = True,
        trackers: Trackers | None = None,
    ) -> None:
        self.logdir = logdir
        self.title = title
        self.stop = stop
        self.rows = [(k, label.format(window=return_window), f) for k, label, f in DISPLAY_ROWS]
        self.return_window = return_window
        self._breakdown_at = -math.inf  # wall_time_s of the plain display's last breakdown
        self.records = read_records(logdir / "metrics.jsonl")  # a resumed run appends
        self._jsonl = open(logdir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow import, only when used

            self._tb = SummaryWriter(str(logdir / "tensorboard"))
        self.trackers = trackers
        if display == "auto":
            display = "rich" if sys.stdout.isatty() else "plain"
        self.display = display
        self._live: Live | None = None
        if display == "rich":
            self._live = Live(self._table({}), console=Console(), refresh_per_second=4)
            self._live.start()

    def log(self, record: dict[str, Any]) -> None:
        record = {
            k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)
        }
        self.records.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            step = int(record.get("env_frames", 0))
            for key, value in record.items():
                self._tb.add_scalar(key, value, step)
        if self.trackers:  # each on its own thread: this only queues the record
            self.trackers.log(record)
        shown = dict(record)
        rate = windowed_rate(self.records)
        if rate is not None:
            shown["env_frames_per_s"] = rate
        if self._live is not None:
            self._live.update(self._table(shown))
        elif self.display == "plain":
            print(self._line(shown), flush=True)
            wall = record.get("wall_time_s", 0.0)
            if wall - self._breakdown_at >= PLAIN_BREAKDOWN_EVERY_S:
                self._breakdown_at = wall
                print(self._line(record, self.rows[PLAIN_LINE_ROWS:], "time: "), flush=True)

    def message(self, text: str) -> None:
        if self._live is not None:
            self._live.console.print(text)
        elif self.display != "none":
            print(text, flush=True)

    def _table(self, record: dict[str, Any]) -> Table:
        table = Table(title=self.title, show_header=False, min_width=48)
        table.add_column(style="cyan")
        table.add_column(justify="right")
        for key, label, fmt in self.rows:
            if key in record:
                table.add_row(label, fmt.format(record[key]))
        if self.stop is not None and record:
            table.add_row("progress", progress_text(record, self.stop))
        return table

    def _line(
        self,
        record: dict[str, Any],
        rows: list[tuple[str, str, str]] | None = None,
        prefix: str = "",
    ) -> str:
        rows = self.rows[:PLAIN_LINE_ROWS] if rows is None else rows
        parts = [f"{label}={fmt.format(record[key])}" for key, label, fmt in rows if key in record]
        if self.stop is not None and not prefix:
            parts.append(progress_text(record, self.stop))
        return prefix + " | ".join(parts)

    def plot(self) -> Path:
        """Draw return vs env frames to curve.png (matplotlib, no display needed)."""
        from matplotlib.figure import Figure  # no pyplot: no global backend switch

        points = [
            (r["env_frames"], r["episode_return_mean"])
            for r in self.records
            if "episode_return_mean" in r and "env_frames" in r
        ]
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        if points:
            ax.plot(*zip(*points))
        target = self.stop.episode_return_mean if self.stop is not None else None
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel("env frames")
        ax.set_ylabel(f"mean return (last {self.return_window} episodes)")
        # env | arch + algo | run name: long names wrap instead of running off the figure
        ax.set_title(textwrap.fill(self.title, 60), fontsize=10)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = self.logdir / "curve.png"
        fig.savefig(path, dpi=100)
        return path

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._tb is not None:
            self._tb.close()
        self._jsonl.close()
