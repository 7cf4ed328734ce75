"""Fault paths: NaN/inf losses are skipped and, in a row, stop the run with intact weights."""

from __future__ import annotations

from pathlib import Path

import faulty_envs  # noqa: F401 - registers NaNRewardCartPole-v0
import gymnasium as gym
import numpy as np
import pytest
import torch
from test_training import FAST_VTRACE, SHARED_TORSO

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS
from rlfabric.errors import RLFabricError
from rlfabric.models import ModelConfig
from rlfabric.platform.checkpoint import load_checkpoint


def test_a_nan_batch_skips_the_step_and_leaves_weights_alone():
    cls = ALGORITHMS["td3"]
    env = gym.make("Pendulum-v1")
    algo = cls(cls.config_cls(hidden=[16]), env.observation_space, env.action_space, ModelConfig())
    before = {k: v.clone() for k, v in algo.critic.state_dict().items()}
    batch = {
        "obs": np.zeros((8, 3), np.float32),
        "action": np.zeros((8, 1), np.float32),
        "reward": np.full(8, np.nan, np.float32),
        "next_obs": np.zeros((8, 3), np.float32),
        "discount": np.full(8, 0.99, np.float32),
    }
    metrics = algo.update(batch)
    assert not np.isfinite(metrics["critic_loss"])
    assert algo.nonfinite_steps == 1
    for key, value in algo.critic.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_nan_losses_in_a_row_stop_the_run_with_a_clear_error(tmp_path):
    run = {
        "stop": {"env_frames": 200_000},
        "display": "none",
        "logdir": str(tmp_path),
        "name": "nan",
        "max_nonfinite_updates": 5,
    }
    platform = Platform(
        arch="local",
        algo=FAST_VTRACE,
        env={"id": "NaNRewardCartPole-v0", "num_envs": 4, "vectorization": "sync"},
        run=run,
    )
    with pytest.raises(RLFabricError, match=r"5 updates in a row had a NaN or inf loss"):
        platform.fit()
    checkpoint = sorted((tmp_path / "nan" / "checkpoints").glob("ckpt_*.pt"))[-1]
    state = load_checkpoint(Path(checkpoint))
    assert state["counters"]["skipped_updates"] == 5
    for value in state["algorithm"]["model"].values():
        assert torch.isfinite(value).all()


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="needs a machine without GPUs; tests/test_gpu.py covers the learner on one",
)
def test_a_gpu_request_without_gpus_falls_back_to_cpu(tmp_path, ray_session, caplog):
    run = {"stop": {"env_frames": 3_000}, "display": "none", "logdir": str(tmp_path)}
    result = Platform(
        arch="seed",
        algo=FAST_VTRACE,
        env={"id": "CartPole-v1", "num_envs": 8},
        resources={"num_gpus_per_learner": 1},
        run=run,
    ).fit()
    assert "num_gpus_per_learner=1.0 but the cluster has 0.0 GPUs" in caplog.text
    assert result.metrics["learner_on_gpu"] == 0.0
    assert result.metrics["updates"] > 0


def test_runner_processes_killed_by_pid_are_replaced_and_learning_goes_on(ray_session, tmp_path):
    import os
    import signal

    from rlfabric.architectures.seed import SeedArchitecture

    platform = Platform(
        arch="seed",
        algo=FAST_VTRACE,
        model=SHARED_TORSO,
        env={"id": "CartPole-v1", "num_envs": 32},
        resources={"num_env_runners": 2},
        run={"report_interval_s": 0.5, "logdir": str(tmp_path)},
    )
    arch = SeedArchitecture(platform.spec, platform.env_info, platform.spec.run.stop)
    try:  # a start that fails half-way leaves actors for stop() to end
        arch.start()
        metrics = arch.step()
        for kill in range(3):
            pid = ray_session.get(arch.runners.runners[kill % 2].pid.remote())
            os.kill(pid, signal.SIGKILL)
            for _ in range(20):
                metrics = arch.step()
                if metrics["runner_restarts"] > kill:
                    break
            assert metrics["runner_restarts"] == kill + 1
        # Learning goes on: the 100-episode mean passes 3x random (22) within the budget.
        while metrics["env_frames"] < 150_000 and metrics.get("episode_return_mean", 0) <= 66:
            metrics = arch.step()
        assert metrics["dropped_unrolls"] >= 1  # partial unrolls of killed runners, counted
        assert metrics["episode_return_mean"] > 66
    finally:
        arch.stop()


