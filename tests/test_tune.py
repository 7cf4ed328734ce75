"""Search on Ray Tune: the spec's tune section, and a small ASHA search end to end."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_training import FAST_VTRACE

from rlfabric import Platform
from rlfabric.errors import SpecError
from rlfabric.platform.spec import ExperimentSpec


def _spec(tune: dict) -> ExperimentSpec:
    return ExperimentSpec.build({"env": "CartPole-v1", "tune": tune})


@pytest.mark.parametrize(
    ("tune", "named"),
    [
        ({"search": {"algo.lrr": {"choice": [1e-3]}}}, "tune.search.algo.lrr"),
        ({"search": {"algo.lr": {"normal": [0.0, 1.0]}}}, "tune.search.algo.lr"),
        ({"search": {"algo.lr": {"loguniform": [0.0, 1e-2]}}}, "tune.search.algo.lr"),
        ({"search": {"algo.lr": {"uniform": [1e-2, 1e-3]}}}, "tune.search.algo.lr"),
        ({"search": {"algo.lr": {"choice": ["fast"]}}}, "tune.search.algo.lr"),
        ({"search": {"arch.name": {"grid": ["seed", "gorila"]}}}, "tune.search.arch.name"),
        ({"scheduler": {"name": "hyperband"}}, "tune.scheduler.name"),
        ({"mode": "best"}, "tune.mode"),
        (
            {"scheduler": {"name": "pbt"}, "search": {"arch.name": {"choice": ["seed"]}}},
            "tune.search.arch.name",
        ),
        (
            {"scheduler": {"name": "pbt"}, "search": {"model.hidden": {"choice": [[32]]}}},
            "tune.search.model.hidden",
        ),
        ({"scheduler": {"name": "pbt"}}, "tune.search"),
        ({"scheduler": {"name": "pbt", "quantile_fraction": 0.75}}, "tune.scheduler.quantile"),
    ],
)
def test_bad_tune_section_names_the_field(tune, named):
    with pytest.raises(SpecError, match=named.replace(".", r"\.")) as err:
        _spec(tune)
    scheduler = tune.get("scheduler", {}).get("name")
    if scheduler == "hyperband":
        assert "'asha', 'pbt' or 'fifo'" in str(err.value)
    if tune.get("search") and scheduler == "pbt":
        assert "cannot change mid-run" in str(err.value) and "algo.lr" in str(err.value)
    if "normal" in str(tune):
        assert "uniform, loguniform, randint, choice, grid" in str(err.value)


def test_tune_section_round_trips_and_stays_out_of_plain_specs(tmp_path):
    search = {"algo.lr": {"loguniform": [1e-4, 1e-2]}, "algo.entropy_cost": {"grid": [0.0, 0.01]}}
    spec = _spec({"num_samples": 4, "search": search})
    path = tmp_path / "spec.yaml"
    path.write_text(spec.to_yaml())
    assert ExperimentSpec.from_yaml(path).tune == spec.tune
    assert yaml.safe_load(path.read_text())["tune"]["search"] == search
    assert "tune" not in ExperimentSpec.build({"env": "CartPole-v1"}).to_dict()


@pytest.mark.parametrize("arch", ["local", "seed"])  # seed: runners in the trial's group
def test_asha_search_writes_trials_and_a_best_spec_that_trains(ray_session, tmp_path, arch):
    frames = 6_000
    platform = Platform(
        env={"id": "CartPole-v1", "num_envs": 16},
        arch=arch,
        algo=FAST_VTRACE,
        model={"shared_torso": True},
        run={
            "stop": {"env_frames": frames},
            "report_interval_s": 0.2,
            "return_window": 5,
            "logdir": str(tmp_path),
            "name": "search",
        },
        tune={
            "num_samples": 2,
            "scheduler": {"name": "asha", "grace_frames": 2_000},
            "search": {"algo.lr": {"loguniform": [1e-3, 1e-2]}},
        },
    )
    result = platform.tune()
    folder = tmp_path / "search"
    assert result.logdir == str(folder)
    rows = list(csv.DictReader((folder / "trials.csv").open()))
    assert len(rows) == len(result.rows) == 2
    for row in rows:
        assert 1e-3 <= float(row["algo.lr"]) <= 1e-2
        assert not row["status"].startswith("error"), row["status"]
        records = [
            json.loads(line)
            for line in (folder / row["trial"] / "metrics.jsonl").read_text().splitlines()
        ]
        assert records and records[-1]["env_frames"] <= frames + 2_000
        assert (folder / row["trial"] / "spec.yaml").is_file()
        assert list((folder / row["trial"] / "checkpoints").glob("*"))  # final checkpoint
    best = ExperimentSpec.from_yaml(folder / "best_spec.yaml")
    assert best.tune is None
    assert best == result.best_spec
    assert best.run.name is None and best.run.logdir == str(tmp_path)
    assert best.algo.lr in [float(row["algo.lr"]) for row in rows]
    assert best.resources.learner_cpus is None  # a trial's CPU share is not the user's
    assert "algo.lr" in result.table()


@pytest.mark.parametrize("arch", ["local", "seed", "impala", "ga3c"])
@pytest.mark.parametrize("at_once", [1, 2, 4])
def test_trials_never_ask_for_more_cpus_than_their_share(ray_session, arch, at_once):
    """Trials that run at once fit the cluster together: each group holds at most its
    share of the CPUs, and the run's own asks (learner, runners) fit in its group."""
    from rlfabric.platform.tune import _Plan

    spec = ExperimentSpec.build({"arch": arch, "algo": "vtrace", "env": "CartPole-v1"})
    share = ray_session.cluster_resources()["CPU"] / at_once
    plan = _Plan(spec.user_values(), Path("unused"), "episode_return_mean", share, None)
    group = plan.placement({})
    assert group.required_resources.get("CPU", 0.0) <= share + 1e-9
    trial = plan.spec({}, trial_id="t")
    learner = next(b for b in group.bundles if b)
    assert trial.resources.learner_cpus <= learner["CPU"]


