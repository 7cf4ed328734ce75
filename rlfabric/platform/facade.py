"""Platform: the user's entry point. Spec in, trained run (Result) out.

    Platform(arch="seed", algo="vtrace", env="CartPole-v1").fit()

`fit()` checks the spec against the env before anything starts, creates the
run's logdir (spec.yaml, metrics.jsonl, tensorboard/, curve.png,
checkpoints/), starts Ray if the architecture needs it, and runs report
intervals until a stop condition holds. When the learner's process dies (or a
data-parallel learner's, or the replay actor's), it stops what is left and
starts the topology again from the run's newest checkpoint, up to
`run.max_learner_restarts` times. On the way out, also on Ctrl-C or an error,
it writes a final checkpoint and stops every process it started.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gymnasium
import ray

from rlfabric.algorithms import ALGORITHMS
from rlfabric.architectures import ARCHITECTURES, Architecture
from rlfabric.envs import EnvInfo, describe_env
from rlfabric.errors import ActorError, CheckpointError, SpecError
from rlfabric.models import ActorCritic, UnsupportedSpaceError
from rlfabric.platform.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    newest_checkpoint,
    replay_target,
    save_checkpoint,
)
from rlfabric.platform.evaluate import evaluate
from rlfabric.platform.ray_setup import init_ray, sigterm_as_interrupt
from rlfabric.platform.reporting import Reporter, read_records
from rlfabric.platform.spec import ExperimentSpec, StopConfig
from rlfabric.platform.trackers import TRACKERS_FILE, Trackers, check_installed, end_status
from rlfabric.runtime.learner import make_algorithm

if TYPE_CHECKING:
    from rlfabric.platform.tune import TuneResult

log = logging.getLogger(__name__)

SECTIONS = ("env", "arch", "algo", "model", "sparse", "resources", "run", "tune")


@dataclass
class Result:
    """What a finished run hands back."""

    metrics: dict[str, float]  # the latest value of every metric reported
    checkpoint: str | None
    logdir: str
    stop_reason: str = ""
    curve: str | None = None
    target: TargetHit | None = None  # when the return target was first reached, if it was

    @property
    def final_return_mean(self) -> float | None:
        """The training return mean over the last run.return_window episodes at the end."""
        return self.metrics.get("episode_return_mean")


@dataclass
class TargetHit:
    """The first time the training return mean reached its target (a full window).

    A run that reaches its target and then falls back shows both numbers: the
    first hit here and the final mean in `Result.final_return_mean`.
    """

    target: float | None  # stop.episode_return_mean, else the env's reward_threshold
    env_frames: float | None = None
    wall_time_s: float | None = None

    def observe(self, metrics: dict[str, float], window: int) -> None:
        mean = metrics.get("episode_return_mean")
        if self.target is None or self.env_frames is not None or mean is None:
            return
        if mean >= self.target and metrics.get("episodes", 0) >= window:
            self.env_frames = metrics.get("env_frames")
            self.wall_time_s = metrics.get("wall_time_s")

    def saved(self) -> tuple[float | None, float | None, float | None]:
        """What a checkpoint keeps (plain numbers, for `torch.load(weights_only=True)`)."""
        return self.target, self.env_frames, self.wall_time_s

    def restore(self, saved: tuple[float | None, ...] | None) -> None:
        """Take a saved first hit, unless it was for another target (a resume can change it)."""
        if saved is not None and saved[0] == self.target:
            _, self.env_frames, self.wall_time_s = saved

    def describe(self, final: float | None, window: int) -> str:
        text = f"return:     {final:.2f} (last {window} episodes)" if final is not None else ""
        if self.target is None:
            return text
        if self.env_frames is None:
            return f"{text}; target {self.target} not reached"
        return (
            f"{text}; target {self.target} first reached at {self.env_frames:,.0f} env "
            f"frames, {self.wall_time_s:.1f} s"
        )


def register_env_creator(creator: Callable[..., gymnasium.Env]) -> str:
    """Register an env creator (a class or a function returning an env) under an id of
    its own name, and return the id. Env runners get the registration with the env's
    description (`EnvInfo.registration`): a creator defined in an importable module
    travels by reference, one defined in the driver's `__main__` by value."""
    env_id = f"{creator.__module__}.{creator.__qualname__}".replace("<", "").replace(">", "")
    gymnasium.register(env_id, entry_point=creator)
    return env_id


