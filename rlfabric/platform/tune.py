"""Hyperparameter search on Ray Tune: each trial is one ordinary rlfabric run.

    rlfabric tune SPEC.yaml [section.field=value ...]
    rlfabric tune --resume SEARCH_DIR
    Platform.from_yaml("spec.yaml").tune()

The spec's `tune` section names the searched fields, the metric and the
scheduler. A trial is `Platform(spec).fit()` in a Tune trainable, writing
the usual run folder (`<run.logdir>/<search name>/<trial id>/`); it reports
each interval's record to Tune with env frames as Tune's time, and a trial
the scheduler stops ends as a stop condition ends a run: final checkpoint,
every actor stopped. Each trial asks Tune for a placement group holding what
its run places (the learner's and env runners' CPUs and GPUs; the trial's
own driver takes nothing), so trials pack onto a laptop with fractional
CPUs and spread over a cluster.

Population-based training saves a trial by asking its run for a checkpoint
(hard-linked into Tune's checkpoint, with the trial's id and values beside
it); an exploit restores another trial's into the trial's run folder, which
goes on from it with the perturbed values. `lineage.jsonl` in each trial's run
folder holds its values at the start and after each exploit, with what it copied.

Ctrl-C or SIGTERM writes `STOP` into the search folder: every running trial
ends its run at its next interval with a final checkpoint, then Tune saves
its state; `--resume` goes on, each unfinished trial from its run's newest
checkpoint, and runs no finished trial again. At the end the search folder
holds `trials.csv`, `trials.png` (every trial's curve; PBT's exploits
marked), `best_spec.yaml` (a spec `rlfabric train` runs as it is), the
search's own `spec.yaml`, and Tune's records under `ray_tune/`.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import itertools
import json
import logging
import math
import os
import queue
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.schedulers import (
    ASHAScheduler,
    FIFOScheduler,
    PopulationBasedTraining,
    TrialScheduler,
)
from ray.tune.search import BasicVariantGenerator

from rlfabric.architectures import ARCHITECTURES
from rlfabric.architectures.runner_pool import max_runners
from rlfabric.architectures.topology import learner_gpus
from rlfabric.envs import EnvInfo, ensure_registered
from rlfabric.errors import SpecError
from rlfabric.platform.facade import Platform, Result, check_spec, runs_folder
from rlfabric.platform.ray_setup import init_ray
from rlfabric.platform.reporting import read_records
from rlfabric.platform.spec import ExperimentSpec, TuneConfig, set_dotted
from rlfabric.platform.trackers import close_search_run, end_status, open_search_run

#: Tune's own records (experiment state, per-trial result files), inside the search folder.
TUNE_RECORDS = "ray_tune"
#: The search's spec, tune section included: what `--resume` builds the search from.
SEARCH_SPEC = "spec.yaml"
#: Written by Ctrl-C or SIGTERM: each trial's run ends at its next interval.
STOP_FILE = "STOP"
#: In a trial's run folder: its values at the start, then one line per PBT exploit.
LINEAGE = "lineage.jsonl"
#: In a trial's run folder while its run is not going (ended, paused, or not yet started again).
ENDED = ".ended"
#: Beside the run's checkpoint in a Tune checkpoint: whose it is, at which values.
SOURCE = "rlfabric_source.json"
#: Seconds an interrupted search waits for its trials' final checkpoints.
STOP_WAIT_S = 300.0
#: Seconds a restored trial waits for its previous actor's run to end.
PREVIOUS_RUN_WAIT_S = 60.0

_SAMPLERS = {
    "uniform": lambda v: tune.uniform(*v),
    "loguniform": lambda v: tune.loguniform(*v),
    "randint": lambda v: tune.randint(*v),
    "choice": lambda v: tune.choice(list(v)),
    "grid": lambda v: tune.grid_search(list(v)),
}


@dataclass
class TuneResult:
    """What a finished (or interrupted) search hands back."""

    best_spec: ExperimentSpec | None  # None: no trial reported the metric
    best_metric: float | None  # the best trial's final value of the metric
    rows: list[dict[str, Any]]  # one per trial, as in trials.csv
    logdir: str
    search_keys: list[str] = field(default_factory=list)
    interrupted: bool = False  # Ctrl-C or SIGTERM: `rlfabric tune --resume logdir` goes on

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
    mode: str = "max"
    mlflow_parent: str | None = None  # the search's own MLflow run, the trials' nest under it

    @property
    def worst(self) -> float:
        """The metric of a run that ended before reporting it: it ranks last."""
        return -math.inf if self.mode == "max" else math.inf

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
        # resume auto: a trial started again (`--resume`) goes on from its newest checkpoint
        run.update(name=trial_id, logdir=str(self.folder), resume="auto", display="none")
        probe = ExperimentSpec.build(data)
        # one tracker run per trial, grouped under the search
        if "wandb" in probe.run.loggers and probe.run.wandb.group is None:
            run.setdefault("wandb", {})["group"] = self.folder.name
        if self.mlflow_parent is not None and probe.run.mlflow.parent_run_id is None:
            run.setdefault("mlflow", {})["parent_run_id"] = self.mlflow_parent
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

    The run starts at the first `step`, after Tune's `load_checkpoint` if any (a
    PBT exploit). A trial the scheduler stops or pauses gets `cleanup`, which asks
    the run to stop at its next interval and waits for its final checkpoint (a
    function trainable's thread would be killed with its actor instead).
    """

    def setup(self, config: dict[str, Any], plan: _Plan) -> None:
        ensure_registered(plan.env_info)  # an env the user registered in the driver
        self.plan = plan
        self.run_folder = plan.folder / self.trial_id
        self.spec = plan.spec(config, self.trial_id)
        self.platform: Platform | None = None
        self.result: Result | None = None
        self.start_from: Path | None = None  # a donor's checkpoint: a PBT exploit
        self.exploit: dict[str, Any] | None = None  # its lineage line, for the trackers
        self.records: queue.Queue[dict[str, Any] | BaseException] = queue.Queue()
        self.pending: dict[str, Any] | None = None  # the record after the one Tune has
        self.stop_asked = threading.Event()
        self.interrupted = False
        self.thread: threading.Thread | None = None

    def _start(self) -> None:
        if self.start_from is not None:  # the donor's weights, this trial's values
            (self.run_folder / "spec.yaml").write_text(self.spec.to_yaml())
            self.platform = Platform.resume(self.run_folder, checkpoint=self.start_from)
            if self.exploit is not None:
                self.platform.log_event("pbt_exploit", self.exploit)
        else:
            self.platform = Platform(self.spec)
            if not (self.run_folder / LINEAGE).exists():
                self._lineage({"env_frames": 0, "config": dict(self.config)})
        (self.run_folder / ENDED).unlink(missing_ok=True)
        self.thread = threading.Thread(target=self._fit, name="rlfabric-trial", daemon=True)
        self.thread.start()

    def _fit(self) -> None:
        assert self.platform is not None
        try:
            self.result = self.platform.fit(on_record=self._on_record)
            if not self.interrupted:  # an interrupted trial stays unfinished for --resume
                self.records.put({"done": True, "stop_reason": self.result.stop_reason})
        except BaseException as err:  # handed to Tune by `step`: the trial's error
            self.records.put(err)
        finally:
            self.run_folder.mkdir(parents=True, exist_ok=True)
            (self.run_folder / ENDED).touch()

    def _on_record(self, metrics: dict[str, float]) -> str:
        # Tune refuses a result without the metric (a return mean before any episode ends)
        if self.plan.metric in metrics:
            finite = {k: v for k, v in metrics.items() if _finite(v)}
            self.records.put(finite)
        if (self.plan.folder / STOP_FILE).exists():
            self.interrupted = True
            return "search interrupted (Ctrl-C or SIGTERM); `rlfabric tune --resume` goes on"
        return "stopped by the search's scheduler" if self.stop_asked.is_set() else ""

    def step(self) -> dict[str, Any]:
        """The next record, handed over once the one after it (or the run's end) is in:
        the run's last record then goes to Tune marked done, with the run's stop reason,
        before the scheduler can take the run's own end (at its frame budget) for its
        decision to stop the trial."""
        if self.thread is None:
            self._start()
        record = self.pending if self.pending is not None else self._next()
        if record.get("done"):  # the run ended before handing Tune a record with the metric
            return self._final(record)
        following = self._next()
        if following.get("done"):
            self.pending = None
            return {**record, **following}
        self.pending = following
        return record

    def _final(self, done: dict[str, Any]) -> dict[str, Any]:
        """The end of a run that reported nothing to Tune: its last metrics (a run resumed
        at its budget trains nothing and ends at once), the metric at last place if it
        never had one; Tune's schedulers need the metric and env frames in every result."""
        last = self.result.metrics if self.result is not None else {}
        result = {k: v for k, v in last.items() if _finite(v)}
        result.setdefault(self.plan.metric, self.plan.worst)
        result.setdefault("env_frames", 0)
        return {**result, **done}

    def _next(self) -> dict[str, Any]:
        item = self.records.get()  # after an interruption: never, until Tune ends the actor
        if isinstance(item, BaseException):
            raise item
        return item

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """The run's checkpoint at its next interval (its final one if it has ended),
        hard-linked into Tune's checkpoint with whose it is and at which values."""
        assert self.platform is not None and self.thread is not None
        asked = self.platform.checkpoint_soon()
        path: Path | None = None
        while path is None:
            try:
                path = asked.result(timeout=1.0)
            except FutureTimeout:
                if not self.thread.is_alive():  # ended before it saw the request
                    if self.result is None or self.result.checkpoint is None:
                        raise RuntimeError("the trial's run ended without a checkpoint") from None
                    path = Path(self.result.checkpoint)
        target = Path(checkpoint_dir)
        for file in _checkpoint_files(path):
            _link(file, target / file.name)
        frames = int(path.name.removeprefix("ckpt_").removesuffix(".pt"))
        source = {"trial": self.trial_id, "checkpoint": path.name, "env_frames": frames}
        (target / SOURCE).write_text(json.dumps({**source, "config": self.config}))

    def load_checkpoint(self, checkpoint: str) -> None:
        """Its own checkpoint: nothing to do, the run goes on from its newest (run.resume
        auto). Another trial's (a PBT exploit): it replaces this trial's checkpoints, and
        the run starts from it with this trial's new values; `lineage.jsonl` says so."""
        folder = Path(checkpoint)
        source = json.loads((folder / SOURCE).read_text())
        self._wait_for_previous_run()
        copied = (_exploits(self.run_folder) or [{}])[-1]
        if source["trial"] == self.trial_id or (
            (copied.get("donor"), copied.get("checkpoint"))
            == (source["trial"], source["checkpoint"])
        ):  # its own, or the exploit it went on from before `--resume`
            return
        own = self.run_folder / "checkpoints"
        own.mkdir(parents=True, exist_ok=True)
        for old in own.glob("ckpt_*"):
            old.unlink()
        donor = folder / source["checkpoint"]
        for file in _checkpoint_files(donor):
            _link(file, own / file.name)
        self.start_from = own / donor.name
        self.exploit = {
            "donor": source["trial"],
            "checkpoint": source["checkpoint"],
            "env_frames": source["env_frames"],
            "donor_config": source["config"],
            "config": dict(self.config),
            # where the run's records go on from the donor's frames (for the curves)
            "records_before": len(read_records(self.run_folder / "metrics.jsonl")),
        }
        self._lineage(self.exploit)

    def _lineage(self, line: dict[str, Any]) -> None:
        self.run_folder.mkdir(parents=True, exist_ok=True)
        line = {"time": datetime.now().isoformat(timespec="seconds"), **line}
        with (self.run_folder / LINEAGE).open("a") as f:
            f.write(json.dumps(line) + "\n")

    def _wait_for_previous_run(self) -> None:
        """A paused trial's previous actor may still be writing its final checkpoint (one
        that died never says it ended: its newest checkpoint is then what there is)."""
        if not (self.run_folder / "spec.yaml").is_file():
            return
        deadline = time.monotonic() + PREVIOUS_RUN_WAIT_S
        while not (self.run_folder / ENDED).exists() and time.monotonic() < deadline:
            time.sleep(0.2)

    def cleanup(self) -> None:
        self.stop_asked.set()
        if self.thread is not None:
            self.thread.join()