def test_pbt_perturbation_past_the_frame_budget_fails_before_ray(tmp_path):
    platform = Platform(
        env="CartPole-v1",
        run={"stop": {"env_frames": 10_000}, "logdir": str(tmp_path)},
        tune={
            "scheduler": {"name": "pbt", "perturbation_frames": 10_000},
            "search": {"algo.lr": {"loguniform": [1e-4, 1e-2]}},
        },
    )
    with pytest.raises(SpecError, match=r"tune\.scheduler\.perturbation_frames=10,000"):
        platform.tune()
    assert not list(tmp_path.iterdir())  # no search folder, no Ray


def test_resume_from_a_given_checkpoint_starts_from_its_weights_with_the_new_lr(tmp_path):
    """What a PBT exploit does in a trial: an earlier (or another run's) checkpoint,
    not the newest, restored exactly, with the spec's new values."""
    from rlfabric.architectures import ARCHITECTURES
    from rlfabric.platform.checkpoint import list_checkpoints, load_checkpoint

    run = {"logdir": str(tmp_path), "name": "donor", "report_interval_s": 0.2}
    spec = {"env": {"id": "CartPole-v1", "num_envs": 8}, "arch": "local", "algo": FAST_VTRACE}
    Platform(**spec, run={**run, "stop": {"env_frames": 3_000}}).fit()
    Platform.resume(tmp_path / "donor", ["run.stop.env_frames=6000"]).fit()
    older, newest = list_checkpoints(tmp_path / "donor" / "checkpoints")[-2:]
    saved = load_checkpoint(older)
    assert saved["counters"]["env_frames"] < load_checkpoint(newest)["counters"]["env_frames"]

    platform = Platform.resume(tmp_path / "donor", ["algo.lr=0.0123"], checkpoint=older)
    state, _, path = platform._prepare_logdir()
    assert path == older
    stop = platform.spec.stop_conditions(platform.env_info.reward_threshold)
    arch = ARCHITECTURES["local"](platform.spec, platform.env_info, stop)
    arch.start(state)
    try:
        weights = arch.policy_weights()
        model = saved["algorithm"]["model"]
        assert set(weights) <= set(model)
        for key, value in weights.items():
            assert torch.equal(torch.as_tensor(value), model[key]), key
        optimizer = arch.learner.algorithm.optimizer
        assert {group["lr"] for group in optimizer.param_groups} == {0.0123}
    finally:
        arch.stop()