def check_spec(spec: ExperimentSpec) -> EnvInfo:
    """Checks that need the env's spaces (and the trackers' packages); raise SpecError
    before anything starts."""
    check_installed(spec.run.loggers)
    env_info = describe_env(spec.env)
    algo_cls = ALGORITHMS[spec.algo.name]
    arch_cls = ARCHITECTURES[spec.arch.name]
    try:
        algo_cls.check_spaces(env_info.observation_space, env_info.action_space)
        algo_cls.check_model(spec.model)
        ActorCritic(env_info.observation_space, env_info.action_space, spec.model)
        if spec.sparse.enabled:  # roles and t_end: the learner builds it the same way
            budget = spec.stop_conditions(env_info.reward_threshold).env_frames
            make_algorithm(spec, env_info, budget)
    except (ValueError, UnsupportedSpaceError) as err:
        raise SpecError(f"{spec.env.id} with algo '{spec.algo.name}': {err}") from None
    learners = spec.resources.num_learners
    if learners > 1:
        if not arch_cls.uses_ray:
            raise SpecError(
                f"resources.num_learners={learners} needs a Ray architecture; arch "
                f"'{spec.arch.name}' runs in one process (allowed: 1)"
            )
        if spec.algo.batch_size % learners:
            raise SpecError(
                f"algo.batch_size={spec.algo.batch_size} does not split into "
                f"resources.num_learners={learners} equal shards; use a multiple of {learners}"
            )
    if spec.resources.replay_actor and not arch_cls.uses_ray:
        raise SpecError(
            f"resources.replay_actor=true needs a Ray architecture; arch '{spec.arch.name}' "
            "runs in one process (allowed: false)"
        )
    if algo_cls.data not in arch_cls.data_kinds:
        raise SpecError(
            f"arch '{spec.arch.name}' cannot feed algorithm '{spec.algo.name}' "
            f"({algo_cls.data} data); it feeds: {', '.join(arch_cls.data_kinds)}"
        )
    return env_info


class _Evaluator:
    """Periodic evaluation in the driver: the policy's current weights on fresh envs."""

    def __init__(self, spec: ExperimentSpec, env_info: EnvInfo) -> None:
        self.spec = spec
        self.algorithm = make_algorithm(spec, env_info, None, sparse=False)

    def __call__(self, weights: dict[str, Any]) -> dict[str, float]:
        self.algorithm.set_weights(weights)
        result = evaluate(self.algorithm, self.spec.env, self.spec.run.eval_episodes)
        return {"eval_return_mean": result.mean, "eval_return_std": result.std}


