"""The spec sections the runtime consumes, and what the runtime reads of a spec.

`ResourcesConfig`, `RunConfig` and `StopConfig` live here, with the layer
that reads them; the face (`platform.spec.ExperimentSpec`) composes them with
the leaves' sections. Runtime pieces never import the face: they take
`LearningSpec`, the sections they read, which an `ExperimentSpec` satisfies.
"""

from __future__ import annotations

import os
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfabric.algorithms import AlgoConfig
from rlfabric.envs import EnvConfig
from rlfabric.models import ModelConfig
from rlfabric.sparse import SparseConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResourcesConfig(_Section):
    """Where and with how much the run executes."""

    num_env_runners: int = Field(1, ge=1, description="env runner actors (processes)")
    cpus_per_env_runner: float | None = Field(
        None,
        gt=0,
        description="CPUs Ray reserves per env runner; null: share what the learner leaves free",
    )
    learner_cpus: float | None = Field(
        None,
        gt=0,
        description="CPUs Ray reserves per learner; null: one, or an equal share with the "
        "env runners where the cluster has fewer CPUs than learners plus runners",
    )
    num_learners: int = Field(
        1,
        ge=1,
        description="data-parallel learners: each update splits the batch into equal shards "
        "and all-reduces gradients (gloo on CPU, NCCL on GPUs); inference stays on learner 0",
    )
    inference_device: str = Field(
        "learner",
        pattern=r"^(learner|cpu|cuda(:\d+)?)$",
        description="seed/ga3c inference: 'learner' (on the training weights), or 'cpu', "
        "'cuda', 'cuda:N' for a copy there refreshed after every update (e.g. cuda:1 with "
        "num_gpus_per_learner: 2); an unavailable GPU falls back to CPU with a warning",
    )
    num_gpus_per_learner: float = Field(
        0.0,
        ge=0,
        description="GPUs Ray reserves for the learner, which then trains (and under seed and "
        "ga3c infers) on cuda; a cluster without GPUs runs it on CPU with a warning",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads per process; null: 1 per env runner, and a "
        "learner the CPUs it reserves (learner_cpus rounded, at most the machine's)",
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of an embedded Ray; null: all of this machine's"
    )
    address: str | None = Field(
        None,
        description="Ray cluster to join ('auto' or host:port); null: RAY_ADDRESS or "
        "an embedded Ray on 127.0.0.1",
    )
    dashboard: bool = Field(False, description="start the Ray dashboard (on 127.0.0.1)")
    replay_actor: bool = Field(
        False,
        description="off-policy: keep the replay buffer in its own Ray actor instead of the "
        "learner's process (one remote call per stored unroll and per sampled batch)",
    )

    @model_validator(mode="after")
    def _whole_gpus_for_several_learners(self) -> ResourcesConfig:
        """NCCL refuses two ranks on one GPU, and Ray packs fractional GPU shares onto
        one device: with several learners each must own whole GPUs."""
        gpus = self.num_gpus_per_learner
        if self.num_learners > 1 and gpus != int(gpus):
            raise ValueError(
                f"resources.num_gpus_per_learner={gpus:g} with num_learners="
                f"{self.num_learners}: data-parallel learners all-reduce with NCCL, which "
                "needs each learner on its own GPU; use a whole number (1, 2, ...) or "
                "num_learners: 1"
            )
        return self

    @property
    def learner_threads(self) -> int:
        """torch threads of a learner process: `torch_threads`, else its CPU share.

        An off-policy learner's update is most of a run's compute, and on a CPU it is
        matmuls that scale with threads (measured: a SAC update of the default size takes
        9.8 ms on 1 thread, 6.3 on 2); more threads than the CPUs Ray reserves for it
        would compete with the env runners, which keep 1 thread each.
        """
        if self.torch_threads is not None:
            return self.torch_threads
        if self.learner_cpus is None:  # a share decided at placement: at most one CPU
            return 1
        return max(1, min(round(self.learner_cpus), available_cpus()))

    @property
    def runner_threads(self) -> int:
        """torch threads of an env runner: `torch_threads`, else 1 (small batches, many
        processes: more threads would only oversubscribe the CPUs)."""
        return self.torch_threads or 1