@pytest.mark.parametrize("running", [False, True])
def test_synch_pbt_runs_a_paused_trial_when_all_stand_at_the_sync_point(running):
    """Ray's synchronous PBT set the next sync point to the frames of a donor that went
    past one interval, and its exploiter took the same frames: both paused trials stood
    at the point, none below it, and the search waited forever (seen once in the suite).
    With a trial still running, the paused ones wait for it as before."""
    from ray.tune.experiment import Trial
    from ray.tune.schedulers.pbt import PopulationBasedTraining, _PBTTrialState

    from rlfabric.platform.tune import _PBT

    class FakeTrial:
        PENDING, PAUSED, RUNNING = Trial.PENDING, Trial.PAUSED, Trial.RUNNING
        experiment_tag = ""

        def __init__(self, status: str) -> None:
            self.status = status

    class FakeController:
        def __init__(self, trials: list[FakeTrial]) -> None:
            self.trials = trials

        def get_trials(self) -> list[FakeTrial]:
            return self.trials

    def after_overshoot(kind: type) -> tuple[Any, list[FakeTrial]]:
        trials = [FakeTrial(Trial.PAUSED), FakeTrial(Trial.PAUSED)]
        if running:
            trials.append(FakeTrial(Trial.RUNNING))
        pbt = kind(
            time_attr="env_frames",
            perturbation_interval=2_000,
            hyperparam_mutations={"algo.lr": [1e-3, 1e-2]},
            synch=True,
        )
        for trial in trials:
            pbt._trial_state[trial] = _PBTTrialState(trial)
            pbt._trial_state[trial].last_train_time = 4_500  # the donor's frames, copied
        pbt._next_perturbation_sync = 4_500  # max(2,000 + 2,000, 4,500)
        return pbt, trials

    stock, trials = after_overshoot(PopulationBasedTraining)
    assert stock.choose_trial_to_run(FakeController(trials)) is None  # Ray's stall
    pbt, trials = after_overshoot(_PBT)
    chosen = pbt.choose_trial_to_run(FakeController(trials))
    if running:
        assert chosen is None
    else:
        assert chosen in trials[:2]
        assert pbt._next_perturbation_sync == 4_501


def test_pbt_exploit_copies_the_donor_and_perturbs_only_searched_values(ray_session, tmp_path):
    """Two trials in step (synch): at each perturbation point the worse one goes on
    from the better one's checkpoint with perturbed values, and says so."""
    from rlfabric.platform.checkpoint import load_checkpoint
    from rlfabric.platform.facade import _flatten
    from rlfabric.platform.tune import LINEAGE, SOURCE

    search = {
        "algo.lr": {"loguniform": [1e-3, 1e-2]},
        "algo.entropy_cost": {"uniform": [0.0, 0.02]},
    }
    result = Platform(
        env={"id": "CartPole-v1", "num_envs": 16},
        arch="local",
        algo=FAST_VTRACE,
        run={
            "stop": {"env_frames": 8_000},
            "report_interval_s": 0.2,
            "return_window": 5,
            "logdir": str(tmp_path),
            "name": "pbt",
            "keep_checkpoints": 10,  # the copy of each trial's last donor stays
        },
        tune={
            "num_samples": 2,
            "scheduler": {
                "name": "pbt",
                "perturbation_frames": 2_000,
                "quantile_fraction": 0.5,
                "synch": True,
            },
            "search": search,
        },
    ).tune()
    folder = tmp_path / "pbt"
    assert all(row["status"].startswith("done") for row in result.rows), result.table()
    exploits = {row["trial"]: row["exploits"] for row in result.rows}
    assert sum(exploits.values()) >= 1, result.table()
    assert (folder / "trials.png").stat().st_size > 0
    donors = {}  # (trial, checkpoint) -> Tune's copy of that checkpoint
    for source in (folder / "ray_tune").rglob(SOURCE):
        saved = json.loads(source.read_text())
        donors[saved["trial"], saved["checkpoint"]] = source.parent / saved["checkpoint"]
    for trial, count in exploits.items():
        start, *lineage = [
            json.loads(x) for x in (folder / trial / LINEAGE).read_text().splitlines()
        ]
        assert start["env_frames"] == 0 and set(start["config"]) == set(search)
        assert len(lineage) == count
        for entry in lineage:
            assert entry["donor"] != trial and set(entry["config"]) == set(search)
            assert 1e-3 <= entry["config"]["algo.lr"] <= 1e-2  # explore keeps the range
            # the run went on from the donor's checkpoint (or, given one at the frame
            # budget, said it had nothing left to train)
            log = (folder / trial / "run.log").read_text()
            at = f"{entry['checkpoint']} at {entry['env_frames']:,} env frames"
            assert f"resumed from {at}" in log or f"at {entry['checkpoint']} already" in log
        last = lineage[-1] if lineage else None
        if last is None:
            continue
        # The trial's copy of its last donor's checkpoint is the donor's, tensor for tensor.
        copy = load_checkpoint(folder / trial / "checkpoints" / last["checkpoint"])
        donor = load_checkpoint(donors[last["donor"], last["checkpoint"]])
        for key, tensor in donor["algorithm"]["model"].items():
            assert torch.equal(copy["algorithm"]["model"][key], tensor), key
        # Its spec differs from its donor's in the searched values (and its name) only.
        ours = _flatten(ExperimentSpec.from_yaml(folder / trial / "spec.yaml").to_dict())
        theirs = _flatten(ExperimentSpec.from_yaml(folder / last["donor"] / "spec.yaml").to_dict())
        differ = {k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)}
        assert differ <= {"algo.lr", "algo.entropy_cost", "run.name"}, differ


