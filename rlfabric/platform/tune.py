"""Hyperparameter search on Ray Tune: each trial is one ordinary rlfabric run.

    rlfabric tune SPEC.yaml [section.field=value ...]
    Platform.from_yaml("spec.yaml").tune()

The spec's `tune` section names the searched fields, the metric and the
scheduler. A trial is `Platform(spec).fit()` in a Tune trainable, writing
the usual run folder (`<run.logdir>/<search name>/<trial id>/`); it reports
each interval's record to Tune with env frames as Tune's time, and a trial
the scheduler stops ends as a stop condition ends a run: final checkpoint,
every actor stopped. Each trial asks Tune for a placement group holding what
its run places (the learner's and env runners' CPUs and GPUs; the trial's
own driver takes nothing), so trials pack onto a laptop with fractional
CPUs and spread over a cluster. At the end the search folder holds
`trials.csv`, `best_spec.yaml` (a spec `rlfabric train` runs as it is) and
Tune's own records under `ray_tune/`.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import math
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, TrialScheduler

from rlfabric.architectures import ARCHITECTURES
from rlfabric.architectures.runner_pool import max_runners
from rlfabric.architectures.topology import learner_gpus
from rlfabric.envs import EnvInfo, ensure_registered
from rlfabric.errors import SpecError
from rlfabric.platform.facade import Platform, runs_folder
from rlfabric.platform.ray_setup import init_ray
from rlfabric.platform.spec import ExperimentSpec, TuneConfig, set_dotted

#: Tune's own records (experiment state, per-trial result files), inside the search folder.
TUNE_RECORDS = "ray_tune"

_SAMPLERS = {
    "uniform": lambda v: tune.uniform(*v),
    "loguniform": lambda v: tune.loguniform(*v),
    "randint": lambda v: tune.randint(*v),
    "choice": lambda v: tune.choice(list(v)),
    "grid": lambda v: tune.grid_search(list(v)),
}


@dataclass
class TuneResult:
    """What a finished search hands back."""

    best_spec: ExperimentSpec | None  # None: no trial reported the metric
    best_metric: float | None  # the best trial's final value of the metric
    rows: list[dict[str, Any]]  # one per trial, as in trials.csv
    logdir: str
    search_keys: list[str] = field(default_factory=list)

    def table(self) -> str:
        """The trials side by side: searched values, metric, frames, wall time, status."""
        return format_table(self.rows, self.search_keys)


@dataclass
class _Plan:
    """What every trial needs to build its spec: travels to the trial actors once."""

    base: dict[str, Any]  # the user's values, no tune section
    folder: Path
    metric: str
    cpus_per_trial: float  # the cluster's CPUs over the trials that run at once
    env_info: EnvInfo

    def spec(self, config: dict[str, Any], trial_id: str | None = None) -> ExperimentSpec:
        """A trial's spec: the searched values over the user's; in a trial, its run
        folder and the CPU shares its placement group holds."""
        data = copy.deepcopy(self.base)
        for key, value in config.items():
            set_dotted(data, key.split("."), value)
        if trial_id is None:  # the best trial's spec for `rlfabric train`: its own run
            data.get("run", {}).pop("name", None)
            data.get("run", {}).pop("resume", None)
            return ExperimentSpec.build(data)
        run = data.setdefault("run", {})
        run.update(name=trial_id, logdir=str(self.folder), resume="never", display="none")
        probe = ExperimentSpec.build(data)
        resources = data.setdefault("resources", {})
        actors = _actors(probe)
        # Pinned in the spec, so that the run places exactly what the group holds; at most
        # one CPU each, as a run on its own takes.
        share = math.floor(1000 * min(1.0, self.cpus_per_trial / actors)) / 1000
        if probe.resources.learner_cpus is None:
            resources["learner_cpus"] = share
        if probe.resources.cpus_per_env_runner is None and actors > 1:
            resources["cpus_per_env_runner"] = share
        return ExperimentSpec.build(data)

    def placement(self, config: dict[str, Any]) -> tune.PlacementGroupFactory:
        """The bundles of what the trial's run places: the learner (GPUs included) and
        up to `max_runners` env runners, or the one process of arch `local`. The trial's
        driver, which only waits on them, takes an empty first bundle."""
        spec = self.spec(config, trial_id="probe")
        res = spec.resources
        gpus = learner_gpus(res, ray.cluster_resources().get("GPU", 0.0))
        learner = {"CPU": res.learner_cpus, **({"GPU": gpus} if gpus else {})}
        if not ARCHITECTURES[spec.arch.name].uses_ray:  # the driver is the learner
            return tune.PlacementGroupFactory([learner])
        runners = [{"CPU": res.cpus_per_env_runner}] * max_runners(spec)
        return tune.PlacementGroupFactory([{}, learner, *runners])


def _actors(spec: ExperimentSpec) -> int:
    """Processes with a CPU share in a trial: learner and env runners, or one (local)."""
    if not ARCHITECTURES[spec.arch.name].uses_ray:
        return 1
    if spec.resources.num_learners > 1:
        raise SpecError(
            f"resources.num_learners={spec.resources.num_learners} cannot be searched: "
            "data-parallel learners place their own placement group, which a trial's "
            "cannot hold; use num_learners: 1 in a search"
        )
    return 1 + max_runners(spec)


class _Trial(tune.Trainable):
    """One run, driven in a thread; each `step` hands Tune the run's next record.

    A trial the scheduler stops gets `cleanup`, which asks the run to stop at its next
    interval and waits for its final checkpoint (a function trainable's thread would
    be killed with its actor instead).
    """

    def setup(self, config: dict[str, Any], plan: _Plan) -> None:
        ensure_registered(plan.env_info)  # an env the user registered in the driver
        self.metric = plan.metric
        self.platform = Platform(plan.spec(config, self.trial_id))
        self.records: queue.Queue[dict[str, Any] | BaseException] = queue.Queue()
        self.pending: dict[str, Any] | None = None  # the record after the one Tune has
        self.stop_asked = threading.Event()
        self.thread = threading.Thread(target=self._fit, name="rlfabric-trial", daemon=True)
        self.thread.start()

    def _fit(self) -> None:
        try:
            result = self.platform.fit(on_record=self._on_record)
            self.records.put({"done": True, "stop_reason": result.stop_reason})
        except BaseException as err:  # handed to Tune by `step`: the trial's error
            self.records.put(err)

    def _on_record(self, metrics: dict[str, float]) -> str:
        # Tune refuses a result without the metric (a return mean before any episode ends)
        if self.metric in metrics:
            finite = {k: v for k, v in metrics.items() if _finite(v)}
            self.records.put(finite)
        return "stopped by the search's scheduler" if self.stop_asked.is_set() else ""

    def step(self) -> dict[str, Any]:
        """The next record, handed over once the one after it (or the run's end) is in:
        the run's last record then goes to Tune marked done, with the run's stop reason,
        before the scheduler can take the run's own end (at its frame budget) for its
        decision to stop the trial."""
        record = self.pending if self.pending is not None else self._next()
        if record.get("done"):  # the run ended before reporting the metric
            return record
        following = self._next()
        if following.get("done"):
            self.pending = None
            return {**record, **following}
        self.pending = following
        return record

    def _next(self) -> dict[str, Any]:
        item = self.records.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cleanup(self) -> None:
        self.stop_asked.set()
        self.thread.join()


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def run_search(spec: ExperimentSpec, env_info: EnvInfo) -> TuneResult:
    """Run the search the spec's `tune` section describes; write trials.csv and
    best_spec.yaml into the search folder."""
    config = spec.tune
    if config is None:
        raise SpecError("the spec has no tune section: nothing to search (see `tune:` in --help)")
    base = spec.user_values()
    base.pop("tune", None)
    scheduler = _scheduler(config, spec, env_info)
    folder = _search_folder(spec)
    started_ray = init_ray(spec.resources)
    try:
        trials = config.num_samples * math.prod(
            len(d.value) for d in config.search.values() if d.kind == "grid"
        )
        at_once = min(trials, config.max_concurrent_trials or trials)
        cpus = ray.cluster_resources()["CPU"] / at_once
        plan = _Plan(base, folder, config.metric, cpus, env_info)
        trainable = tune.with_resources(tune.with_parameters(_Trial, plan=plan), plan.placement)
        tuner = tune.Tuner(
            trainable,
            param_space={k: _SAMPLERS[d.kind](d.value) for k, d in config.search.items()},
            tune_config=tune.TuneConfig(
                metric=config.metric,
                mode=config.mode,
                scheduler=scheduler,
                num_samples=config.num_samples,
                max_concurrent_trials=at_once,
            ),
            run_config=tune.RunConfig(
                name=TUNE_RECORDS,
                storage_path=str(folder),
                verbose=0,
                log_to_file=True,
                # A trial's checkpoints are its run's own (in its run folder), not Tune's.
                checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False),
            ),
        )
        with _quiet_tune_console():
            grid = tuner.fit()
    finally:
        if started_ray:
            ray.shutdown()
    keys = list(config.search)
    rows = [_row(result, keys, config) for result in grid]
    _write_csv(folder / "trials.csv", rows, keys)
    ranked = [r for r in rows if r["final"] is not None]
    sign = 1 if config.mode == "max" else -1
    best = max(ranked, key=lambda r: sign * r["final"]) if ranked else None
    best_spec = None
    if best is not None:
        best_spec = plan.spec({k: best[k] for k in keys})
        (folder / "best_spec.yaml").write_text(best_spec.to_yaml())
    return TuneResult(best_spec, best["final"] if best else None, rows, str(folder), keys)


@contextlib.contextmanager
def _quiet_tune_console() -> Iterator[None]:
    """Tune's console engine prints its heading at every verbosity; its legacy engine
    prints nothing at verbose=0. rlfabric prints its own lines, so the legacy one."""
    before = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["RAY_AIR_NEW_OUTPUT"]
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = before


def _scheduler(config: TuneConfig, spec: ExperimentSpec, env_info: EnvInfo) -> TrialScheduler:
    """ASHA with env frames as time (rungs from grace_frames up to the frame budget), or FIFO."""
    if config.scheduler.name == "fifo":
        return FIFOScheduler()
    budget = spec.stop_conditions(env_info.reward_threshold).env_frames
    grace = config.scheduler.grace_frames
    if budget is None or grace >= budget:
        raise SpecError(
            f"tune.scheduler.grace_frames={grace:,}: asha needs it below the frame budget "
            f"run.stop.env_frames ({budget}), the most frames a trial runs"
        )
    return ASHAScheduler(
        time_attr="env_frames",
        grace_period=grace,
        max_t=budget,
        reduction_factor=config.scheduler.reduction_factor,
    )


def _search_folder(spec: ExperimentSpec) -> Path:
    """`<run.logdir>/<run.name or tune_<env>_<arch>_<algo>_<time>>`, a new folder."""
    name = spec.run.name or (
        f"tune_{spec.env.id.replace('/', '-')}_{spec.arch.name}_{spec.algo.name}_"
        f"{datetime.now():%Y%m%d-%H%M%S}"
    )
    parent = runs_folder(spec.run.logdir)
    folder, suffix = parent / name, 1
    while folder.exists():
        suffix += 1
        folder = parent / f"{name}-{suffix}"
    folder.mkdir(parents=True)
    return folder


def _row(result: tune.Result, keys: list[str], config: TuneConfig) -> dict[str, Any]:
    """A trial's line: searched values, final and best metric, frames, wall time, status."""
    metrics = result.metrics or {}
    history = result.metrics_dataframe
    values = (
        history[config.metric].dropna()
        if history is not None and config.metric in history
        else None
    )
    best = None
    if values is not None and len(values):
        best = float(values.max() if config.mode == "max" else values.min())
    if result.error is not None:
        status = f"error: {str(result.error).strip().splitlines()[-1]}"
    elif "stop_reason" in metrics:  # only the run's own end reports one
        status = f"done: {metrics['stop_reason']}"
    else:
        status = f"stopped by {config.scheduler.name}"
    return {
        "trial": metrics.get("trial_id", Path(result.path).name),
        **{key: (result.config or {}).get(key) for key in keys},
        "final": metrics.get(config.metric),
        "best": best,
        "env_frames": metrics.get("env_frames"),
        "wall_time_s": metrics.get("wall_time_s"),
        "status": status,
    }


def _write_csv(path: Path, rows: list[dict[str, Any]], keys: list[str]) -> None:
    columns = ["trial", *keys, "final", "best", "env_frames", "wall_time_s", "status"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def format_table(rows: list[dict[str, Any]], keys: list[str]) -> str:
    """Plain text columns, one line per trial."""

    def text(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
        return str(value)

    columns = ["trial", *keys, "final", "best", "env_frames", "wall_time_s", "status"]
    cells = [columns] + [[text(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1]
        for line in cells
    )
