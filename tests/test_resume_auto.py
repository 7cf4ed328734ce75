"""`run.resume: auto`: a resubmitted job continues its run folder, starts an empty one,
and refuses a folder that holds another spec's run, naming the differing fields."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlfabric import Platform
from rlfabric.errors import SpecError
from rlfabric.platform.checkpoint import list_checkpoints


def _platform(tmp_path: Path, frames: int, **algo: float) -> Platform:
    return Platform(
        arch="local",
        algo={"name": "vtrace", **algo},
        env={"id": "CartPole-v1", "num_envs": 8},
        run={
            "name": "job",
            "resume": "auto",
            "logdir": str(tmp_path),
            "display": "none",
            "stop": {"env_frames": frames},
        },
    )


def _frames(logdir: Path) -> list[int]:
    lines = (logdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["env_frames"] for line in lines]


def test_an_empty_folder_starts_and_a_resubmitted_job_continues(tmp_path):
    first = _platform(tmp_path, 2_000).fit()
    assert Path(first.logdir) == tmp_path / "job"  # the name itself, no -2 suffix
    saved = first.metrics["env_frames"]
    second = _platform(tmp_path, saved + 2_000).fit()  # the same job, a larger budget
    assert second.logdir == first.logdir
    assert second.metrics["env_frames"] >= saved + 2_000
    assert second.metrics["updates"] > first.metrics["updates"]
    frames = _frames(Path(first.logdir))
    assert frames == sorted(frames) and frames[-1] == second.metrics["env_frames"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job"]


def test_a_folder_of_another_spec_is_refused_naming_the_fields(tmp_path):
    first = _platform(tmp_path, 2_000).fit()
    before = sorted(p.name for p in list_checkpoints(Path(first.logdir) / "checkpoints"))
    with pytest.raises(SpecError, match=r"holds another spec's run \(algo\.lr: .* -> 0\.123\)"):
        _platform(tmp_path, 4_000, lr=0.123).fit()
    after = sorted(p.name for p in list_checkpoints(Path(first.logdir) / "checkpoints"))
    assert after == before  # nothing started, nothing written


def test_a_folder_without_a_checkpoint_starts_over_in_place(tmp_path):
    platform = _platform(tmp_path, 2_000)
    logdir = tmp_path / "job"
    (logdir / "checkpoints").mkdir(parents=True)  # a driver that died before it saved
    (logdir / "spec.yaml").write_text(platform.spec.to_yaml())
    (logdir / "metrics.jsonl").write_text('{"env_frames": 999999}\n')
    result = platform.fit()
    assert result.logdir == str(logdir)
    assert max(_frames(logdir)) == result.metrics["env_frames"] < 999_999


def test_auto_resume_needs_a_run_name():
    with pytest.raises(SpecError, match=r"run.resume=auto needs run.name"):
        Platform(env="CartPole-v1", run={"resume": "auto"})


def test_the_cli_takes_resume_auto_with_a_spec(tmp_path):
    rlfabric = Path(sys.executable).parent / "rlfabric"
    spec = Path(__file__).resolve().parents[1] / "examples/specs/cartpole_local_vtrace.yaml"
    cmd = [str(rlfabric), "train", "--resume", "auto", str(spec), f"run.logdir={tmp_path}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "run.resume=auto needs run.name" in out.stderr
    cmd += ["run.name=job", "run.display=none"]
    for frames in (1000, 2000):  # the second, with a larger budget, goes on from the first
        out = subprocess.run(
            [*cmd, f"run.stop.env_frames={frames}"], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
    assert "resumed from ckpt_" in (tmp_path / "job" / "run.log").read_text()


def test_resuming_a_run_that_met_its_budget_trains_nothing_and_says_so(tmp_path):
    first = _platform(tmp_path, 2_000).fit()
    records = (tmp_path / "job" / "metrics.jsonl").read_text()
    again = _platform(tmp_path, 2_000).fit()
    assert again.stop_reason.startswith("env_frames") and "already" in again.stop_reason
    assert again.checkpoint == first.checkpoint
    assert (tmp_path / "job" / "metrics.jsonl").read_text() == records  # nothing trained
    assert "already; nothing to train" in (tmp_path / "job" / "run.log").read_text()
    more = Platform.resume(tmp_path / "job", ["run.stop.env_frames=4000"]).fit()
    assert more.metrics["env_frames"] >= 4_000
