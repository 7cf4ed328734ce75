"""Bring your own env: an id registered only in the driver, an env creator function, and
`rlfabric train --import MODULE`, under every architecture with env runner actors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import faulty_envs
import gymnasium as gym
import pytest
from test_training import FAST_VTRACE

from rlfabric import Platform

ROOT = Path(__file__).resolve().parents[1]
# Registered here only: the env runners' processes never import this test module.
gym.register(
    "DriverOnlyCartPole-v0",
    entry_point=faulty_envs.NaNCartPole,
    max_episode_steps=500,
    kwargs={"good_steps": 10**9},
)


def _run(tmp_path: Path, arch: str, env) -> dict[str, float]:
    return (
        Platform(
            arch=arch,
            algo=FAST_VTRACE,
            env=env,
            run={"display": "none", "logdir": str(tmp_path), "stop": {"env_frames": 1_500}},
        )
        .fit()
        .metrics
    )


@pytest.mark.parametrize("arch", ["seed", "impala", "ga3c"])
def test_an_env_registered_only_in_the_driver_runs_under_ray(ray_session, tmp_path, arch):
    metrics = _run(tmp_path, arch, {"id": "DriverOnlyCartPole-v0", "num_envs": 4})
    assert metrics["env_frames"] >= 1_500 and metrics["runner_restarts"] == 0


def test_an_env_creator_function_runs_under_ray(ray_session, tmp_path):
    metrics = _run(tmp_path, "seed", faulty_envs.short_cartpole)
    assert metrics["env_frames"] >= 1_500 and metrics["runner_restarts"] == 0


def test_train_import_registers_the_users_env_in_every_process(tmp_path):
    (tmp_path / "my_envs.py").write_text(
        textwrap.dedent(
            """
            import gymnasium as gym
            from gymnasium.envs.classic_control import CartPoleEnv

            class MyCartPole(CartPoleEnv):
                pass

            gym.register("MyCartPole-v0", entry_point=MyCartPole, max_episode_steps=200)
            """
        )
    )
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "arch: seed\nalgo: {name: vtrace, batch_size: 4, unroll_length: 10}\n"
        "env: {id: MyCartPole-v0, num_envs: 4}\nresources: {num_cpus: 2}\n"
        f"run: {{logdir: {tmp_path}, name: mine, display: none, stop: {{env_frames: 1000}}}}\n"
    )
    # The console script, as a user runs it: its sys.path starts with the venv's bin, not
    # the folder it runs in (`python -m` would put the folder there and hide that).
    rlfabric = str(Path(sys.executable).parent / "rlfabric")

    def cli(*args: str) -> str:
        out = subprocess.run(
            [rlfabric, *args], cwd=tmp_path, capture_output=True, text=True, timeout=180
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "MyCartPole-v0" in cli("spec", "show", "--import", "my_envs", str(spec))
    cli("train", "--import", "my_envs", str(spec))
    assert list((tmp_path / "mine" / "checkpoints").glob("ckpt_*.pt"))
    assert "MyCartPole-v0, greedy policy, 1 episodes" in cli(
        "eval", "--import", "my_envs", str(tmp_path / "mine"), "--episodes", "1"
    )
