"""Search on Ray Tune: the spec's tune section, and a small ASHA search end to end."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
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
        ({"scheduler": {"name": "pbt"}}, "tune.scheduler.name"),
        ({"mode": "best"}, "tune.mode"),
    ],
)
def test_bad_tune_section_names_the_field(tune, named):
    with pytest.raises(SpecError, match=named.replace(".", r"\.")) as err:
        _spec(tune)
    if tune.get("scheduler"):
        assert "'asha' or 'fifo'" in str(err.value)
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
