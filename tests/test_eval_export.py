"""`rlfabric eval` and `rlfabric export`: greedy evaluation, video, and standalone policies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_training import FAST_VTRACE

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS
from rlfabric.envs import EnvConfig, describe_env
from rlfabric.models import ModelConfig
from rlfabric.platform.cli import main
from rlfabric.platform.evaluate import evaluate
from rlfabric.platform.export import example_inputs, export_policy
from rlfabric.platform.spec import ExperimentSpec


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory) -> Path:
    logdir = tmp_path_factory.mktemp("runs")
    run = {"stop": {"env_frames": 60_000}, "display": "none", "logdir": str(logdir), "name": "cp"}
    env = {"id": "CartPole-v1", "num_envs": 64}
    Platform(arch="local", algo=FAST_VTRACE, env=env, run=run).fit()
    return logdir / "cp"


def test_eval_prints_mean_and_std_and_records_a_video(cartpole_run, capsys):
    assert main(["eval", str(cartpole_run), "--episodes", "4", "--video"]) == 0
    out = capsys.readouterr().out
    assert "CartPole-v1, greedy policy, 4 episodes: return" in out
    video = next(cartpole_run.glob("eval_episode.*"))
    assert video.suffix in {".gif", ".mp4"} and video.stat().st_size > 1_000


def test_eval_plays_one_whole_episode_per_env():
    info = describe_env(EnvConfig(id="CartPole-v1"))
    cls = ALGORITHMS["vtrace"]
    algo = cls(cls.config_cls(), info.observation_space, info.action_space, ModelConfig())
    result = evaluate(algo, EnvConfig(id="CartPole-v1"), episodes=6)
    assert result.returns.shape == (6,) and np.isfinite(result.returns).all()
    np.testing.assert_array_equal(result.returns, result.lengths)  # CartPole: +1 per step


@pytest.mark.parametrize(
    ("algo", "env", "model"),
    [
        ("vtrace", "CartPole-v1", {}),
        ("ppo", "Pendulum-v1", {}),
        ("ppo", "Pendulum-v1", {"shared_torso": False}),
        ("a3c", "CartPole-v1", {"lstm": 16}),
        ("sac", "Pendulum-v1", {}),
        ("td3", "Pendulum-v1", {}),
    ],
)
def test_exported_policy_acts_as_the_live_one(tmp_path, algo, env, model):
    spec = ExperimentSpec.build({"env": env, "algo": algo, "model": model})
    info = describe_env(spec.env)
    live = ALGORITHMS[algo](spec.algo, info.observation_space, info.action_space, spec.model)
    export_policy(spec, live, tmp_path, ("torchscript",))
    policy = torch.jit.load(str(tmp_path / "policy.pt"))
    inputs = example_inputs(live, batch=5)
    obs = inputs[0].numpy()
    if len(inputs) == 1:
        expected = live.act(obs, deterministic=True)[0]
        np.testing.assert_allclose(policy(inputs[0]).numpy(), expected, rtol=1e-5, atol=1e-6)
    else:  # recurrent: same actions and the same next state
        state, first = live.initial_state(5), np.ones(5, bool)
        expected, _, expected_state = live.act(obs, state, first, deterministic=True)
        action, next_state = policy(*inputs)
        np.testing.assert_array_equal(action.numpy(), expected)
        np.testing.assert_allclose(next_state.numpy(), expected_state, rtol=1e-5, atol=1e-6)


def test_export_cli_writes_a_policy_that_loads_without_rlfabric(cartpole_run, tmp_path):
    out = tmp_path / "exported"
    assert main(["export", str(cartpole_run), "--out", str(out)]) == 0
    # The example script imports torch and numpy only; run it from an empty folder.
    done = subprocess.run(
        [sys.executable, "-I", str(out / "load_policy.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "CartPole-v1: action" in done.stdout


def test_unknown_export_format_is_a_user_error(cartpole_run, capsys):
    assert main(["export", str(cartpole_run), "--format", "tflite"]) == 2
    assert "unknown export format 'tflite'; allowed: torchscript, onnx" in capsys.readouterr().err


def test_periodic_evaluation_during_training(tmp_path):
    run = {
        "stop": {"env_frames": 30_000},
        "display": "none",
        "logdir": str(tmp_path),
        "eval_interval_s": 0.5,
        "eval_episodes": 3,
        "report_interval_s": 0.25,
    }
    env = {"id": "CartPole-v1", "num_envs": 64}
    result = Platform(arch="local", algo=FAST_VTRACE, env=env, run=run).fit()
    records = (Path(result.logdir) / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, records) if "eval_return_mean" in r]
    assert evals and all(r["eval_return_mean"] >= 8 for r in evals)  # CartPole: >= 8 steps
    assert "eval_return_std" in result.metrics


def test_set_weights_takes_read_only_arrays_without_a_warning():
    """Weights from Ray's object store are read-only; loading them (an IMPALA runner's
    broadcast, the driver's periodic evaluation) must not warn. torch warns once per
    process, so this runs in a fresh interpreter with warnings as errors."""
    script = """
import numpy as np
from rlfabric.algorithms import ALGORITHMS
from rlfabric.envs import EnvConfig, describe_env
from rlfabric.models import ModelConfig

info = describe_env(EnvConfig(id="CartPole-v1"))
cls = ALGORITHMS["vtrace"]
algorithm = cls(cls.config_cls(), info.observation_space, info.action_space, ModelConfig())
weights = {k: v.copy() + 1.0 for k, v in algorithm.get_weights().items()}
for array in weights.values():
    array.flags.writeable = False
algorithm.set_weights(weights)
assert all(np.array_equal(algorithm.get_weights()[k], v) for k, v in weights.items())
"""
    done = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", script], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