class Platform:
    """Build from a spec object, keyword sections, or a YAML file; then `fit()`."""

    def __init__(
        self,
        spec: ExperimentSpec | dict[str, Any] | None = None,
        *,
        overrides: list[str] | None = None,
        **sections: Any,
    ) -> None:
        unknown = set(sections) - set(SECTIONS)
        if unknown:
            raise SpecError(
                f"unknown spec section(s) {sorted(unknown)}; allowed: {', '.join(SECTIONS)}"
            )
        # A spec object's own values, not its resolved ones: presets fill the rest again,
        # and a search of `arch.name` or `algo.name` gets each name's fields.
        data = spec.user_values() if isinstance(spec, ExperimentSpec) else dict(spec or {})
        data.update({k: v for k, v in sections.items() if v is not None})
        if callable(data.get("env")):
            data["env"] = register_env_creator(data["env"])
        self.spec = ExperimentSpec.build(data, overrides)
        self.env_info = check_spec(self.spec)
        self._resume_from: Path | None = None
        self._resume_checkpoint: Path | None = None
        self._checkpoint_lock = threading.Lock()
        self._checkpoints_asked: list[Future[Path]] = []
        self._events: list[tuple[str, dict[str, Any]]] = []

    def tune(self) -> TuneResult:
        """Search the spec's `tune` section on Ray Tune; each trial is one run like `fit()`'s."""
        from rlfabric.platform.tune import run_search  # Ray Tune loads only for a search

        return run_search(self.spec, self.env_info)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> Platform:
        return cls(ExperimentSpec.from_yaml(path, overrides))

    @classmethod
    def resume(
        cls,
        logdir: str | Path,
        overrides: list[str] | None = None,
        checkpoint: str | Path | None = None,
    ) -> Platform:
        """Continue the run in `logdir` from its newest checkpoint, at its frame count;
        from `checkpoint` instead if given (an earlier one, another run's: a PBT exploit)."""
        logdir = Path(logdir).absolute()  # the paths it prints are the ones to use
        spec_path = logdir / "spec.yaml"
        if not spec_path.is_file():
            raise CheckpointError(f"{str(logdir)!r} is not a run folder: it has no spec.yaml")
        if checkpoint is None and not list_checkpoints(logdir / "checkpoints"):
            raise CheckpointError(f"run folder {str(logdir)!r} holds no checkpoint to resume")
        platform = cls(ExperimentSpec.from_yaml(spec_path, overrides))
        platform._resume_from = logdir
        platform._resume_checkpoint = Path(checkpoint) if checkpoint is not None else None
        return platform

    def checkpoint_soon(self) -> Future[Path]:
        """Ask a running `fit()`, from another thread, for a checkpoint at the end of its
        next report interval (a search saving a trial for PBT). The future holds the
        checkpoint's path; the final checkpoint's if the run ends first."""
        future: Future[Path] = Future()
        with self._checkpoint_lock:
            self._checkpoints_asked.append(future)
        return future

    def log_event(self, name: str, details: dict[str, Any]) -> None:
        """Have `fit()` record an event in the run's trackers as it starts them, at the
        frames it starts from (a search's PBT exploit: donor, checkpoint, new values)."""
        self._events.append((name, details))

    def _answer_checkpoint_requests(self, path: Path | None) -> None:
        with self._checkpoint_lock:
            asked, self._checkpoints_asked = self._checkpoints_asked, []
        for future in asked:
            if path is None:
                future.set_exception(CheckpointError("the run ended without a checkpoint"))
            else:
                future.set_result(path)

    # -- the run --------------------------------------------------------------------

    def fit(self, on_record: Callable[[dict[str, float]], str] | None = None) -> Result:
        """Train until a stop condition holds.

        `on_record`, if given, receives a copy of each report interval's metrics record;
        a non-empty string it returns stops the run as a stop condition does (final
        checkpoint, that string as the reason): how a search's scheduler ends a trial.
        SIGTERM ends the run as Ctrl-C does (final checkpoint; KeyboardInterrupt), unless
        the program has a SIGTERM handler of its own.
        """
        with sigterm_as_interrupt():
            return self._fit(on_record)

    def _fit(self, on_record: Callable[[dict[str, float]], str] | None) -> Result:
        spec = self.spec
        stop = spec.stop_conditions(self.env_info.reward_threshold)
        state, logdir, resumed = self._prepare_logdir()
        if state is not None and resumed is not None:
            done = self._done_already(state, stop, logdir, resumed)
            if done is not None:
                return done
        title = f"{spec.env.id} | {spec.arch.name} + {spec.algo.name} | {logdir.name}"
        run_log = _RunLog(logdir / "run.log")
        trackers = Trackers(spec, logdir)
        for name, details in self._events:
            trackers.event(name, details, state["counters"]["env_frames"] if state else 0)
        reporter = Reporter(
            logdir,
            spec.run.display,
            title,
            stop,
            spec.run.return_window,
            tensorboard="tensorboard" in spec.run.loggers,
            trackers=trackers,
        )
        where = f"{logdir} (on {socket.gethostname()})"
        reporter.message(f"logs:       {where}")
        log.info("logs: %s", where)
        if resumed is not None and state is not None:
            line = f"{resumed.name} at {state['counters']['env_frames']:,} env frames"
            reporter.message(f"resumed:    {line}")
            log.info("resumed from %s", line)
        progress = _Progress(_Clock(state))
        target = stop.episode_return_mean
        progress.target = TargetHit(
            target if target is not None else self.env_info.reward_threshold
        )
        if state is not None:  # a resumed run keeps the first hit it made for this target
            progress.target.restore(state.get("target_hit"))
            progress.learner_restarts = state.get("learner_restarts", 0)
            progress.frames_lost = state.get("frames_lost", 0)
        arch_cls = ARCHITECTURES[spec.arch.name]
        started_ray = False
        arch: Architecture | None = None
        try:
            started_ray = init_ray(spec.resources) if arch_cls.uses_ray else False
            while True:
                arch = arch_cls(spec, self.env_info, stop)
                try:
                    arch.start(state)
                    progress.started = True
                    # from the first step, not from Ray's start; wall time goes on after a restart
                    progress.clock = _Clock(state, progress.wall_time_s)
                    self._train(arch, reporter, stop, logdir, progress, on_record)
                    break
                except ActorError as err:
                    if not err.died:
                        raise
                    progress.started = False  # nothing to checkpoint: the newest one stays
                    arch.stop()
                    arch = None
                    state = self._restart_point(err, logdir, reporter, progress)
        except KeyboardInterrupt:
            progress.reason = "interrupted (Ctrl-C or SIGTERM)"
            log.info("run %s", progress.reason)  # run.log only: the terminal has its line
            raise
        except Exception as err:
            progress.reason = f"error: {err}"
            remote = getattr(err, "remote_traceback", "")
            # run.log only: the CLI prints the one paragraph
            log.info(
                "run stopped by error: %s%s", err, f"\n{remote}" if remote else "", exc_info=True
            )
            err.run_log = str(logdir / "run.log")  # type: ignore[attr-defined]  # for the CLI
            raise
        finally:
            try:
                if progress.started:
                    progress.checkpoint = self._checkpoint(arch, logdir, reporter, progress)
            except Exception as err:  # keep the original error; the last checkpoint stays
                log.warning("final checkpoint failed: %s", err)
            finally:
                self._answer_checkpoint_requests(progress.checkpoint)
                if arch is not None:
                    arch.stop()
                log.info("stopped: %s (checkpoint: %s)", progress.reason, progress.checkpoint)
                reporter.close()
                try:
                    # The curve draws while Ray shuts down: most of that second is spent
                    # waiting for Ray's processes to exit.
                    with ThreadPoolExecutor(1, thread_name_prefix="plot") as pool:
                        drawing = pool.submit(reporter.plot)
                        if started_ray:
                            ray.shutdown()
                        curve = drawing.result()
                    # after the curve, which they log; their warnings still go to run.log
                    problems = trackers.close(progress.checkpoint, end_status(progress.reason))
                finally:
                    run_log.close()
                final = progress.metrics.get("episode_return_mean")
                reporter.message(
                    f"stopped: {progress.reason}\n"
                    f"{progress.target.describe(final, spec.run.return_window)}\n"
                    f"logs:       {logdir}\n"
                    f"checkpoint: {progress.checkpoint}\n"
                    f"curve:      {curve}" + "".join(f"\ntrackers:   {line}" for line in problems)
                )
        checkpoint = str(progress.checkpoint) if progress.checkpoint else None
        return Result(
            progress.metrics, checkpoint, str(logdir), progress.reason, str(curve), progress.target
        )

    def _done_already(
        self, state: dict[str, Any], stop: StopConfig, logdir: Path, checkpoint: Path
    ) -> Result | None:
        """A resumed run whose checkpoint already meets its frame or time budget: said,
        and nothing started (an interval's training would overshoot it)."""
        at = {**state["counters"], "wall_time_s": state.get("wall_time_s", 0.0)}
        reason = stop_reason(at, stop, self.spec.run.return_window)
        if not reason:
            return None
        records = read_records(logdir / "metrics.jsonl")
        metrics = records[-1] if records else at
        line = (
            f"stopped: {reason} at {checkpoint.name} already; nothing to train (raise the "
            "budget in run.stop to go on)"
        )
        if self.spec.run.display != "none":
            print(f"{line}\nlogs:       {logdir}", flush=True)
        run_log = _RunLog(logdir / "run.log")
        log.info("%s", line)
        run_log.close()
        curve = logdir / "curve.png"
        return Result(
            metrics,
            str(checkpoint),
            str(logdir),
            f"{reason} (already)",
            str(curve) if curve.is_file() else None,
        )

    def _train(
        self,
        arch: Architecture,
        reporter: Reporter,
        stop: StopConfig,
        logdir: Path,
        progress: _Progress,
        on_record: Callable[[dict[str, float]], str] | None,
    ) -> None:
        """Report intervals until a stop condition holds; checkpoint on the way."""
        last_ckpt = last_eval = time.perf_counter()
        evaluator = _Evaluator(self.spec, self.env_info) if self.spec.run.eval_interval_s else None
        while True:
            metrics = arch.step()
            now = time.perf_counter()
            if evaluator is not None and now - last_eval >= self.spec.run.eval_interval_s:
                metrics.update(evaluator(arch.policy_weights()))
                last_eval = now = time.perf_counter()
            progress.clock.stamp(metrics, now, rates=True)
            progress.record(reporter, metrics)
            progress.target.observe(metrics, self.spec.run.return_window)
            progress.reason = stop_reason(metrics, stop, self.spec.run.return_window)
            if on_record is not None:
                progress.reason = on_record(dict(metrics)) or progress.reason
            if progress.reason:
                return
            interval = self.spec.run.checkpoint_interval_s
            if self._checkpoints_asked or (interval and now - last_ckpt >= interval):
                progress.checkpoint = self._checkpoint(arch, logdir, reporter, progress)
                self._answer_checkpoint_requests(progress.checkpoint)
                last_ckpt = now

    def _restart_point(
        self, death: ActorError, logdir: Path, reporter: Reporter, progress: _Progress
    ) -> dict[str, Any] | None:
        """The state to start again from after `death` (None: the run's start), or
        `death` raised, extended by why there is no restart."""
        limit = self.spec.run.max_learner_restarts
        folder = logdir / "checkpoints"
        path, state = newest_checkpoint(folder) if list_checkpoints(folder) else (None, None)
        start = state["counters"]["env_frames"] if state else 0
        reached = progress.metrics.get("env_frames", 0)
        where = path.name if path else "the run's start (no checkpoint yet)"
        if progress.restarted_from == (path,) and reached <= start:
            why = f"it died again from {where} without progress, so a restart will not help"
        elif progress.learner_restarts >= limit:
            why = f"restarts used: {progress.learner_restarts} (run.max_learner_restarts={limit})"
        else:
            why = ""
        if why:
            raise ActorError(
                f"{death}; {why}", death.actor, death.remote_traceback, died=True
            ) from None
        lost = max(0, int(reached - start))
        progress.learner_restarts += 1
        progress.frames_lost += lost
        progress.restarted_from = (path,)
        progress.wall_time_s = progress.clock.wall_time_s()
        progress.metrics["env_frames"] = start  # where the run stands now
        line = (
            f"{death}; restart {progress.learner_restarts} of {limit} from {where} at "
            f"{start:,} env frames, {lost:,} frames lost"
        )
        reporter.message(f"restarted:  {line}")
        log.warning("%s", line)
        return state

    def _prepare_logdir(self) -> tuple[dict[str, Any] | None, Path, Path | None]:
        """The state to start from (None: a new run), the run folder, the checkpoint."""
        spec = self.spec
        if self._resume_from is not None:
            logdir = self._resume_from
            if self._resume_checkpoint is not None:
                path = self._resume_checkpoint
                state = load_checkpoint(path)
            else:
                path, state = newest_checkpoint(logdir / "checkpoints")
            (logdir / "spec.yaml").write_text(spec.to_yaml())  # overrides given on resume
            return state, logdir, path
        if spec.run.resume == "auto":
            return self._auto_resume()
        name = spec.run.name or (
            f"{spec.env.id.replace('/', '-')}_{spec.arch.name}_{spec.algo.name}_"
            f"{datetime.now():%Y%m%d-%H%M%S}"
        )
        parent = runs_folder(spec.run.logdir)
        logdir = parent / name
        suffix = 1
        while logdir.exists():
            suffix += 1
            logdir = parent / f"{name}-{suffix}"
        (logdir / "checkpoints").mkdir(parents=True)
        (logdir / "spec.yaml").write_text(spec.to_yaml())
        return None, logdir, None

    def _auto_resume(self) -> tuple[dict[str, Any] | None, Path, Path | None]:
        """`run.resume: auto`: continue logdir/name if it holds this spec's checkpoint,
        start there if it holds nothing, refuse if it holds another spec's run."""
        spec = self.spec
        assert spec.run.name is not None  # RunConfig requires it with resume: auto
        logdir = runs_folder(spec.run.logdir) / spec.run.name
        if (logdir / "spec.yaml").is_file():
            differ = spec_differences(ExperimentSpec.from_yaml(logdir / "spec.yaml"), spec)
            if differ:
                raise SpecError(
                    f"run.resume=auto: run folder {str(logdir)!r} holds another spec's run "
                    f"({'; '.join(differ)}). Use another run.name, or `rlfabric train "
                    f"--resume {logdir}` with overrides to change a run on purpose"
                )
            if list_checkpoints(logdir / "checkpoints"):
                path, state = newest_checkpoint(logdir / "checkpoints")
                (logdir / "spec.yaml").write_text(spec.to_yaml())
                return state, logdir, path
            # A run that died before its first checkpoint: its records describe frames
            # that no checkpoint kept, so it starts over in the same folder.
            (logdir / "metrics.jsonl").unlink(missing_ok=True)
            (logdir / TRACKERS_FILE).unlink(missing_ok=True)  # new tracker runs too
            shutil.rmtree(logdir / "tensorboard", ignore_errors=True)
        (logdir / "checkpoints").mkdir(parents=True, exist_ok=True)
        (logdir / "spec.yaml").write_text(spec.to_yaml())
        return None, logdir, None

    def _checkpoint(
        self, arch: Architecture, logdir: Path, reporter: Reporter, progress: _Progress
    ) -> Path:
        """Save the state and write the metrics record of the same moment beside it.

        Replay contents go from the buffer's process into the checkpoint folder,
        or in chunks through here (`platform.checkpoint`), never whole."""
        folder = logdir / "checkpoints"
        with replay_target(folder) as replay_file:
            metrics, state = arch.snapshot(str(replay_file))
            progress.clock.stamp(metrics, time.perf_counter(), rates=False)
            progress.record(reporter, metrics)
            state["wall_time_s"] = metrics["wall_time_s"]
            state["target_hit"] = progress.target.saved()
            state["learner_restarts"] = progress.learner_restarts
            state["frames_lost"] = progress.frames_lost
            return save_checkpoint(
                folder,
                state,
                int(state["counters"]["env_frames"]),
                self.spec.run.keep_checkpoints,
                replay_file=replay_file,
                pull=arch.replay_chunk,
            )