def available_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class StopConfig(_Section):
    """Stop conditions; the run ends at the first one met."""

    env_frames: int | None = Field(None, gt=0, description="emulator frames (steps x frameskip)")
    wall_time_s: float | None = Field(None, gt=0, description="seconds since the run started")
    episode_return_mean: float | None = Field(
        None, description="mean return over the last run.return_window episodes to reach"
    )
    eval_return_mean: float | None = Field(
        None,
        description="mean return of a periodic greedy evaluation to reach (needs "
        "run.eval_interval_s)",
    )


class WandbConfig(_Section):
    """Weights & Biases options, read when `run.loggers` names wandb. A value set here
    wins over wandb's environment variable for it; null leaves it to that variable."""

    project: str | None = Field(
        None, description="W&B project; null: WANDB_PROJECT, else 'rlfabric'"
    )
    entity: str | None = Field(
        None, description="W&B team or user; null: WANDB_ENTITY, else your default entity"
    )
    group: str | None = Field(
        None,
        description="group of runs; null: WANDB_RUN_GROUP, and in a search the search's name",
    )
    tags: list[str] = Field(default_factory=list, description="run tags; []: WANDB_TAGS")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None,
        description="null: WANDB_MODE, else online; offline keeps the run in dir for `wandb sync`",
    )
    dir: str | None = Field(
        None, description="folder of wandb's own files; null: WANDB_DIR, else the run folder"
    )
    log_checkpoint: bool = Field(
        False, description="log the final checkpoint as a model artifact at the run's end"
    )
    close_timeout_s: float = Field(
        300.0,
        gt=0,
        description="longest wait at the run's end for W&B to take the last records and files",
    )


class MlflowConfig(_Section):
    """MLflow options, read when `run.loggers` names mlflow. A value set here wins over
    MLflow's environment variable for it; null leaves it to that variable."""

    tracking_uri: str | None = Field(
        None,
        description="tracking server or store; null: MLFLOW_TRACKING_URI, else MLflow's "
        "default (sqlite:///mlflow.db in the current directory)",
    )
    experiment: str | None = Field(
        None,
        description="experiment name, created if new; null: MLFLOW_EXPERIMENT_NAME, else "
        "MLflow's 'Default'",
    )
    parent_run_id: str | None = Field(
        None, description="MLflow run this one nests under; a search sets its own run's id"
    )
    log_checkpoint: bool = Field(
        False, description="log the final checkpoint as an artifact at the run's end"
    )
    close_timeout_s: float = Field(
        300.0,
        gt=0,
        description="longest wait at the run's end for MLflow to take the last records and files",
    )


