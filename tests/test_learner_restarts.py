"""A learner whose process dies is started again from the run's newest checkpoint.

The learners here SIGKILL their own process at a set point (`_dying`): the
death comes at the same moment of every run, so each test is exact about it,
and the driver sees what any other death shows it (Ray's ActorDiedError).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import RayActorError
from test_training import FAST_VTRACE

from rlfabric import Platform
from rlfabric.architectures import ARCHITECTURES
from rlfabric.errors import ActorError
from rlfabric.platform.checkpoint import load_checkpoint
from rlfabric.runtime.faults import death_cause, name_actor_error

# What Ray 2.60 says of an actor whose process was SIGKILLed (its ActorDiedError).
KILLED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: SeedLearner\n"
    "\tactor_id: ac0193d9f0910ca47e97e41801000000\n\tpid: 18544\n\tnamespace: c4a1\n"
    "\tip: 127.0.0.1\nThe actor is dead because its worker process has died. Worker exit "
    "type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection "
    "error code 2. End of file. Some common causes include: (1) the process was killed"
)


def _dying(learner_cls: type, *, frames: int, again: bool) -> type:
    """`learner_cls` that SIGKILLs its process, when it started without state, as it
    begins a checkpoint (not its first) after the driver's metrics read `frames` env
    frames; with `again` also in its constructor when it starts from a checkpoint (a
    death without progress). The driver checkpoints after each report (interval 0.01 s),
    so the death loses the frames of the report before it."""

    class Dying(learner_cls):  # type: ignore[misc, valid-type]
        def __init__(self, spec: Any, env_info: Any, budget: Any, state: Any) -> None:
            if again and state is not None:
                os.kill(os.getpid(), signal.SIGKILL)
            self.fresh = state is None
            self.saved = False
            self.reported = 0.0  # env frames of the driver's last metrics read
            super().__init__(spec, env_info, budget, state)

        def snapshot(self, replay_file: str | None = None) -> Any:
            if self.fresh and self.saved and self.reported >= frames:
                os.kill(os.getpid(), signal.SIGKILL)
            self.saved = True
            return super().snapshot(replay_file)

        def metrics(self, raise_errors: bool = True) -> dict[str, float]:
            metrics = super().metrics(raise_errors)
            self.reported = metrics["env_frames"]
            return metrics

    Dying.__name__ = Dying.__qualname__ = learner_cls.__name__  # Ray's process title
    return Dying


def _run(tmp_path: Path, arch: str, algo: Any, env: str, frames: int, **run: Any) -> Platform:
    return Platform(
        arch=arch,
        algo=algo,
        env={"id": env, "num_envs": 8},
        run={
            "name": "run",
            "logdir": str(tmp_path),
            "display": "none",
            "report_interval_s": 0.25,
            "checkpoint_interval_s": 0.01,
            "keep_checkpoints": 1000,
            "stop": {"env_frames": frames},
            **run,
        },
    )


def _records(logdir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]


# The learner dies a report interval (0.25 s) past a quarter of the budget: far from its
# end at any speed this machine reaches.
CASES = {
    "seed-vtrace": ("seed", FAST_VTRACE, "CartPole-v1", 12_000),
    "impala-vtrace": ("impala", FAST_VTRACE, "CartPole-v1", 12_000),
    "ga3c-a3c": ("ga3c", "a3c", "CartPole-v1", 12_000),
    "seed-sac": ("seed", "sac", "Pendulum-v1", 4_000),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_learner_is_restarted_from_the_newest_checkpoint(
    ray_session, tmp_path, monkeypatch, case
):
    arch, algo, env, frames = CASES[case]
    arch_cls = ARCHITECTURES[arch]
    monkeypatch.setattr(
        arch_cls, "learner_cls", _dying(arch_cls.learner_cls, frames=frames // 4, again=False)
    )
    result = _run(tmp_path, arch, algo, env, frames).fit()
    assert result.metrics["learner_restarts"] == 1
    assert result.metrics["env_frames"] >= frames  # it went on to its stop condition
    records = _records(Path(result.logdir))
    first = next(i for i, r in enumerate(records) if r["learner_restarts"] == 1)
    log = (Path(result.logdir) / "run.log").read_text()
    line = next(x for x in log.splitlines() if "restart 1 of 3 from ckpt_" in x)
    assert "the learner died: SYSTEM_ERROR" in line and "(pid " in line
    checkpoint = line.split(" from ")[1].split(" at ")[0]
    saved = load_checkpoint(Path(result.logdir) / "checkpoints" / checkpoint, replay=False)
    start = saved["counters"]["env_frames"]
    # Lost: what the records counted past the checkpoint before the death.
    assert result.metrics["frames_lost"] == records[first - 1]["env_frames"] - start >= 0
    assert f"at {start:,} env frames, {result.metrics['frames_lost']:,} frames lost" in line
    # The restarted learner went on from the checkpoint's counters, not from zero.
    assert records[first]["env_frames"] >= start
    assert records[first]["updates"] >= saved["counters"]["updates"]
    assert records[-1]["updates"] > saved["counters"]["updates"]
    if algo == "sac":  # the replay contents came back with it
        at_checkpoint = next(r for r in records[:first] if r["env_frames"] == start)
        assert records[first]["replay_size"] >= at_checkpoint["replay_size"] > 0


def test_a_dead_data_parallel_learner_restarts_the_group(ray_session, tmp_path, monkeypatch):
    from rlfabric.runtime.data_parallel import LearnerWorker

    marker = tmp_path / "died"  # one death per test: the restarted group's workers live

    class DyingWorker(LearnerWorker):
        def update(self, shard: Any, progress: Any) -> None:
            self.updates = getattr(self, "updates", 0) + 1
            if self.updates == 10 and not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            super().update(shard, progress)

    monkeypatch.setattr("rlfabric.architectures.learner_group.LearnerWorker", DyingWorker)
    platform = _run(tmp_path, "seed", FAST_VTRACE, "CartPole-v1", 12_000)
    platform = Platform(platform.spec, overrides=["resources.num_learners=2"])
    result = platform.fit()
    assert marker.exists() and result.metrics["learner_restarts"] == 1
    assert result.metrics["env_frames"] >= 12_000
    log = (Path(result.logdir) / "run.log").read_text()
    assert "data-parallel learner 1 died: SYSTEM_ERROR" in log and "restart 1 of 3" in log


def test_a_learner_that_dies_again_without_progress_ends_the_run(
    ray_session, tmp_path, monkeypatch
):
    arch_cls = ARCHITECTURES["seed"]
    monkeypatch.setattr(arch_cls, "learner_cls", _dying(arch_cls.learner_cls, frames=0, again=True))
    platform = _run(tmp_path, "seed", FAST_VTRACE, "CartPole-v1", 10_000_000)
    with pytest.raises(ActorError) as err:
        platform.fit()
    message = str(err.value)
    assert message.startswith("the learner died: ")
    assert "died again from ckpt_" in message and "without progress" in message
    log = (tmp_path / "run" / "run.log").read_text()
    assert "restart 1 of 3 from ckpt_" in log and "restart 2" not in log


def test_no_restarts_allowed_ends_the_run_at_the_first_death(ray_session, tmp_path, monkeypatch):
    arch_cls = ARCHITECTURES["seed"]
    monkeypatch.setattr(
        arch_cls, "learner_cls", _dying(arch_cls.learner_cls, frames=0, again=False)
    )
    platform = _run(
        tmp_path, "seed", FAST_VTRACE, "CartPole-v1", 10_000_000, max_learner_restarts=0
    )
    with pytest.raises(ActorError, match=r"^the learner died: .*run\.max_learner_restarts=0"):
        platform.fit()


def test_a_death_is_named_with_its_exit_cause_and_place_and_an_init_error_is_no_death():
    assert death_cause(KILLED) == (
        "SYSTEM_ERROR: Worker unexpectedly exits with a connection error code 2. End of "
        "file. (pid 18544, node 127.0.0.1)"
    )
    died = name_actor_error(RayActorError(error_msg=KILLED), "the learner")
    assert died.died and str(died).startswith("the learner died: SYSTEM_ERROR")
    raised = RayActorError(error_msg="ValueError: bad", actor_init_failed=True)
    assert not name_actor_error(raised, "the learner").died
    # The flag survives the trip through a runner's error (pickled by Ray).
    import pickle

    assert pickle.loads(pickle.dumps(died)).died