class _Clock:
    """Wall time (continued on resume) and the per-second rates between records."""

    def __init__(self, state: dict[str, Any] | None, wall_time_s: float | None = None) -> None:
        """Count from `state`'s frames; the wall time from `wall_time_s` if given (a
        restart within the run: the time since the checkpoint was spent), else the
        checkpoint's."""
        counters = state["counters"] if state else {"env_frames": 0, "learner_samples": 0}
        saved_wall = state.get("wall_time_s", 0.0) if state else 0.0
        self.previous_wall = saved_wall if wall_time_s is None else wall_time_s
        self.frames, self.samples = counters["env_frames"], counters["learner_samples"]
        self.start = self.last = time.perf_counter()

    def wall_time_s(self) -> float:
        return self.previous_wall + time.perf_counter() - self.start

    def stamp(self, metrics: dict[str, float], now: float, *, rates: bool) -> None:
        """Add wall_time_s, and with `rates` the frames and samples per second since the
        last interval's record (a checkpoint's record, moments later, would show noise)."""
        metrics["wall_time_s"] = self.previous_wall + now - self.start
        if not rates:
            return
        dt = max(now - self.last, 1e-9)
        metrics["env_frames_per_s"] = (metrics["env_frames"] - self.frames) / dt
        metrics["learner_samples_per_s"] = (metrics["learner_samples"] - self.samples) / dt
        self.last, self.frames, self.samples = (
            now,
            metrics["env_frames"],
            metrics["learner_samples"],
        )


