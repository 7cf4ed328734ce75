"""Device discipline that a CPU can check: what a CUDA learner would get wrong.

Each test stands for a defect that would end the first GPU run; `pytest -m gpu`
(tests/test_gpu.py) runs the same paths on a GPU where one exists.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from test_a3c_ppo import ACT, OBS, _batch

from rlfabric import Platform
from rlfabric.algorithms import ppo, vtrace
from rlfabric.algorithms.ppo import PPO, PPOConfig
from rlfabric.algorithms.vtrace import VTrace, VTraceConfig
from rlfabric.models import ModelConfig
from rlfabric.models import config as model_config
from rlfabric.runtime.learner_process import LearnerProcess, detached_state


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in _tensors(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in _tensors(value)]
    return []


def test_learner_state_is_a_cpu_copy_that_shares_no_storage_with_the_live_weights(ray_session):
    """Ray serializes a method's return after the update lock is released: the state
    must be copied under it, to CPU (a driver without a GPU reads the checkpoint).
    The shared Ray session comes first: the learner asks Ray for its GPUs, which would
    otherwise start a Ray of its own without the test workers' import path."""
    platform = Platform(arch="seed", algo="vtrace", env="CartPole-v1")
    process = LearnerProcess(platform.spec, platform.env_info, None, None, env_groups=2, capacity=1)
    live = _storages(process.learner.algorithm.model.parameters())
    for state in (process.get_state(), process.algorithm_state(), process.snapshot()[1]):
        tensors = _tensors(state)
        assert tensors and all(t.device.type == "cpu" for t in tensors)
        assert not _storages(tensors) & live
    weight = next(process.learner.algorithm.model.parameters())
    copy = _tensors(process.algorithm_state())
    with torch.no_grad():
        weight.add_(1.0)  # an update after the call does not reach what it returned
    assert not any(torch.equal(t, weight) for t in copy if t.shape == weight.shape)


def test_policy_weights_are_copies_of_the_live_weights():
    """An IMPALA runner's `policy_weights` returned views that Ray serialized after the
    runner's loop had synced the next version into them (weights of version v + 1
    tagged v): `get_weights` must copy, on CPU too."""
    algo = PPO(PPOConfig(), OBS, ACT, ModelConfig(hidden=[8]))
    weights = algo.get_weights()
    for name, tensor in algo.model.state_dict().items():
        assert not np.shares_memory(weights[name], tensor.numpy())


def test_detached_state_keeps_the_structure_and_values():
    state = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": {"c": torch.arange(3)}, "d": "x"}
    out = detached_state(state)
    assert isinstance(out["a"], list) and isinstance(out["a"][1], tuple)
    assert out["a"][1][1] == 3 and out["d"] == "x"
    torch.testing.assert_close(out["b"]["c"], torch.arange(3))


def test_minibatch_index_is_made_on_the_given_device():
    parts = ppo.minibatch_indices(10, 3, torch.device("meta"))
    assert len(parts) == 3 and all(p.device.type == "meta" for p in parts)


@pytest.mark.parametrize(
    ("module", "algo"),
    [
        (
            ppo,
            lambda: PPO(PPOConfig(epochs=1, num_minibatches=2), OBS, ACT, ModelConfig(hidden=[8])),
        ),
        (
            vtrace,
            lambda: VTrace(
                VTraceConfig(epochs=2, num_minibatches=2), OBS, ACT, ModelConfig(hidden=[8])
            ),
        ),
    ],
)
def test_minibatched_updates_ask_for_the_index_on_the_batchs_device(monkeypatch, module, algo):
    """`index_select` on CUDA tensors refuses a CPU index: PPO and minibatched V-trace
    must ask for it on the device their batch tensors live on."""
    asked: list[torch.device] = []
    original = ppo.minibatch_indices

    def recording(size: int, n: int, device: torch.device) -> list[torch.Tensor]:
        asked.append(device)
        return original(size, n, device)

    monkeypatch.setattr(module, "minibatch_indices", recording)
    algorithm = algo()
    algorithm.update(_batch())
    assert asked and all(d == next(algorithm.model.parameters()).device for d in asked)


def test_auto_precision_on_cuda_counts_native_bf16_only(monkeypatch):
    """`torch.cuda.is_bf16_supported()` counts emulation (T4, V100) unless told not to."""
    calls: list[bool] = []

    def supported(including_emulation: bool = True) -> bool:
        calls.append(including_emulation)
        return including_emulation  # a GPU that only emulates bf16

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    model_config.native_bf16.cache_clear()
    try:
        assert model_config.native_bf16("cuda") is False
        assert calls == [False]
    finally:
        model_config.native_bf16.cache_clear()


def test_local_trains_on_the_gpu_the_spec_asks_for(monkeypatch, tmp_path):
    """`arch: local` with `resources.num_gpus_per_learner` asks for cuda (it trained on
    the CPU, then copied every update to an inference_device on cuda)."""
    from rlfabric.architectures import local

    asked = []

    def cpu_for_the_test(device: str) -> str:
        asked.append(device)
        return "cpu"

    monkeypatch.setattr(local, "available_device", cpu_for_the_test)
    for gpus, expected in ((1, ["cuda"]), (0, [])):
        asked.clear()
        platform = Platform(
            arch="local",
            algo="vtrace",
            env={"id": "CartPole-v1", "num_envs": 4},
            resources={"num_gpus_per_learner": gpus},
            run={"logdir": str(tmp_path), "display": "none"},
        )
        arch = local.LocalArchitecture(platform.spec, platform.env_info, platform.spec.run.stop)
        arch.start()
        arch.stop()
        assert asked == expected


@pytest.mark.parametrize(
    ("per_learner", "learners", "cluster", "placed"),
    [(1.0, 2, 2.0, 1.0), (1.0, 2, 1.0, 0.0), (0.5, 1, 1.0, 0.5), (1.0, 1, 0.0, 0.0)],
)
def test_learner_gpus_compare_the_cluster_with_every_learners_share(
    caplog, per_learner, learners, cluster, placed
):
    """Two learners of one GPU each on a one-GPU cluster could never be placed: the
    check counts all of them, not one learner's share."""
    from rlfabric.architectures.topology import learner_gpus
    from rlfabric.runtime.config import ResourcesConfig

    res = ResourcesConfig(num_learners=learners, num_gpus_per_learner=per_learner)
    assert learner_gpus(res, cluster) == placed
    if not placed:
        total = f" x num_learners={learners} = {per_learner * learners:g}" if learners > 1 else ""
        assert f"num_gpus_per_learner={per_learner}{total} but the cluster has" in caplog.text


def test_rng_state_restores_without_cuda_generators_here():
    """A CUDA run's checkpoint holds the CUDA generators; on a CPU they are skipped."""
    from rlfabric.runtime.learner import rng_state, set_rng_state

    state = rng_state()
    assert "cuda" not in state or torch.cuda.is_initialized()
    draws = torch.rand(3)
    saved = io.BytesIO()  # as a checkpoint holds it: torch.save, read with weights_only
    torch.save({**state, "cuda": [torch.zeros(16, dtype=torch.uint8)] * 99}, saved)
    saved.seek(0)
    set_rng_state(torch.load(saved, weights_only=True))
    assert torch.equal(torch.rand(3), draws)
