"""CUDA paths: run with `pytest -m gpu` on a machine with a GPU; skipped elsewhere.

Each test stands for a path a CPU cannot show (tests/test_device_discipline.py checks
what it can): updates with minibatch indices on the device, bf16 autocast on CUDA,
inference copies on a GPU, state crossing Ray from a GPU learner to a driver, a
CUDA-trained run read back, resumed, evaluated and exported where no GPU exists, and
NCCL between two learners.
"""

from __future__ import annotations

import json
import os
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
from rlfabric.sparse import SparseConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("method", ["rigl", "set"])
def test_sparse_td3_updates_on_cuda(method):
    info = describe_env(EnvConfig(id="Pendulum-v1"))
    cls = ALGORITHMS["td3"]
    algo = cls(cls.config_cls(), info.observation_space, info.action_space, ModelConfig(), "cuda")
    algo.sparsify(SparseConfig(actor=0.9, critic=0.85, method=method, delta=3), 30, seed=0)
    rng = np.random.default_rng(0)
    for _ in range(12):
        algo.update(
            {
                "obs": rng.normal(size=(256, 3)).astype(np.float32),
                "action": rng.uniform(-2, 2, (256, 1)).astype(np.float32),
                "reward": rng.normal(size=256).astype(np.float32),
                "next_obs": rng.normal(size=(256, 3)).astype(np.float32),
                "discount": np.full(256, 0.99, np.float32),
            }
        )
    assert algo.sparse_metrics()["sparsity_actor"] == pytest.approx(0.9, abs=0.005)
    assert next(algo.actor.parameters()).is_cuda


def test_seed_learner_trains_and_infers_on_cuda(tmp_path, ray_session):
    run = {"stop": {"env_frames": 100_000}, "display": "none", "logdir": str(tmp_path)}
    result = Platform(
        arch="seed",
        algo=FAST_VTRACE,
        env={"id": "CartPole-v1", "num_envs": 64},
        resources={"num_gpus_per_learner": 1},
        run=run,
    ).fit()
    assert result.metrics["learner_on_gpu"] == 1.0
    assert result.metrics["episode_return_mean"] > 2 * 22.0


def _cuda_run(
    tmp_path: Path, arch: str | dict, algo: str | dict, env: str | dict, frames: int, **sections
):
    run = {
        "stop": {"env_frames": frames},
        "display": "none",
        "logdir": str(tmp_path),
        "name": "gpu",
        "checkpoint_interval_s": 1.0,
    }
    run.update(sections.pop("run", {}))
    resources = {"num_gpus_per_learner": 1, **sections.pop("resources", {})}
    return Platform(arch=arch, algo=algo, env=env, resources=resources, run=run, **sections).fit()


@pytest.mark.parametrize(
    ("arch", "algo", "env", "frames", "model"),
    [
        ("seed", "ppo", "CartPole-v1", 40_000, {}),  # randperm minibatches on the device
        ("seed", {"name": "vtrace", "num_minibatches": 4, "epochs": 2}, "CartPole-v1", 40_000, {}),
        ("impala", "vtrace", "CartPole-v1", 40_000, {"precision": "auto"}),  # mu on CPU runners
        ("ga3c", "a3c", "CartPole-v1", 40_000, {}),
        ("seed", "sac", "Pendulum-v1", 3_000, {"precision": "bf16"}),
        ("seed", "vtrace", "ALE/Pong-v5", 20_000, {}),  # the Atari preset: bf16 convolutions
    ],
)
def test_every_topology_and_algorithm_updates_on_cuda(
    tmp_path, ray_session, arch, algo, env, frames, model
):
    result = _cuda_run(tmp_path, arch, algo, env, frames, model=model)
    assert result.metrics["learner_on_gpu"] == 1.0
    assert result.metrics["learner_samples"] > 0
    assert result.metrics.get("skipped_updates", 0) == 0
    losses = [v for k, v in result.metrics.items() if k.endswith("loss")]
    assert losses and np.isfinite(losses).all()


def _fast_cartpole(tmp_path: Path, **resources):
    """SEED with the tests' fast V-trace on CartPole, 40k frames, learner on cuda."""
    env = {"id": "CartPole-v1", "num_envs": 64}
    return _cuda_run(tmp_path, "seed", FAST_VTRACE, env, 40_000, resources=resources)


@pytest.mark.parametrize("inference_device", ["cuda", "cpu"])
def test_inference_copy_on_its_own_device(tmp_path, ray_session, inference_device):
    result = _fast_cartpole(tmp_path, inference_device=inference_device)
    assert result.metrics["learner_on_gpu"] == 1.0
    assert result.metrics["learner_samples"] > 0


_CPU_DRIVER = """
import sys
import torch
from rlfabric.platform.cli import main
assert not torch.cuda.is_available()
code = main(["eval", sys.argv[1], "--episodes", "2"])
code = code or main(["export", sys.argv[1], "--out", sys.argv[2]])
sys.exit(code)
"""


def test_a_cuda_run_resumes_and_is_read_evaluated_and_exported_without_a_gpu(tmp_path, ray_session):
    """The driver saves what the GPU learner sends: CPU tensors, so a machine without a
    GPU (a CPU head node, a laptop) reads the checkpoints, evaluates and exports."""
    first = _cuda_run(tmp_path, "seed", "vtrace", "CartPole-v1", 30_000)
    resumed = _cuda_run(tmp_path, "seed", "vtrace", "CartPole-v1", 60_000, run={"resume": "auto"})
    assert resumed.metrics["env_frames"] >= 60_000
    assert "resumed from" in (Path(first.logdir) / "run.log").read_text()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", _CPU_DRIVER, first.logdir, str(tmp_path / "exported")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "greedy policy, 2 episodes" in done.stdout
    assert (tmp_path / "exported" / "policy.pt").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_learners_all_reduce_over_nccl(tmp_path, ray_session):
    result = _fast_cartpole(tmp_path, num_learners=2)
    assert result.metrics["learner_on_gpu"] == 1.0
    records = [json.loads(r) for r in (Path(result.logdir) / "metrics.jsonl").open()]
    assert records[-1]["learner_samples"] > 0