@dataclass
class _Progress:
    """Where a run stands, for the final checkpoint and Result also after Ctrl-C."""

    clock: _Clock
    started: bool = False
    metrics: dict[str, float] = field(default_factory=dict)  # latest value of every key
    reason: str = ""  # set by a stop condition, an error or an interruption
    checkpoint: Path | None = None
    target: TargetHit = field(default_factory=lambda: TargetHit(None))
    learner_restarts: int = 0  # learner deaths mended from a checkpoint, over the run
    frames_lost: int = 0  # env frames reported since those checkpoints, lost with them
    restarted_from: tuple[Path | None] | None = None  # this driver's last restart point
    wall_time_s: float | None = None  # at the last restart, for the next clock

    def record(self, reporter: Reporter, metrics: dict[str, float]) -> None:
        metrics["learner_restarts"] = self.learner_restarts
        metrics["frames_lost"] = self.frames_lost
        reporter.log(metrics)
        # An interval without an update has no loss: keep the latest value of every key.
        self.metrics.update(metrics)


class _RunLog:
    """rlfabric's log records (INFO and up) of one run, in the run's `run.log`."""

    def __init__(self, path: Path) -> None:
        self.handler = logging.FileHandler(path)
        self.handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        self.logger = logging.getLogger("rlfabric")
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        self.handler.close()