def _exploits(run_folder: Path) -> list[dict[str, Any]]:
    """The lineage lines of a trial's PBT exploits (the first line is its start)."""
    return [line for line in read_records(run_folder / LINEAGE) if "donor" in line]


def _checkpoint_files(checkpoint: Path) -> list[Path]:
    """A checkpoint and the replay contents beside it, if any."""
    return [checkpoint, *checkpoint.parent.glob(f"{checkpoint.stem}-*.replay.npz")]


def _link(source: Path, target: Path) -> None:
    """A hard link (no copy of a replay buffer), a copy across file systems."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def run_search(spec: ExperimentSpec, env_info: EnvInfo) -> TuneResult:
    """Run the search the spec's `tune` section describes, in a new search folder."""
    if spec.tune is None:
        raise SpecError("the spec has no tune section: nothing to search (see `tune:` in --help)")
    _scheduler(spec.tune, spec, env_info)  # a bad scheduler fails before Ray starts
    folder = _search_folder(spec)
    (folder / SEARCH_SPEC).write_text(spec.to_yaml())
    return _search(spec, env_info, folder, resume=False)


def resume_search(folder: str | Path, address: str | None = None) -> TuneResult:
    """Go on with an interrupted search: unfinished trials from their runs' newest
    checkpoints, trials not yet started, none of the finished ones again."""
    folder = Path(folder)
    if not (folder / TUNE_RECORDS).is_dir() or not (folder / SEARCH_SPEC).is_file():
        raise SpecError(
            f"{str(folder)!r} is not a search folder: it needs {SEARCH_SPEC} and {TUNE_RECORDS}/"
        )
    overrides = [f"resources.address={address}"] if address else []
    spec = ExperimentSpec.from_yaml(folder / SEARCH_SPEC, overrides)
    env_info = check_spec(spec)
    (folder / STOP_FILE).unlink(missing_ok=True)
    return _search(spec, env_info, folder, resume=True)


