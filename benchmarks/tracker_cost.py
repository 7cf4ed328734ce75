"""Cost of the trackers to the driver's report loop, and on their own threads.

A `Reporter` like a run's (metrics.jsonl and TensorBoard) takes N records of a real
run's shape (the keys of a local + vtrace CartPole run's, 37 numbers) with no tracker,
with W&B (offline: no server) and with MLflow (a local sqlite store, or the server
`--mlflow-uri` names, e.g. one started with `mlflow server --host 127.0.0.1`). For each:

- report call: the time `Reporter.log` holds the report loop (median, 99th percentile);
  the tracker's part of it is queueing the record;
- tracker: the median wall time and CPU time of one record's logging on the tracker's
  own thread (its CPU time is what it takes from a `local` run, whose learner shares the
  driver's process; wandb's own service process and an MLflow server's work come on top).

    python benchmarks/tracker_cost.py
    python benchmarks/tracker_cost.py --records 500 --mlflow-uri http://127.0.0.1:5000

Nothing leaves the machine: W&B runs offline; MLflow's usage telemetry is turned off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.update(
    MLFLOW_DISABLE_TELEMETRY="true",
    DO_NOT_TRACK="true",
    WANDB_MODE="offline",
    WANDB_ERROR_REPORTING="false",
    WANDB_SILENT="true",
)

from rlfabric.platform.reporting import Reporter
from rlfabric.platform.spec import ExperimentSpec
from rlfabric.platform.trackers import TRACKERS_FILE, Trackers

#: The keys of a local + vtrace CartPole run's records (metrics.jsonl).
KEYS = [
    "env_frames",
    "agent_steps",
    "episodes",
    "updates",
    "learner_samples",
    "env_requests",
    "env_vector_steps",
    "weight_syncs",
    "skipped_updates",
    "inference_ms",
    "inference_batch_envs",
    "env_step_ms",
    "params_actor",
    "sparsity_actor",
    "inference_flops_fraction_actor",
    "train_flops_fraction_actor",
    "train_flops_fraction",
    "inference_flops_fraction",
    "learner_busy_s",
    "learner_cpu_s",
    "batch_queue",
    "wall_time_s",
    "env_frames_per_s",
    "learner_samples_per_s",
    "learner_restarts",
    "frames_lost",
    "episode_return_mean",
    "episode_length_mean",
    "loss",
    "pg_loss",
    "baseline_loss",
    "entropy",
    "entropy_cost",
    "grad_norm",
    "rho_mean",
    "policy_lag",
    "learner_step_ms",
]


def record(i: int) -> dict[str, float]:
    values = {key: float(i) + 0.5 * k for k, key in enumerate(KEYS)}
    values["env_frames"] = float(1000 * i)
    return values


def measure(name: str, run: dict, records: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        logdir = Path(tmp)
        spec = ExperimentSpec.build({"env": "CartPole-v1", "run": run})
        trackers = Trackers(spec, logdir)
        reporter = Reporter(logdir, "none", name, trackers=trackers)
        taken: list[tuple[float, float]] = []  # (wall, CPU) of each record on its thread
        for worker in trackers.workers:  # started: its run opened, its package imported
            while worker.tracker.name not in _saved(logdir) and not worker.failed:
                time.sleep(0.05)
            worker.tracker.log = _timed(worker.tracker.log, taken)
        calls = []
        for i in range(records):
            start = time.perf_counter()
            reporter.log(record(i))
            calls.append(time.perf_counter() - start)
        while trackers and len(taken) < records and not trackers.workers[0].failed:
            time.sleep(0.01)
        reporter.close()
        problems = trackers.close(None, "finished")
        assert not problems, problems
        calls.sort()
        return {
            "median_us": 1e6 * statistics.median(calls),
            "p99_us": 1e6 * calls[int(0.99 * len(calls))],
            "thread_ms": 1e3 * statistics.median(w for w, _ in taken) if taken else 0.0,
            "cpu_ms": 1e3 * statistics.median(c for _, c in taken) if taken else 0.0,
        }


def _timed(log: Callable[..., None], taken: list[tuple[float, float]]) -> Callable[..., None]:
    def timed(*args: object) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        log(*args)
        taken.append((time.perf_counter() - wall, time.thread_time() - cpu))

    return timed


def _saved(logdir: Path) -> str:
    path = logdir / TRACKERS_FILE
    return path.read_text() if path.is_file() else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=500, help="report calls per tracker")
    parser.add_argument("--mlflow-uri", help="an MLflow server; default: a local sqlite store")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as store:
        uri = args.mlflow_uri or f"sqlite:///{store}/mlflow.db"
        if args.mlflow_uri is None:  # its artifacts in the store too, not ./mlruns
            from mlflow.tracking import MlflowClient

            MlflowClient(uri).create_experiment("tracker_cost", f"{store}/artifacts")
        variants = {
            "none (jsonl, tensorboard)": {},
            "+ wandb (offline)": {"loggers": ["jsonl", "tensorboard", "wandb"]},
            f"+ mlflow ({uri.split(':')[0]})": {
                "loggers": ["jsonl", "tensorboard", "mlflow"],
                "mlflow": {"tracking_uri": uri, "experiment": "tracker_cost"},
            },
        }
        print(f"{args.records} report calls of {len(KEYS)} metrics each")
        print(
            f"{'loggers':28s} {'call median':>12s} {'call p99':>10s} {'thread/rec':>11s} "
            f"{'thread CPU/rec':>15s}"
        )
        for name, run in variants.items():
            row = measure(name, run, args.records)
            thread = (
                f"{row['thread_ms']:8.2f} ms {row['cpu_ms']:12.2f} ms" if run else f"{'-':>11s}"
            )
            print(f"{name:28s} {row['median_us']:9.0f} us {row['p99_us']:7.0f} us {thread}")


if __name__ == "__main__":
    main()