#: Fields a resumed run may change: bookkeeping (not `run.seed`) and the machines it
#: runs on (a cluster restarted with other nodes). Everything else is the run itself.
_MAY_DIFFER_ON_RESUME = ("run.", "resources.")


def spec_differences(saved: ExperimentSpec, given: ExperimentSpec) -> list[str]:
    """`field: saved -> given` for each field of the run itself that differs."""
    old, new = _flatten(saved.to_dict()), _flatten(given.to_dict())
    return [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
        and (key == "run.seed" or not key.startswith(_MAY_DIFFER_ON_RESUME))
    ]


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def runs_folder(logdir: str) -> Path:
    """`run.logdir` as an absolute path. A relative one is resolved against
    $RLFABRIC_RUNS if set, else the current directory, except under `ray job submit
    --working-dir`, whose current directory is Ray's temporary copy of the working
    dir (deleted with the session): there, against ~/rlfabric (the node's home).
    """
    path = Path(logdir).expanduser()
    if path.is_absolute():
        return path
    base = os.environ.get("RLFABRIC_RUNS")
    if base:
        return Path(base).expanduser().resolve() / path
    cwd = Path.cwd().resolve()
    if "runtime_resources" in cwd.parts and any(p.startswith("session_") for p in cwd.parts):
        return Path.home() / "rlfabric" / path
    return cwd / path


def stop_reason(metrics: dict[str, float], stop: StopConfig, window: int = 100) -> str:
    """The first stop condition the metrics meet, or ''.

    The training return counts only once its window (`run.return_window` episodes)
    is full, so that a few lucky first episodes do not end a run.
    """
    if stop.env_frames is not None and metrics.get("env_frames", 0) >= stop.env_frames:
        return f"env_frames {metrics['env_frames']:,.0f} >= {stop.env_frames:,}"
    if stop.wall_time_s is not None and metrics.get("wall_time_s", 0) >= stop.wall_time_s:
        return f"wall_time_s {metrics['wall_time_s']:.1f} >= {stop.wall_time_s}"
    target = stop.episode_return_mean
    reached = metrics.get("episode_return_mean", -float("inf")) >= (target or 0.0)
    if target is not None and reached and metrics.get("episodes", 0) >= window:
        return f"episode_return_mean {metrics['episode_return_mean']:.2f} >= {target}"
    target = stop.eval_return_mean
    if target is not None and metrics.get("eval_return_mean", -float("inf")) >= target:
        return f"eval_return_mean {metrics['eval_return_mean']:.2f} >= {target}"
    return ""