def _search(spec: ExperimentSpec, env_info: EnvInfo, folder: Path, resume: bool) -> TuneResult:
    """Start Ray if needed, run (or restore) the Tuner, then write trials.csv,
    trials.png and best_spec.yaml."""
    config = spec.tune
    assert config is not None
    base = spec.user_values()
    base.pop("tune", None)
    scheduler = _scheduler(config, spec, env_info)
    trials = config.num_samples * math.prod(
        len(d.value) for d in config.search.values() if d.kind == "grid"
    )
    budget = spec.stop_conditions(env_info.reward_threshold).env_frames
    search_run = open_search_run(spec, folder)
    started_ray = init_ray(spec.resources)
    try:
        at_once = min(trials, config.max_concurrent_trials or trials)
        cpus = ray.cluster_resources()["CPU"] / at_once
        parent = search_run.run_id if search_run is not None else None
        plan = _Plan(base, folder, config.metric, cpus, env_info, config.mode, parent)
        trainable = tune.with_resources(tune.with_parameters(_Trial, plan=plan), plan.placement)
        display = _Display(config, trials, budget, spec.run.display)
        if resume:
            tuner = tune.Tuner.restore(
                str(folder / TUNE_RECORDS), trainable, resume_unfinished=True, resume_errored=True
            )
        else:
            tuner = tune.Tuner(
                trainable,
                param_space={k: _SAMPLERS[d.kind](d.value) for k, d in config.search.items()},
                tune_config=tune.TuneConfig(
                    metric=config.metric,
                    mode=config.mode,
                    scheduler=scheduler,
                    # Tune applies max_concurrent_trials only to the searcher it makes;
                    # 0 (no limit of its own) unless the user set one
                    search_alg=BasicVariantGenerator(
                        max_concurrent=config.max_concurrent_trials or 0,
                        random_state=config.seed,
                    ),
                    num_samples=config.num_samples,
                    max_concurrent_trials=at_once,
                    reuse_actors=False,  # an exploit starts the trial's run anew
                ),
                run_config=tune.RunConfig(
                    name=TUNE_RECORDS,
                    storage_path=str(folder),
                    verbose=0,
                    log_to_file=True,
                    callbacks=[display],
                    # Tune checkpoints only what PBT asks for; a trial's own are its run's.
                    checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False),
                ),
            )
        with _quiet_tune_console(), _stoppable(folder), warnings.catch_warnings():
            # PBT without reused actors is by design: an exploit starts the run anew.
            warnings.filterwarnings("ignore", message=".*reuse_actors.*")
            grid = tuner.fit()
    except BaseException as err:
        failed = "interrupted" if isinstance(err, KeyboardInterrupt) else "error"
        close_search_run(search_run, config.metric, None, end_status(failed))
        raise
    finally:
        if started_ray:
            ray.shutdown()
    interrupted = (folder / STOP_FILE).exists()
    keys = list(config.search)
    rows = [_row(result, keys, config, folder, interrupted) for result in grid]
    _write_csv(folder / "trials.csv", rows, keys)
    plot_trials(folder, rows, config.metric)
    ranked = [r for r in rows if r["final"] is not None]
    sign = 1 if config.mode == "max" else -1
    best = max(ranked, key=lambda r: sign * r["final"]) if ranked else None
    best_spec = None
    if best is not None:
        best_spec = plan.spec({k: best[k] for k in keys})
        (folder / "best_spec.yaml").write_text(best_spec.to_yaml())
    best_metric = best["final"] if best else None
    status = end_status("interrupted" if interrupted else "")
    close_search_run(search_run, config.metric, best_metric, status)
    return TuneResult(best_spec, best_metric, rows, str(folder), keys, interrupted)


