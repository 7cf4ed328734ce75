"""Trackers: Weights & Biases and MLflow, beside metrics.jsonl and TensorBoard.

`run.loggers` names them, `run.wandb` and `run.mlflow` hold their options. Each
tracker runs on a thread of its own behind a bounded queue: the driver's report
loop only hands it the interval's record, so a slow or gone server never holds
training up (a full queue drops records, with a warning). A tracker logs

- every metric against `env_frames` (W&B's x-axis metric, MLflow's step);
- the resolved spec, each value with its origin as `rlfabric spec show` gives it,
  as the run's config (W&B: the spec's sections and `provenance`) or params
  (MLflow: `algo.lr` and `provenance.algo.lr`);
- at the run's end, as artifacts: metrics.jsonl, curve.png and spec.yaml, the eval
  videos in the run folder (`rlfabric eval --video`), and the final checkpoint
  when `log_checkpoint` asks for it.

The tracker's run id is kept in the run folder's `trackers.json`, so a resumed
run (`--resume`, `run.resume: auto`, a PBT exploit) continues the same tracker
run; a learner restart goes on in it anyway. A tracker that fails (a broken
package, its server gone, an exception in a call) warns once in run.log and
stops; the run, and everything it writes in its own folder, goes on.

The packages are extras (`pip install 'rlfabric[wandb]'`, `'rlfabric[mlflow]'`),
imported on the tracker's thread, and only when a spec names them;
`check_installed` fails a spec that names a missing one before anything starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rlfabric.errors import SpecError

if TYPE_CHECKING:
    from rlfabric.platform.spec import ExperimentSpec

log = logging.getLogger(__name__)

#: In a run folder (and a search folder): each tracker's run id, to continue it.
TRACKERS_FILE = "trackers.json"
#: Records a tracker's queue holds (about 15 minutes at the default report interval)
#: before it drops new ones.
QUEUE_RECORDS = 1_000
#: Older MLflow servers take params of at most 500 characters (6,000 since MLflow 2).
MLFLOW_PARAM_CHARS = 500
MLFLOW_TAG_CHARS = 5_000
#: Status of a run's end, from its stop reason: MLflow's run status, W&B's exit code.
MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
WANDB_EXIT_CODE = {"finished": 0, "failed": 1, "killed": 130}


def check_installed(loggers: Iterable[str]) -> None:
    """Raise SpecError naming the extra to install for each tracker in `loggers` whose
    package is missing: before any actor starts, not at the first record."""
    missing = [name for name in loggers if name in TRACKERS and not _installed(name)]
    if missing:
        extras = " ".join(f"'rlfabric[{name}]'" for name in missing)
        raise SpecError(
            f"run.loggers names {', '.join(missing)}, not installed here: pip install {extras}"
        )


def _installed(package: str) -> bool:
    if package in sys.modules:  # None there: imports of it are blocked
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def end_status(reason: str) -> str:
    """'finished', 'failed' or 'killed' for a run's stop reason (`Result.stop_reason`)."""
    if reason.startswith("error"):
        return "failed"
    if reason.startswith("interrupted"):
        return "killed"
    return "finished"


@dataclass
class RunFiles:
    """What a tracker logs at a run's end, from the run folder."""

    logdir: Path
    checkpoint: Path | None = None
    #: The run's curve and spec; a search's table, curves and best spec.
    names: tuple[str, ...] = ("metrics.jsonl", "curve.png", "spec.yaml")

    def curve(self) -> list[Path]:
        return [self.logdir / n for n in self.names if (self.logdir / n).is_file()]

    def videos(self) -> list[Path]:
        """The eval videos `rlfabric eval --video` wrote into the run folder."""
        return sorted(p for p in self.logdir.glob("eval_episode.*") if p.suffix in (".gif", ".mp4"))


