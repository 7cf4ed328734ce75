"""Trackers: W&B (offline) and MLflow (a real server on 127.0.0.1) get every metric against
env frames, the spec with its provenance, the run's files; a resumed run continues its
tracker run; a failing tracker costs the run nothing; a missing package fails first."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import TRACKER_QUIET

from rlfabric import Platform
from rlfabric.errors import SpecError
from rlfabric.platform import trackers
from rlfabric.platform.spec import ExperimentSpec
from rlfabric.platform.trackers import TRACKERS_FILE, Trackers

FRAMES = 2_000
SERVER_START_S = 240  # `mlflow server` takes 10-40 s to start on 2 busy cores


@pytest.fixture(autouse=True)
def quiet_trackers(monkeypatch, tmp_path):
    """Nothing leaves 127.0.0.1; wandb keeps its staging and cache in tmp_path."""
    for name, value in TRACKER_QUIET.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)


class _Server:
    """`mlflow server` (sqlite store, artifacts proxied into a folder) on a free port of
    127.0.0.1, started at once; `uri` waits until it answers."""

    def __init__(self, folder: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        folder.mkdir(parents=True, exist_ok=True)
        mlflow = Path(sys.executable).parent / "mlflow"
        cmd = [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--workers", "1"]
        cmd += ["--artifacts-destination", str(folder / "artifacts")]
        env = {**os.environ, **TRACKER_QUIET, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.log = open(folder / "server.log", "w")  # noqa: SIM115 - closed in stop()
        # its own process group: stop() ends the server and the workers it starts, no more
        self.process = subprocess.Popen(
            cmd,
            cwd=folder,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.ready = False

    @property
    def uri(self) -> str:
        uri = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + SERVER_START_S
        while not self.ready:
            assert self.process.poll() is None, "mlflow server exited; see its server.log"
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    self.ready = answer.status == 200
            except OSError:
                assert time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.5)
        return uri

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass
        self.log.close()


@pytest.fixture(scope="session", autouse=True)
def mlflow_server(tmp_path_factory):
    """Started with this file's first test, so that it comes up while the others run."""
    server = _Server(tmp_path_factory.mktemp("mlflow_server"))
    yield server
    server.stop()


def _run(tmp_path: Path, loggers: list[str], frames: int = FRAMES, **run) -> dict:
    return {
        "arch": "local",
        "env": {"id": "CartPole-v1", "num_envs": 16},
        "run": {
            "name": "job",
            "resume": "auto",
            "logdir": str(tmp_path / "runs"),
            "display": "none",
            "report_interval_s": 0.25,
            "checkpoint_interval_s": 0,
            "stop": {"env_frames": frames},
            "loggers": ["jsonl", "tensorboard", *loggers],
            **run,
        },
    }


def _records(logdir: Path) -> list[dict]:
    return [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]


def _assert_folder_complete(result) -> None:
    logdir = Path(result.logdir)
    frames = [r["env_frames"] for r in _records(logdir)]
    assert frames == sorted(frames) and frames[-1] == result.metrics["env_frames"] >= FRAMES
    assert (logdir / "curve.png").is_file() and (logdir / "spec.yaml").is_file()
    assert list((logdir / "tensorboard").glob("events.out.tfevents.*"))
    assert Path(result.checkpoint).is_file()


# -- the spec ---------------------------------------------------------------------------