@contextlib.contextmanager
def _stoppable(folder: Path) -> Iterator[None]:
    """Ctrl-C or SIGTERM: `STOP` into the search folder, so that each trial's run ends
    with a final checkpoint; once they have (or after STOP_WAIT_S), Tune is told to
    save its state and end (its SIGUSR1). A second Ctrl-C ends at once. Tune's own
    SIGINT handler is off: it gives trials 5 s, less than a checkpoint may take."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only; a search from a thread is not stoppable
        return
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    env_before = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: now
        if (folder / STOP_FILE).exists():  # SIGTERM after Ctrl-C: already stopping
            return
        (folder / STOP_FILE).touch()
        print(
            "stopping the search: each running trial writes its final checkpoint "
            "(Ctrl-C again to end now)",
            file=sys.stderr,
        )
        threading.Thread(target=_end_when_trials_stopped, args=(folder,), daemon=True).start()

    for sig in before:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        if env_before is None:
            del os.environ["TUNE_DISABLE_SIGINT_HANDLER"]
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = env_before


def _end_when_trials_stopped(folder: Path) -> None:
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        running = [
            d
            for d in folder.iterdir()
            if (d / "spec.yaml").is_file() and d.name != TUNE_RECORDS and not (d / ENDED).exists()
        ]
        if not running:
            break
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGUSR1)  # Tune's handler: save the experiment's state, end


@contextlib.contextmanager
def _quiet_tune_console() -> Iterator[None]:
    """Tune's console engine prints its heading at every verbosity; its legacy engine
    prints nothing at verbose=0. rlfabric prints its own lines, so the legacy one."""
    before = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    # Its interrupt warnings name Tuner.restore; rlfabric names `rlfabric tune --resume`.
    tune_log = logging.getLogger("ray.tune.tune")
    level = tune_log.level
    tune_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tune_log.setLevel(level)
        if before is None:
            del os.environ["RAY_AIR_NEW_OUTPUT"]
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = before


def _scheduler(config: TuneConfig, spec: ExperimentSpec, env_info: EnvInfo) -> TrialScheduler:
    """ASHA or PBT with env frames as time (up to the frame budget), or FIFO."""
    name = config.scheduler.name
    if name == "fifo":
        return FIFOScheduler()
    budget = spec.stop_conditions(env_info.reward_threshold).env_frames
    field_name, frames = (
        ("grace_frames", config.scheduler.grace_frames)
        if name == "asha"
        else ("perturbation_frames", config.scheduler.perturbation_frames)
    )
    if budget is None or frames >= budget:
        raise SpecError(
            f"tune.scheduler.{field_name}={frames:,}: {name} needs it below the frame budget "
            f"run.stop.env_frames ({budget}), the most frames a trial runs"
        )
    if name == "asha":
        return ASHAScheduler(
            time_attr="env_frames",
            grace_period=frames,
            max_t=budget,
            reduction_factor=config.scheduler.reduction_factor,
        )
    return _PBT(
        time_attr="env_frames",
        perturbation_interval=frames,
        hyperparam_mutations={
            key: list(d.value) if d.kind in ("choice", "grid") else _SAMPLERS[d.kind](d.value)
            for key, d in config.search.items()
        },
        quantile_fraction=config.scheduler.quantile_fraction,
        resample_probability=config.scheduler.resample_probability,
        synch=config.scheduler.synch,
        custom_explore_fn=lambda values: _within_bounds(values, config),
        log_config=False,  # the lineage goes to each trial's run folder
    )


class _PBT(PopulationBasedTraining):
    """Ray's PBT, with its synchronous mode unable to stall.

    After a synchronous perturbation Ray sets the next sync point to the furthest trial's
    frames when that trial went past one interval (frames arrive per report, not per
    frame), and a trial that exploited it takes its frames too. Then every paused trial
    stands at the sync point and none is below it, which is what Ray requires to run one
    again: the search waited forever with all trials paused (seen in the test suite).
    Here, when nothing runs and no paused trial qualifies, the sync point moves just past
    the paused trials, so they go on and meet at the next interval as usual.
    """

    def choose_trial_to_run(self, tune_controller: Any) -> Any:
        trial = super().choose_trial_to_run(tune_controller)
        if trial is not None or not self._synch:
            return trial
        trials = tune_controller.get_trials()
        waiting = [t for t in trials if t.status in (t.PENDING, t.PAUSED)]
        if not waiting or any(t.status == t.RUNNING for t in trials):
            return None  # the running trials will reach the sync point
        self._next_perturbation_sync = 1 + max(
            self._trial_state[t].last_train_time for t in waiting
        )
        return super().choose_trial_to_run(tune_controller)


def _within_bounds(values: dict[str, Any], config: TuneConfig) -> dict[str, Any]:
    """PBT's explore scales values by 0.8 or 1.2; keep each in its searched range, which
    is what the user allowed (and what the field accepts)."""
    for key, distribution in config.search.items():
        if distribution.kind in ("uniform", "loguniform", "randint") and key in values:
            low, high = distribution.value
            top = high - 1 if distribution.kind == "randint" else high
            values[key] = type(values[key])(min(max(values[key], low), top))
    return values


class _Display(tune.Callback):
    """The search's live lines: trials running, done and waiting, the best so far, and
    the time left at most (every trial run to its frame budget)."""

    def __init__(self, config: TuneConfig, trials: int, budget: int | None, display: str) -> None:
        self.metric, self.mode = config.metric, config.mode
        self.trials, self.budget = trials, budget
        self.show = display != "none"
        self.every_s = (
            2.0 if display == "rich" or (display == "auto" and sys.stderr.isatty()) else 10.0
        )
        self.started = time.monotonic()
        self.last_line = 0.0
        self.best: tuple[float, str] | None = None
        self.frames: dict[str, float] = {}

    def setup(self, **info: Any) -> None:
        self.started = self.last_line = time.monotonic()  # also when `--resume` restores it

    def on_trial_result(
        self, iteration: int, trials: list, trial: Any, result: dict, **info: Any
    ) -> None:
        self.frames[trial.trial_id] = result.get("env_frames", 0.0)
        value = result.get(self.metric)
        if _finite(value) and (self.best is None or (value > self.best[0]) == (self.mode == "max")):
            self.best = (value, trial.trial_id)

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        now = time.monotonic()
        if not self.show or now - self.last_line < self.every_s:
            return
        self.last_line = now
        print(self.line(trials, now - self.started), file=sys.stderr, flush=True)

    def line(self, trials: list, elapsed: float) -> str:
        states = [t.status for t in trials]
        paused = f"{states.count('PAUSED')} paused, " if "PAUSED" in states else ""
        parts = [
            f"search {_clock(elapsed)}",
            f"trials: {states.count('RUNNING')} running, {paused}"
            f"{states.count('TERMINATED') + states.count('ERROR')} done, "
            f"{max(0, self.trials - len(trials)) + states.count('PENDING')} waiting",
        ]
        if self.best is not None:
            parts.append(f"best {self.metric} {self.best[0]:.4g} ({self.best[1]})")
        done = sum(self.frames.values())
        if self.budget and done > 0:
            total = self.budget * self.trials
            parts.append(f"at most ~{_clock(elapsed * max(0.0, total - done) / done)} left")
        return " | ".join(parts)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m{secs:02d}s"


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


def _row(
    result: tune.Result, keys: list[str], config: TuneConfig, folder: Path, interrupted: bool
) -> dict[str, Any]:
    """A trial's line: searched values (PBT: its last), final and best metric, frames,
    wall time, status, and PBT's exploits."""
    metrics = result.metrics or {}
    history = result.metrics_dataframe
    values = (
        [float(v) for v in history[config.metric] if _finite(float(v))]
        if history is not None and config.metric in history
        else []
    )
    best = (max if config.mode == "max" else min)(values) if values else None
    final = metrics.get(config.metric)
    trial = metrics.get("trial_id", Path(result.path).name)
    if result.error is not None:
        status = f"error: {str(result.error).strip().splitlines()[-1]}"
    elif "stop_reason" in metrics:  # only the run's own end reports one
        status = f"done: {metrics['stop_reason']}"
    elif interrupted:
        status = "interrupted"
    else:
        status = f"stopped by {config.scheduler.name}"
    row = {
        "trial": trial,
        **{key: (result.config or {}).get(key) for key in keys},
        "final": final if _finite(final) else None,
        "best": best,
        "env_frames": metrics.get("env_frames"),
        "wall_time_s": metrics.get("wall_time_s"),
        "status": status,
    }
    if config.scheduler.name == "pbt":
        row["exploits"] = len(_exploits(folder / trial))
    return row