def test_interrupt_stops_trials_with_a_checkpoint_and_resume_runs_only_the_unfinished(
    ray_session, tmp_path
):
    """Ctrl-C in the middle of the second of two trials (one at a time): the second
    ends with a final checkpoint, `--resume` finishes it from there and leaves the
    first alone. Both commands join the session's Ray (`--address`), as on a cluster."""
    address = ["--address", ray_session.get_runtime_context().gcs_address]
    spec = tmp_path / "search.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "arch": "local",
                "env": {"id": "CartPole-v1", "num_envs": 8},
                "algo": FAST_VTRACE,
                "run": {"logdir": str(tmp_path), "name": "search", "report_interval_s": 0.2},
                "tune": {
                    "max_concurrent_trials": 1,
                    "scheduler": {"name": "fifo"},
                    # in this order: a short first trial, a second long enough to interrupt
                    "search": {"run.stop.env_frames": {"grid": [2_000, 30_000]}},
                },
            }
        )
    )
    cli = [sys.executable, "-m", "rlfabric.platform.cli", "tune"]
    proc = subprocess.Popen(
        [*cli, str(spec), *address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as a terminal's process has it (see test_cli's Ctrl-C test)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    folder = tmp_path / "search"

    def trials() -> dict[float, Path]:
        """Trial folders by their frame budget."""
        found = {}
        for run in folder.glob("*/spec.yaml") if folder.is_dir() else []:
            found[ExperimentSpec.from_yaml(run).run.stop.env_frames] = run.parent
        return found

    deadline = time.time() + 180
    while time.time() < deadline:
        metrics = trials().get(30_000, tmp_path / "none") / "metrics.jsonl"
        if metrics.is_file() and metrics.stat().st_size:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err
    assert f"rlfabric tune --resume {folder}" in err
    first, second = trials()[2_000], trials()[30_000]
    assert "search interrupted" in (second / "run.log").read_text()
    assert list((second / "checkpoints").glob("ckpt_*.pt"))
    first_log = (first / "run.log").read_text()

    done = subprocess.run(
        [*cli, "--resume", str(folder), *address], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    # finished (and one trial at a time: it was, before the second started): not run again
    assert (first / "run.log").read_text() == first_log
    assert "resumed from ckpt_" in (second / "run.log").read_text()
    rows = list(csv.DictReader((folder / "trials.csv").open()))
    assert sorted(float(r["env_frames"]) >= float(r["run.stop.env_frames"]) for r in rows) == [
        True,
        True,
    ]
    assert all(r["status"].startswith("done") for r in rows), rows