def test_loggers_come_from_cli_overrides_and_keep_metrics_jsonl():
    spec = ExperimentSpec.build(
        {}, ["run.loggers=[jsonl,wandb,mlflow]", "run.wandb.project=p", "run.mlflow.experiment=e"]
    )
    assert spec.run.loggers == ["jsonl", "wandb", "mlflow"]
    assert (spec.run.wandb.project, spec.run.mlflow.experiment) == ("p", "e")
    assert ExperimentSpec.build({}).run.loggers == ["jsonl", "tensorboard"]  # as before
    with pytest.raises(SpecError, match=r"run\.loggers: must name jsonl"):
        ExperimentSpec.build({}, ["run.loggers=[wandb]"])
    with pytest.raises(SpecError, match=r"run\.loggers\.1: .*'wandb' or 'mlflow'.*comet"):
        ExperimentSpec.build({}, ["run.loggers=[jsonl,comet]"])
    with pytest.raises(SpecError, match=r"run\.wandb\.projekt: unknown field"):
        ExperimentSpec.build({}, ["run.wandb.projekt=p"])


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_tracker_package_fails_before_anything_starts(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # `import wandb` raises ImportError
    with pytest.raises(
        SpecError, match=rf"run\.loggers names {name}.*pip install 'rlfabric\[{name}\]'"
    ):
        Platform(_run(tmp_path, [name]))
    assert not (tmp_path / "runs").exists()  # no run folder, no actor, no Ray


def test_a_search_groups_its_trials_runs():
    from rlfabric.platform.tune import _Plan

    base = _run(Path("/tmp/unused"), ["wandb", "mlflow"])
    base["run"].pop("name"), base["run"].pop("resume")
    plan = _Plan(base, Path("/tmp/search_x"), "episode_return_mean", 2.0, None, "max", "abc123")
    spec = plan.spec({"algo.lr": 1e-3}, trial_id="t1")
    assert spec.run.wandb.group == "search_x" and spec.run.mlflow.parent_run_id == "abc123"
    best = plan.spec({"algo.lr": 1e-3})  # the best spec trains as a run of its own
    assert best.run.wandb.group is None and best.run.mlflow.parent_run_id is None


# -- off the report loop ----------------------------------------------------------------


class _Stuck(trackers.Tracker):
    """A tracker whose server does not answer a record until the test lets it."""

    name = "mlflow"
    answer = threading.Event()

    def start(self, saved):
        return {"run_id": "stuck"}

    def log(self, record, env_frames):
        self.answer.wait()


def test_a_stuck_tracker_never_holds_up_the_report_loop(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(trackers.TRACKERS, "mlflow", _Stuck)
    spec = ExperimentSpec.build(_run(tmp_path, ["mlflow"], mlflow={"close_timeout_s": 0.5}))
    group = Trackers(spec, tmp_path)
    record = {f"metric_{i}": float(i) for i in range(40)}
    with caplog.at_level(logging.WARNING, logger="rlfabric"):
        start = time.perf_counter()
        for frames in range(2 * trackers.QUEUE_RECORDS):
            group.log({**record, "env_frames": frames})
        took = time.perf_counter() - start
        problems = group.close(None, "finished")
    _Stuck.answer.set()  # its thread ends
    assert took < 2.0  # 2,000 records queued or dropped, none waited for
    dropped = [r for r in caplog.records if "falls behind" in r.message]
    assert len(dropped) == 1  # warned once
    assert any("close_timeout_s=0.5" in line for line in problems)
    assert json.loads((tmp_path / TRACKERS_FILE).read_text())["mlflow"] == {"run_id": "stuck"}


# -- W&B, offline -----------------------------------------------------------------------


def _wandb_records(path: Path) -> list:
    """The records of a .wandb file: LevelDB-log blocks of 32 KiB (wandb's own format:
    a 7-byte `:W&B` header, then chunks of crc32, length, kind) holding Record protos."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or a record's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_history(path: Path) -> list[dict]:
    rows = []
    for record in _wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


def test_wandb_offline_run_logs_history_config_files_and_resumes_the_same_run(tmp_path):
    run = {"wandb": {"project": "rlfabric-test", "tags": ["smoke"], "log_checkpoint": True}}
    spec = _run(tmp_path, ["wandb"], **run)
    first = Platform(spec).fit()
    logdir = Path(first.logdir)
    _assert_folder_complete(first)
    run_id = json.loads((logdir / TRACKERS_FILE).read_text())["wandb"]["id"]
    (offline,) = (tmp_path / "wandb_dir" / "wandb").glob(f"offline-run-*-{run_id}")
    records = _wandb_records(offline / f"run-{run_id}.wandb")
    history = _wandb_history(offline / f"run-{run_id}.wandb")
    logged = [(r["env_frames"], r.get("episode_return_mean")) for r in history]
    assert logged == [(r["env_frames"], r.get("episode_return_mean")) for r in _records(logdir)]
    (opened,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (opened.project, list(opened.tags), opened.display_name) == (
        "rlfabric-test",
        ["smoke"],
        "job",
    )
    config = {u.key: json.loads(u.value_json) for u in opened.config.update}
    resolved = Platform(spec).spec
    assert config["algo"]["lr"] == resolved.algo.lr
    assert config["provenance"]["algo"]["lr"] == resolved.origin(("algo", "lr"))
    assert config["provenance"]["run"]["loggers"] == "user"
    artifacts = {r.artifact.name: r.artifact.type for r in records if r.artifact.name}
    assert artifacts == {f"curve-{run_id}": "curve", f"checkpoint-{run_id}": "model"}

    spec["run"]["stop"]["env_frames"] = 2 * FRAMES  # run.resume: auto, a larger budget
    second = Platform(spec).fit()
    assert json.loads((logdir / TRACKERS_FILE).read_text())["wandb"]["id"] == run_id
    folders = sorted((tmp_path / "wandb_dir" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(folders) == 2  # `wandb sync` puts both into the one run
    resumed = _wandb_history(folders[-1] / f"run-{run_id}.wandb")
    assert resumed[0]["env_frames"] > logged[-1][0]
    assert resumed[-1]["env_frames"] == second.metrics["env_frames"]


# -- MLflow, a server on 127.0.0.1 ------------------------------------------------------


def test_mlflow_logs_metrics_params_files_and_a_resume_continues_its_run(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    mlflow = {"tracking_uri": mlflow_server.uri, "experiment": "tests", "log_checkpoint": True}
    spec = _run(tmp_path, ["mlflow"], mlflow=mlflow, seed=3)
    first = Platform(spec).fit()
    logdir = Path(first.logdir)
    _assert_folder_complete(first)
    client = MlflowClient(mlflow_server.uri)
    run_id = json.loads((logdir / TRACKERS_FILE).read_text())["mlflow"]["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "job"
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    history = client.get_metric_history(run_id, "env_frames")
    records = _records(logdir)
    assert [int(m.step) for m in history] == [int(r["env_frames"]) for r in records]
    returns = client.get_metric_history(run_id, "episode_return_mean")
    assert returns[-1].value == pytest.approx(records[-1]["episode_return_mean"])
    resolved = Platform(spec).spec
    params = run.data.params
    assert params["algo.lr"] == str(resolved.algo.lr) and params["run.seed"] == "3"
    assert params["provenance.algo.lr"] == resolved.origin(("algo", "lr"))
    assert params["provenance.run.seed"] == "user"
    assert params["provenance.algo.gamma"] == resolved.origin(("algo", "gamma")) != "user"
    files = {a.path for a in client.list_artifacts(run_id)}
    assert {"metrics.jsonl", "curve.png", "spec.yaml", "checkpoints"} <= files
    (saved,) = client.list_artifacts(run_id, "checkpoints")
    assert saved.path == f"checkpoints/{Path(first.checkpoint).name}"

    # `--resume` with a larger budget, an eval video in the folder, a PBT-like event
    (logdir / "eval_episode.gif").write_bytes(b"GIF89a")
    platform = Platform.resume(logdir, overrides=[f"run.stop.env_frames={2 * FRAMES}"])
    platform.log_event("pbt_exploit", {"donor": "t0"})
    second = platform.fit()
    assert json.loads((logdir / TRACKERS_FILE).read_text())["mlflow"]["run_id"] == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    steps = [int(m.step) for m in client.get_metric_history(run_id, "env_frames")]
    assert steps == [int(r["env_frames"]) for r in _records(logdir)]
    assert steps[-1] == second.metrics["env_frames"] >= 2 * FRAMES
    assert run.data.params["run.stop.env_frames"] == str(FRAMES)  # params cannot change
    assert run.data.tags["resumed.run.stop.env_frames"] == str(2 * FRAMES)
    start = int(first.metrics["env_frames"])
    assert json.loads(run.data.tags[f"event.pbt_exploit.{start}"]) == {"donor": "t0"}
    assert {a.path for a in client.list_artifacts(run_id, "videos")} == {"videos/eval_episode.gif"}
    assert len(client.list_artifacts(run_id, "checkpoints")) == 2


class _Failing(trackers.MlflowTracker):
    """MLflow whose second record raises, as a server that went away mid-run."""

    def log(self, record, env_frames):
        self.logged = getattr(self, "logged", 0) + 1
        if self.logged > 1:
            raise ConnectionError("the server went away")
        super().log(record, env_frames)


@pytest.mark.parametrize("failure", ["log_raises", "server_gone"])
def test_a_failing_tracker_warns_once_and_the_run_and_its_folder_are_whole(
    tmp_path, monkeypatch, capsys, mlflow_server, failure
):
    if failure == "log_raises":
        monkeypatch.setitem(trackers.TRACKERS, "mlflow", _Failing)
        uri = mlflow_server.uri
    else:  # nothing listens there: the first request fails (at once, with no retries)
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            uri = f"http://127.0.0.1:{s.getsockname()[1]}"
    spec = _run(tmp_path, ["mlflow"], mlflow={"tracking_uri": uri}, display="plain")
    result = Platform(spec).fit()
    _assert_folder_complete(result)
    assert result.stop_reason.startswith("env_frames")
    warnings = [
        line
        for line in (Path(result.logdir) / "run.log").read_text().splitlines()
        if "mlflow failed" in line
    ]
    assert len(warnings) == 1, warnings
    assert ("in log" if failure == "log_raises" else "in start") in warnings[0]
    assert "trackers:   mlflow failed during the run: see run.log" in capsys.readouterr().out


def test_a_search_nests_its_trials_mlflow_runs_under_its_own(ray_session, tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    mlflow = {"tracking_uri": mlflow_server.uri, "experiment": "search"}
    spec = _run(tmp_path, ["mlflow"], mlflow=mlflow)
    spec["run"].update(name="search", resume="never")
    spec["tune"] = {"scheduler": {"name": "fifo"}, "search": {"algo.lr": {"choice": [1e-3]}}}
    result = Platform(spec).tune()
    client = MlflowClient(mlflow_server.uri)
    parent_id = json.loads((Path(result.logdir) / TRACKERS_FILE).read_text())["mlflow"]["run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.run_name == "search" and parent.info.status == "FINISHED"
    assert {"trials.csv", "trials.png", "best_spec.yaml"} <= {
        a.path for a in client.list_artifacts(parent_id)
    }
    assert parent.data.params["tune.search.algo.lr.choice"] == "[0.001]"
    (trial,) = result.rows
    (child,) = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'"
    )
    assert child.info.run_name == trial["trial"] and child.info.status == "FINISHED"
    steps = [int(m.step) for m in client.get_metric_history(child.info.run_id, "env_frames")]
    assert steps == [int(r["env_frames"]) for r in _records(Path(result.logdir) / trial["trial"])]
