"""What the user reads: spec errors that suggest the name meant, `spec show` that shows
the stop conditions in force."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlfabric.errors import SpecError
from rlfabric.platform.cli import main
from rlfabric.platform.spec import ExperimentSpec

SPEC = Path(__file__).resolve().parents[1] / "examples" / "specs" / "cartpole_seed_vtrace.yaml"


def test_an_unknown_field_gets_did_you_mean_with_the_names_users_write():
    with pytest.raises(SpecError) as err:
        ExperimentSpec.build({"algo": {"name": "vtrace", "lamda": 0.9}})
    message = str(err.value)
    assert "algo.lamda: unknown field; did you mean 'lambda'" in message
    assert "lambda_" not in message


@pytest.mark.parametrize(
    ("section", "written", "meant"),
    [
        ("algo", "learning_rate", "lr"),  # SB3
        ("algo", "ent_coef", "entropy_cost"),  # SB3
        ("algo", "max_grad_norm", "grad_clip"),  # SB3
        ("env", "n_envs", "num_envs"),  # SB3
        ("algo", "rollout_fragment_length", "unroll_length"),  # RLlib
    ],
)
def test_names_other_libraries_use_suggest_ours(section, written, meant):
    data = {"algo": {"name": "vtrace"}, "env": {"id": "CartPole-v1"}}
    data[section][written] = 1
    with pytest.raises(
        SpecError, match=f"{section}.{written}: unknown field; did you mean '{meant}'"
    ):
        ExperimentSpec.build(data)


def test_an_empty_spec_file_is_refused_not_read_as_the_defaults(tmp_path):
    """Python's `from_yaml` as the CLI (tests/test_cli.py): the wrong file, or one not yet
    saved, would train CartPole for minutes."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(SpecError, match="is empty: it names nothing to train"):
        ExperimentSpec.from_yaml(empty)


def test_spec_show_prints_the_stop_conditions_in_force_and_no_atari_block(capsys):
    assert main(["spec", "show", str(SPEC)]) == 0
    out = capsys.readouterr().out
    header = [line for line in out.splitlines() if line.startswith("#")]
    assert "# run.stop names no condition: in force are the default budget" in "\n".join(header)
    shown = yaml.safe_load(out)
    assert shown["run"]["stop"] == {"env_frames": 5_000_000, "episode_return_mean": 475.0}
    assert "atari" not in shown["env"]
    assert main(["spec", "show", str(SPEC), "run.stop.wall_time_s=60"]) == 0
    out = capsys.readouterr().out
    assert "run.stop names no condition" not in out
    assert yaml.safe_load(out)["run"]["stop"] == {"wall_time_s": 60.0}


def test_a_relative_logdir_lands_where_the_user_looks(tmp_path, monkeypatch):
    """Not in Ray's temporary copy of the working dir under `ray job submit`."""
    from rlfabric.platform.facade import runs_folder

    monkeypatch.delenv("RLFABRIC_RUNS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert runs_folder("runs") == tmp_path.resolve() / "runs"
    assert runs_folder(str(tmp_path / "abs")) == tmp_path / "abs"
    job_copy = tmp_path / "ray" / "session_2026" / "runtime_resources" / "working_dir_files" / "x"
    job_copy.mkdir(parents=True)
    monkeypatch.chdir(job_copy)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runs_folder("runs") == tmp_path / "home" / "rlfabric" / "runs"
    monkeypatch.setenv("RLFABRIC_RUNS", str(tmp_path / "shared"))
    assert runs_folder("runs") == tmp_path / "shared" / "runs"


def test_plain_display_shows_progress_and_a_slower_time_breakdown(tmp_path, capsys):
    from rlfabric.platform.reporting import PLAIN_BREAKDOWN_EVERY_S, Reporter
    from rlfabric.runtime.config import StopConfig

    stop = StopConfig(env_frames=10_000, episode_return_mean=475.0)
    reporter = Reporter(tmp_path, "plain", "title", stop)
    try:
        for second in range(1, 1 + 2 * int(PLAIN_BREAKDOWN_EVERY_S)):
            reporter.log(
                {
                    "env_frames": 100 * second,
                    "env_frames_per_s": 100.0,
                    "episode_return_mean": 20.0,
                    "loss": 0.25,
                    "entropy": 0.6,
                    "env_step_ms": 0.5,
                    "wall_time_s": float(second),
                }
            )
        reporter.log({"env_frames": 10_400, "wall_time_s": 61.0})  # past the budget
    finally:
        reporter.close()
    lines = capsys.readouterr().out.splitlines()
    # the return target may end the run first: the frame budget's time left is a bound
    assert lines[0].endswith("1% of 10,000 frames, return 20.0 of 475, at most ~0h01m39s left"), (
        lines[0]
    )
    assert "loss=0.25" in lines[0] and "entropy=0.600" in lines[0]
    breakdowns = [line for line in lines if line.startswith("time: ")]
    # the first with the first record (a short run shows one), then every 30 s
    assert len(breakdowns) == 3 and "env step ms (group)=0.500" in breakdowns[0]
    assert lines[1] == breakdowns[0]
    last = [line for line in lines if not line.startswith("time: ")][-1]
    assert "100% of 10,000 frames" in last  # an overshoot reads as done, not 104%


def _log_bursts(reporter, seconds: int) -> None:
    """A learner-bound run's records: a batch of 200 frames lands every other second, so
    the interval rate alternates 0 and 200 around a mean of 100 frames/s."""
    for second in range(1, seconds + 1):
        reporter.log(
            {
                "env_frames": 100 * (second - second % 2),
                "env_frames_per_s": 200.0 if second % 2 == 0 else 0.0,
                "wall_time_s": float(second),
            }
        )


def test_time_left_holds_when_frames_arrive_in_bursts(tmp_path, capsys):
    """A learner-bound run (PPO on Atari) counts its frames a batch at a time: the
    interval rate alternates 0 and twice the mean, and the time left must not vanish
    or double with it; it is the run's average rate's."""
    from rlfabric.platform.reporting import Reporter
    from rlfabric.runtime.config import StopConfig

    reporter = Reporter(tmp_path, "plain", "title", StopConfig(env_frames=10_000))
    try:
        _log_bursts(reporter, 10)
    finally:
        reporter.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "frames" in line]
    assert all(line.endswith(" left") for line in lines[1:]), lines
    # At 10 s: 1,000 frames, 100 frames/s on average, 9,000 frames to go.
    assert lines[-1].endswith("10% of 10,000 frames, ~0h01m30s left"), lines[-1]


def test_displayed_frame_rate_is_steady_when_frames_arrive_in_bursts(tmp_path, capsys):
    """The display's env frames/s is the rate over the last RATE_WINDOW_S, not the
    interval's 0 or 200 of a learner-bound run; metrics.jsonl keeps the interval's."""
    from rlfabric.platform.reporting import RATE_WINDOW_S, Reporter, read_records

    seconds = 2 * int(RATE_WINDOW_S)
    reporter = Reporter(tmp_path, "plain", "title")
    try:
        _log_bursts(reporter, seconds)
    finally:
        reporter.close()
    lines = capsys.readouterr().out.splitlines()
    rates = [line.split("env frames/s=")[1].split(" ")[0] for line in lines if "frames/s" in line]
    assert len(rates) == seconds
    assert rates[0] == "0"  # one record: no window yet, the interval's own rate
    assert set(rates[int(RATE_WINDOW_S) :]) == {"100"}, rates
    logged = [r["env_frames_per_s"] for r in read_records(tmp_path / "metrics.jsonl")]
    assert set(logged) == {0.0, 200.0}