def _columns(rows: list[dict[str, Any]], keys: list[str]) -> list[str]:
    extra = ["exploits"] if rows and "exploits" in rows[0] else []
    return ["trial", *keys, "final", "best", "env_frames", "wall_time_s", *extra, "status"]


def _write_csv(path: Path, rows: list[dict[str, Any]], keys: list[str]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_columns(rows, keys))
        writer.writeheader()
        writer.writerows(rows)


def plot_trials(folder: Path, rows: list[dict[str, Any]], metric: str) -> Path:
    """Every trial's metric against env frames in `trials.png`; a PBT exploit is an x
    where the trial went on from its donor's checkpoint."""
    from matplotlib.figure import Figure  # no pyplot: no global backend switch

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for index, row in enumerate(rows):
        records = read_records(folder / row["trial"] / "metrics.jsonl")
        exploits = _exploits(folder / row["trial"])
        # One segment per stretch of the run: an exploit goes on from the donor's frames.
        cuts = [0, *(e["records_before"] for e in exploits), len(records)]
        color = f"C{index % 10}"
        for segment, (start, end) in enumerate(itertools.pairwise(cuts)):
            points = [(r["env_frames"], r[metric]) for r in records[start:end] if metric in r]
            if not points:
                continue
            label = row["trial"] if segment == 0 else None
            ax.plot(*zip(*points), color=color, label=label, linewidth=1.2)
            if segment > 0:  # where the exploited trial went on
                ax.plot(*points[0], marker="x", markersize=8, color=color)
    ax.set_xlabel("env frames")
    ax.set_ylabel(metric)
    ax.set_title(
        f"{folder.name}: {len(rows)} trials"
        + (" (x: PBT exploit)" if rows and "exploits" in rows[0] else "")
    )
    ax.grid(alpha=0.3)
    if len(rows) <= 12:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = folder / "trials.png"
    fig.savefig(path, dpi=100)
    return path


def format_table(rows: list[dict[str, Any]], keys: list[str]) -> str:
    """Plain text columns, one line per trial."""

    def text(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
        return str(value)

    columns = _columns(rows, keys)
    cells = [columns] + [[text(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1]
        for line in cells
    )