def nested_provenance(spec: ExperimentSpec) -> dict[str, Any]:
    """The resolved spec's shape (`to_dict`) with each value's origin in its place."""

    def walk(node: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        return {
            key: walk(value, (*path, key))
            if isinstance(value, dict) and value
            else spec.origin((*path, key))
            for key, value in node.items()
        }

    return walk(spec.to_dict(), ())


class Tracker:
    """One tracker's calls, made on its own thread in this order: `start`, then `log`
    and `event` any number of times, then `finish`; `abandon` after a failure."""

    name: ClassVar[str]

    def __init__(self, spec: ExperimentSpec, logdir: Path) -> None:
        self.spec = spec
        self.logdir = logdir

    def start(self, saved: dict[str, Any] | None) -> dict[str, Any]:
        """Open the tracker's run, or reopen `saved` (what an earlier start returned);
        return what trackers.json keeps to reopen it."""
        raise NotImplementedError

    def log(self, record: dict[str, float], env_frames: int) -> None:
        raise NotImplementedError

    def event(self, name: str, details: dict[str, Any], env_frames: int) -> None:
        raise NotImplementedError

    def finish(self, files: RunFiles, status: str) -> None:
        raise NotImplementedError

    def abandon(self) -> None:
        """Best effort after a failure: let go of what the tracker holds."""


class WandbTracker(Tracker):
    """A W&B run per rlfabric run: `wandb.init(id=..., resume="allow")` continues it.

    Each option is the spec's value if set, else wandb's environment variable for it
    (read at each start, not once per process as wandb's own settings are)."""

    name = "wandb"

    def start(self, saved: dict[str, Any] | None) -> dict[str, Any]:
        import wandb

        cfg = self.spec.run.wandb
        env = os.environ
        folder = Path(cfg.dir or env.get("WANDB_DIR") or self.logdir).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        values = self.spec.to_dict()
        self.run = wandb.init(
            project=cfg.project or env.get("WANDB_PROJECT") or "rlfabric",
            entity=cfg.entity or env.get("WANDB_ENTITY"),
            group=cfg.group or env.get("WANDB_RUN_GROUP"),
            tags=cfg.tags or None,
            mode=cfg.mode or env.get("WANDB_MODE") or None,
            dir=str(folder),
            name=self.logdir.name,
            id=saved["id"] if saved else None,
            resume="allow" if saved else None,
            config=None if saved else {**values, "provenance": nested_provenance(self.spec)},
            reinit="create_new",  # a process may hold several (tests, a search's driver)
        )
        if saved:  # a resume keeps the first start's provenance; overrides update values
            self.run.config.update(values, allow_val_change=True)
        # env frames as every metric's x-axis: it goes back after a learner restart, which
        # W&B's own step may not
        self.run.define_metric("env_frames")
        self.run.define_metric("*", step_metric="env_frames")
        return {"id": self.run.id, "project": self.run.project, "url": self.run.url}

    def log(self, record: dict[str, float], env_frames: int) -> None:
        self.run.log({**record, "env_frames": env_frames})

    def event(self, name: str, details: dict[str, Any], env_frames: int) -> None:
        self.run.log({f"event/{name}": 1, "env_frames": env_frames})
        self.run.summary[f"event/{name}/{env_frames}"] = json.dumps(details, default=str)

    def finish(self, files: RunFiles, status: str) -> None:
        import wandb

        run = self.run
        artifacts = [("curve", "curve", files.curve()), ("videos", "video", files.videos())]
        if self.spec.run.wandb.log_checkpoint and files.checkpoint is not None:
            artifacts.append(("checkpoint", "model", [files.checkpoint]))
        for prefix, kind, paths in artifacts:
            if not paths:
                continue
            artifact = wandb.Artifact(f"{prefix}-{run.id}", type=kind)
            for path in paths:
                artifact.add_file(str(path))
            run.log_artifact(artifact)
        run.finish(exit_code=WANDB_EXIT_CODE[status])

    def abandon(self) -> None:
        run = getattr(self, "run", None)
        if run is not None:
            run.finish(exit_code=1)


class MlflowTracker(Tracker):
    """An MLflow run per rlfabric run, through `MlflowClient` (no global active run, so
    runs in one process do not mix); one `log_batch` request per record."""

    name = "mlflow"

    def start(self, saved: dict[str, Any] | None) -> dict[str, Any]:
        cfg = self.spec.run.mlflow
        self.client = mlflow_client(cfg.tracking_uri)
        run = None
        if saved and saved.get("tracking_uri") == self.client.tracking_uri:
            run = _existing_run(self.client, saved["run_id"])
        elif saved:
            log.warning(
                "mlflow: the run's MLflow run %s is on %s, not %s: starting a new run",
                saved.get("run_id"),
                saved.get("tracking_uri"),
                self.client.tracking_uri,
            )
        if run is None:
            tags = {"rlfabric.logdir": str(self.logdir)}
            if cfg.parent_run_id:
                tags["mlflow.parentRunId"] = cfg.parent_run_id  # shown nested under it
            run = self.client.create_run(
                experiment_id(self.client, cfg.experiment), run_name=self.logdir.name, tags=tags
            )
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        log_spec(self.client, self.run_id, self.spec, run.data.params)
        return {
            "run_id": self.run_id,
            "experiment_id": run.info.experiment_id,
            "tracking_uri": self.client.tracking_uri,
        }

    def log(self, record: dict[str, float], env_frames: int) -> None:
        from mlflow.entities import Metric

        # MLflow keeps one of equal (key, value, step, timestamp): records a millisecond
        # apart (an interval's and the final checkpoint's) must not share a timestamp
        now = self._last_ms = max(int(time.time() * 1000), getattr(self, "_last_ms", 0) + 1)
        metrics = [Metric(_key(k), float(v), now, env_frames) for k, v in record.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's most metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def event(self, name: str, details: dict[str, Any], env_frames: int) -> None:
        self.client.log_metric(self.run_id, f"event/{name}", 1.0, step=env_frames)
        text = json.dumps(details, default=str)[:MLFLOW_TAG_CHARS]
        self.client.set_tag(self.run_id, f"event.{name}.{env_frames}", text)

    def finish(self, files: RunFiles, status: str) -> None:
        for path in files.curve():
            self.client.log_artifact(self.run_id, str(path))
        for path in files.videos():
            self.client.log_artifact(self.run_id, str(path), "videos")
        if self.spec.run.mlflow.log_checkpoint and files.checkpoint is not None:
            self.client.log_artifact(self.run_id, str(files.checkpoint), "checkpoints")
        self.client.set_terminated(self.run_id, MLFLOW_STATUS[status])


#: The trackers `run.loggers` may name besides jsonl and tensorboard; the name is also
#: the package to import and the extra that installs it.
TRACKERS: dict[str, type[Tracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker}


# -- MLflow helpers, shared with a search's parent run -----------------------------------


def mlflow_client(tracking_uri: str | None) -> Any:
    """A client of `tracking_uri`; None: MLFLOW_TRACKING_URI, else MLflow's default."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def experiment_id(client: Any, name: str | None) -> str:
    """The id of experiment `name` (None: MLFLOW_EXPERIMENT_NAME, else MLflow's Default),
    created if new; a search's trials may create it at once."""
    from mlflow.exceptions import MlflowException

    name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # created meanwhile by another run
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def _existing_run(client: Any, run_id: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as err:
        if getattr(err, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
            raise
        log.warning("mlflow: run %s of trackers.json is gone: starting a new run", run_id)
        return None


def log_spec(
    client: Any, run_id: str, spec: ExperimentSpec, logged: dict[str, str] | None = None
) -> None:
    """The resolved spec as params, `algo.lr` with its origin as `provenance.algo.lr`.

    MLflow params cannot change: on a resumed run, a param it holds stays, and a value
    given anew (an override on resume) goes to the tag `resumed.<key>` instead."""
    from mlflow.entities import Param, RunTag

    logged = logged or {}
    params, tags = [], []
    for key, value, origin in spec.provenance():
        text = (value if isinstance(value, str) else json.dumps(value))[:MLFLOW_PARAM_CHARS]
        for name, given in ((key, text), (f"provenance.{key}", origin[:MLFLOW_PARAM_CHARS])):
            name = _key(name)
            if name not in logged:
                params.append(Param(name, given))
            elif logged[name] != given and not name.startswith("provenance."):
                tags.append(RunTag(f"resumed.{name}", given))
    entries = [*params, *tags]
    for start in range(0, len(entries), 100):  # MLflow's most params and tags per batch
        chunk = entries[start : start + 100]
        client.log_batch(
            run_id,
            params=[e for e in chunk if isinstance(e, Param)],
            tags=[e for e in chunk if isinstance(e, RunTag)],
        )


def _key(name: str) -> str:
    """A metric or param name MLflow takes: letters, digits, `_ - . / ` and spaces."""
    return re.sub(r"[^\w\-./ ]", "_", name)[:250]


def open_search_run(spec: ExperimentSpec, folder: Path) -> MlflowTracker | None:
    """A search's own MLflow run, named as its folder, with the search's spec as params;
    the trials' runs nest under it. `rlfabric tune --resume` reopens it (the search
    folder's trackers.json). None without mlflow in run.loggers, or with a warning when
    MLflow fails: the trials then log runs of their own, not nested."""
    if "mlflow" not in spec.run.loggers:
        return None
    tracker = MlflowTracker(spec, folder)
    try:
        saved = tracker.start(_read(folder / TRACKERS_FILE).get("mlflow"))
    except Exception as err:
        log.warning("mlflow: the search's run failed to start (%s: %s)", type(err).__name__, err)
        return None
    _write(folder / TRACKERS_FILE, "mlflow", saved)
    return tracker


def close_search_run(
    tracker: MlflowTracker | None, metric: str, best: float | None, status: str
) -> None:
    """The search's table, curves and best spec as artifacts, its best metric, its end."""
    if tracker is None:
        return
    files = RunFiles(
        tracker.logdir, names=("trials.csv", "trials.png", "best_spec.yaml", "spec.yaml")
    )
    try:
        if best is not None:
            tracker.log({f"best_{metric}": best}, 0)
        tracker.finish(files, status)
    except Exception as err:
        log.warning("mlflow: the search's run failed to end (%s: %s)", type(err).__name__, err)


# -- the run's trackers, each on its thread ---------------------------------------------


class _Worker:
    """One tracker on its own thread, its calls in order from a bounded queue."""

    def __init__(self, tracker: Tracker, saved: dict[str, Any] | None, started: Any) -> None:
        self.tracker = tracker
        self.started = started
        self.queue: queue.Queue[tuple[str, tuple[Any, ...]]] = queue.Queue(QUEUE_RECORDS)
        self.failed = False
        self.dropped = 0
        self.queue.put(("start", (saved,)))
        self.thread = threading.Thread(
            target=self._run, name=f"rlfabric-{tracker.name}", daemon=True
        )
        self.thread.start()

    def put(self, call: str, *args: Any) -> None:
        if self.failed:
            return
        try:
            self.queue.put_nowait((call, args))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "%s falls behind: its queue holds %d records, so new ones are dropped "
                    "until it catches up (metrics.jsonl and tensorboard/ keep every record)",
                    self.tracker.name,
                    QUEUE_RECORDS,
                )

    def finish(self, files: RunFiles, status: str, deadline: float) -> None:
        """Ask for the end: the artifacts, the run closed. Waits for room until `deadline`."""
        with contextlib.suppress(queue.Full):  # then the join times out, and says so
            self.queue.put(("finish", (files, status)), timeout=max(0.0, deadline - time.time()))

    def _run(self) -> None:
        while True:
            call, args = self.queue.get()
            if not self.failed:
                try:
                    result = getattr(self.tracker, call)(*args)
                    if call == "start":
                        self.started(self.tracker.name, result)
                except Exception as err:
                    self._fail(call, err)
            if call == "finish":
                return

    def _fail(self, call: str, err: Exception) -> None:
        self.failed = True
        log.warning(
            "%s failed in %s (%s: %s); the run goes on without it (metrics.jsonl and "
            "tensorboard/ keep every record)",
            self.tracker.name,
            call,
            type(err).__name__,
            err,
        )
        with contextlib.suppress(Exception):  # it has failed already: nothing more to say
            self.tracker.abandon()


class Trackers:
    """The trackers `run.loggers` names for one run, each on its own thread.

    `log` and `event` only queue; `close` waits for each tracker's end, at most its
    `close_timeout_s`, and returns a line for each that failed or did not end."""

    def __init__(self, spec: ExperimentSpec, logdir: Path) -> None:
        self.spec = spec
        self.logdir = logdir
        self.path = logdir / TRACKERS_FILE
        self._lock = threading.Lock()
        saved = _read(self.path)
        self.workers = [
            _Worker(TRACKERS[name](spec, logdir), saved.get(name), self._started)
            for name in spec.run.loggers
            if name in TRACKERS
        ]

    def __bool__(self) -> bool:
        return bool(self.workers)

    def log(self, record: dict[str, float]) -> None:
        frames = int(record.get("env_frames", 0))
        for worker in self.workers:
            worker.put("log", record, frames)

    def event(self, name: str, details: dict[str, Any], env_frames: int) -> None:
        for worker in self.workers:
            worker.put("event", name, details, int(env_frames))

    def close(self, checkpoint: Path | None, status: str) -> list[str]:
        files = RunFiles(self.logdir, checkpoint)
        now = time.time()
        deadlines = [now + self._timeout(w.tracker.name) for w in self.workers]
        for worker, deadline in zip(self.workers, deadlines):
            worker.finish(files, status, deadline)
        problems = []
        for worker, deadline in zip(self.workers, deadlines):
            worker.thread.join(max(0.0, deadline - time.time()))
            name = worker.tracker.name
            if worker.thread.is_alive():
                line = (
                    f"{name} did not end within run.{name}.close_timeout_s="
                    f"{self._timeout(name):g}; its last records or files may be missing there"
                )
                log.warning("%s", line)
                problems.append(line)
            elif worker.failed:
                problems.append(f"{name} failed during the run: see run.log")
            if worker.dropped:
                problems.append(
                    f"{name} dropped {worker.dropped} records it could not keep up with"
                )
        return problems

    def _timeout(self, name: str) -> float:
        return getattr(self.spec.run, name).close_timeout_s

    def _started(self, name: str, saved: dict[str, Any]) -> None:
        """Keep a tracker's run id in trackers.json (written whole, then renamed)."""
        with self._lock:
            _write(self.path, name, saved)
        where = saved.get("url") or saved.get("run_id") or saved.get("id")
        log.info("%s: run %s (%s)", name, where, TRACKERS_FILE)


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as err:
        log.warning("%s is unreadable (%s): trackers start new runs", path, err)
        return {}


def _write(path: Path, name: str, saved: dict[str, Any]) -> None:
    """Set one tracker's entry of trackers.json (written whole, then renamed)."""
    data = _read(path)
    data[name] = saved
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