def test_a_killed_driver_resumes_from_its_last_checkpoint(tmp_path):
    """SIGKILL the whole `rlfabric train` process group; `--resume` continues where it saved."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from rlfabric.platform.checkpoint import list_checkpoints

    rlfabric = Path(sys.executable).parent / "rlfabric"
    spec = Path(__file__).resolve().parents[1] / "examples/specs/cartpole_local_vtrace.yaml"
    cmd = [
        str(rlfabric),
        "train",
        str(spec),
        f"run.logdir={tmp_path}",
        "run.name=killed",
        "run.display=none",
        "run.checkpoint_interval_s=1",
        "run.stop.env_frames=100000000",
    ]
    driver = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.DEVNULL)
    folder = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 120
    while len(list_checkpoints(folder)) < 2 and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait(timeout=30)
    saved = load_checkpoint(list_checkpoints(folder)[-1])  # written atomically: loads whole
    frames = saved["counters"]["env_frames"]
    assert frames > 0
    resumed = Platform.resume(tmp_path / "killed", [f"run.stop.env_frames={frames + 20_000}"])
    # The resumed learner starts from the checkpoint's weights and optimizer state.
    from rlfabric.architectures.local import LocalArchitecture

    arch = LocalArchitecture(resumed.spec, resumed.env_info, resumed.spec.run.stop)
    arch.start(saved)
    restored = arch.get_state()["algorithm"]
    arch.stop()
    for key, value in saved["algorithm"]["model"].items():
        assert torch.equal(restored["model"][key], value), key
    result = resumed.fit()
    assert frames + 20_000 <= result.metrics["env_frames"] < frames + 200_000
    assert result.metrics["updates"] > saved["counters"]["updates"]


def test_a_learner_crash_ends_the_run_and_the_last_checkpoint_stays_intact(ray_session, tmp_path):
    from rlfabric.architectures.seed import SeedArchitecture
    from rlfabric.errors import ActorError
    from rlfabric.platform.checkpoint import save_checkpoint

    platform = Platform(
        arch="seed",
        algo=FAST_VTRACE,
        env={"id": "CartPole-v1", "num_envs": 16},
        run={"report_interval_s": 0.5, "logdir": str(tmp_path)},
    )
    arch = SeedArchitecture(platform.spec, platform.env_info, platform.spec.run.stop)
    try:  # a start that fails half-way leaves actors for stop() to end
        arch.start()
        arch.step()
        state = arch.get_state()
        path = save_checkpoint(tmp_path, state, state["counters"]["env_frames"], keep=3)
        ray_session.kill(arch.learner, no_restart=True)
        with pytest.raises(ActorError, match=r"^the learner died"):
            arch.step()
    finally:
        arch.stop()
    loaded = load_checkpoint(Path(path))
    assert loaded["counters"] == state["counters"]


def test_a_nonfinite_diagnostic_does_not_count_an_applied_update_as_skipped(monkeypatch):
    """Skipped is decided by the gradients alone (the algorithm's nonfinite_steps)."""
    from test_vtrace_algorithm import _batch

    from rlfabric.envs import describe_env
    from rlfabric.platform.spec import ExperimentSpec
    from rlfabric.runtime.learner import Learner

    spec = ExperimentSpec.build({"arch": "local", "algo": FAST_VTRACE, "env": "CartPole-v1"})
    learner = Learner(spec, describe_env(spec.env), None)
    algo = learner.algorithm
    update = algo.update
    monkeypatch.setattr(algo, "update", lambda batch: {**update(batch), "diagnostic": np.inf})
    batch = _batch()
    batch["obs"] = np.resize(batch["obs"], (*batch["obs"].shape[:2], 4))  # CartPole's 4-d obs
    batch["action"] %= 2
    before = [p.detach().clone() for p in algo.model.parameters()]
    learner.update(batch)
    assert (learner.counters["updates"], learner.counters["skipped_updates"]) == (1, 0)
    assert any(not torch.equal(a, b) for a, b in zip(before, algo.model.parameters()))