class RunConfig(_Section):
    """Bookkeeping: seed, stop, logging and checkpoints."""

    name: str | None = Field(None, description="run name; null: <env>_<arch>_<algo>_<time>")
    resume: Literal["never", "auto"] = Field(
        "never",
        description="auto: continue the run folder logdir/name from its newest complete "
        "checkpoint if it holds this spec's run (a job resubmitted after its driver died), "
        "start there if it holds none, refuse if it holds another spec; never: a new folder",
    )
    seed: int = Field(0, ge=0, description="seed of envs, model init and action sampling")
    stop: StopConfig = Field(default_factory=StopConfig, description="stop conditions")
    return_window: int = Field(
        100,
        ge=1,
        description="episodes in the training return mean (display, metrics, "
        "stop.episode_return_mean); 100 as SB3's ep_rew_mean and gymnasium's thresholds",
    )
    logdir: str = Field("runs", description="parent folder of the run's logdir")
    report_interval_s: float = Field(
        1.0,
        gt=0,
        description="seconds per metrics record (a run's last one comes as soon as its frame "
        "budget or return target is met)",
    )
    checkpoint_interval_s: float = Field(
        60.0, ge=0, description="seconds between checkpoints; 0: only at the end"
    )
    keep_checkpoints: int = Field(3, ge=1, description="how many recent checkpoints to keep")
    eval_interval_s: float | None = Field(
        None,
        gt=0,
        description="seconds between greedy evaluations on fresh envs during training "
        "(eval_return_mean/std in the metrics; the driver plays them); null: none",
    )
    eval_episodes: int = Field(10, ge=1, description="episodes per evaluation, one per env")
    start_timeout_s: float = Field(
        120.0,
        gt=0,
        description="longest wait for an actor to be placed and built before the run fails "
        "naming the resources asked for and free",
    )
    actor_timeout_s: float = Field(
        120.0,
        gt=0,
        description="longest wait for the learner's answer to the driver (metrics, checkpoint "
        "state) and for a data-parallel all-reduce before the run fails naming who is stuck",
    )
    runner_timeout_s: float = Field(
        300.0,
        gt=0,
        description="an env runner that has completed no env step for this long (a wedged "
        "env) is replaced, counted as a crash",
    )
    max_learner_restarts: int = Field(
        3,
        ge=0,
        description="times a run whose learner process died (a data-parallel learner's or "
        "the replay actor's too) starts its topology again from its newest checkpoint; a "
        "death from the same checkpoint without progress ends it. 0: a death ends the run",
    )
    max_nonfinite_updates: int = Field(
        10,
        ge=1,
        description="updates in a row with a NaN/inf loss or gradient (each skipped) before "
        "the run stops with an error",
    )
    checkpoint_replay_mb: float = Field(
        1024,
        ge=0,
        description="checkpoints hold the replay buffer's contents up to this many MiB; past "
        "it only its parameters, and a resumed run warms the buffer up again",
    )
    display: Literal["auto", "rich", "plain", "none"] = Field(
        "auto", description="live display: 'auto' is rich on a terminal, plain lines otherwise"
    )
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl", "tensorboard"],
        description="where each report interval's metrics go: jsonl (metrics.jsonl, always), "
        "tensorboard, wandb, mlflow (options in run.wandb, run.mlflow; each its extra: pip "
        "install 'rlfabric[wandb]')",
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig, description="Weights & Biases, when run.loggers names it"
    )
    mlflow: MlflowConfig = Field(
        default_factory=MlflowConfig, description="MLflow, when run.loggers names it"
    )

    @field_validator("loggers")
    @classmethod
    def _loggers_keep_the_record(cls, loggers: list[str]) -> list[str]:
        """metrics.jsonl is what a resume appends to, curve.png is drawn from and a
        search ranks trials by: it is not optional."""
        if "jsonl" not in loggers:
            raise ValueError(
                "must name jsonl: metrics.jsonl is the run's own record (resume, curve.png "
                "and searches read it)"
            )
        twice = sorted({name for name in loggers if loggers.count(name) > 1})
        if twice:
            raise ValueError(f"names {', '.join(twice)} more than once")
        return loggers

    @model_validator(mode="after")
    def _auto_resume_needs_a_name(self) -> RunConfig:
        if self.resume == "auto" and self.name is None:
            raise ValueError(
                "run.resume=auto needs run.name: the folder (under run.logdir) to continue"
            )
        return self

    @model_validator(mode="after")
    def _eval_stop_needs_evaluations(self) -> RunConfig:
        if self.stop.eval_return_mean is not None and self.eval_interval_s is None:
            raise ValueError(
                f"stop.eval_return_mean={self.stop.eval_return_mean} needs periodic "
                "evaluations: set run.eval_interval_s (seconds between them)"
            )
        return self


class LearningSpec(Protocol):
    """The sections of an experiment that the runtime reads (no architecture section:
    what a runtime piece needs of it, the architecture passes as arguments)."""

    @property
    def env(self) -> EnvConfig: ...

    @property
    def algo(self) -> AlgoConfig: ...

    @property
    def model(self) -> ModelConfig: ...

    @property
    def sparse(self) -> SparseConfig: ...

    @property
    def resources(self) -> ResourcesConfig: ...

    @property
    def run(self) -> RunConfig: ...
