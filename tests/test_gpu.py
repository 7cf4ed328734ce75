"""CUDA paths: run with `pytest -m gpu` on a machine with a GPU; skipped elsewhere."""

from __future__ import annotations

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
