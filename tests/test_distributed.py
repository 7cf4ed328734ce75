"""Data-parallel learners: shards + gradient all-reduce equal one learner on the whole batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from test_training import FAST_VTRACE, SHARED_TORSO

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS
from rlfabric.envs import EnvConfig, describe_env
from rlfabric.models import ModelConfig
from rlfabric.runtime.distributed import GradientAllReduce, join_group, leave_group, shard_batch
from rlfabric.sparse import SparseConfig


def _batch(seed: int, T: int = 6, B: int = 8) -> dict[str, np.ndarray]:
    """A CartPole-shaped trajectory batch without autoreset steps (every step valid)."""
    rng = np.random.default_rng(seed)
    terminated = np.zeros((T, B), bool)
    terminated[2, 1] = True
    return {
        "obs": rng.normal(size=(T + 1, B, 4)).astype(np.float32),
        "is_first": np.zeros((T + 1, B), bool),
        "action": rng.integers(0, 2, size=(T, B)),
        "reward": rng.normal(size=(T, B)).astype(np.float32),
        "terminated": terminated,
        "truncated": np.zeros((T, B), bool),
        "logp": np.log(rng.uniform(0.3, 0.7, size=(T, B))).astype(np.float32),
        "policy_version": np.zeros((T, B), np.int64),
    }


def _algorithm(reduction: str):
    torch.manual_seed(0)
    info = describe_env(EnvConfig(id="CartPole-v1"))
    cls = ALGORITHMS["vtrace"]
    cfg = cls.config_cls(loss_reduction=reduction, optimizer="adam", lr=1e-2)
    return cls(cfg, info.observation_space, info.action_space, ModelConfig())


def _rank(rank: int, world: int, address: str, reduction: str, out: dict) -> None:
    torch.set_num_threads(1)
    join_group(address, rank, world, "cpu")
    algorithm = _algorithm(reduction)
    algorithm.grad_sync = GradientAllReduce(world, algorithm.loss_reduction)
    for step in range(3):
        algorithm.update(shard_batch(_batch(step), world)[rank])
    out[rank] = {k: v.clone() for k, v in algorithm.model.state_dict().items()}
    leave_group()


def test_shards_split_the_batch_axis():
    trajectory = shard_batch(_batch(0), 2)
    assert trajectory[0]["obs"].shape == (7, 4, 4) and trajectory[1]["reward"].shape == (6, 4)
    replay = shard_batch({"reward": np.arange(8), "obs": np.zeros((8, 3))}, 4)
    assert [s["reward"].tolist() for s in replay] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="a batch of 8 does not split into 3 equal shards"):
        shard_batch(_batch(0), 3)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_two_learners_equal_one_learner_on_the_whole_batch(reduction):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(2, address, reduction, out), nprocs=2, join=True)
        ranks = dict(out)
    single = _algorithm(reduction)
    for step in range(3):
        single.update(_batch(step))
    for key, value in single.model.state_dict().items():
        assert torch.equal(ranks[0][key], ranks[1][key]), key  # identical learners
        torch.testing.assert_close(ranks[0][key], value, rtol=1e-4, atol=1e-5)


def _free_address() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _late_rank(rank: int, world: int, address: str, out: dict) -> None:
    """Rank 1 arrives 3 s late, as a learner process still importing torch would."""
    import time

    if rank == 1:
        time.sleep(3.0)
    join_group(address, rank, world, "cpu", timeout_s=1.0, rendezvous_s=60.0)
    total = torch.ones(1) * (rank + 1)
    torch.distributed.all_reduce(total)
    out[rank] = float(total)
    leave_group()


def test_a_late_peer_joins_within_the_start_patience_not_the_collective_timeout():
    """The collectives' timeout (run.actor_timeout_s, 1 s here) does not bound the wait for
    a peer that is still starting; the rendezvous has run.start_timeout_s for that."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_late_rank, args=(2, _free_address(), out), nprocs=2, join=True)
        assert dict(out) == {0: 3.0, 1: 3.0}


def _sparse_rank(rank: int, world: int, address: str, out: dict) -> None:
    """RigL every 2 optimizer steps; each rank trains on its own shard."""
    torch.set_num_threads(1)
    join_group(address, rank, world, "cpu")
    algorithm = _algorithm("mean")
    algorithm.sparsify(SparseConfig(actor=0.8, delta=2, t_end=10), total_updates=10, seed=0)
    trainer = algorithm.sparse_trainers["actor"]
    initial = {k: m.clone() for k, m in trainer.masks.items()}
    algorithm.grad_sync = GradientAllReduce(world, algorithm.loss_reduction)
    for step in range(7):
        algorithm.update(shard_batch(_batch(step), world)[rank])
    out[rank] = {
        "initial": initial,
        "masks": {k: m.clone() for k, m in trainer.masks.items()},
        "weights": {k: v.clone() for k, v in algorithm.model.state_dict().items()},
    }
    leave_group()


def test_two_sparse_learners_keep_identical_masks_through_topology_updates():
    """Each learner records its own shard's dense gradient; the grow scores are all-reduced,
    so both grow the same connections and their masks and weights stay identical."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_sparse_rank, args=(2, _free_address(), out), nprocs=2, join=True)
        ranks = dict(out)
    assert any(
        not torch.equal(ranks[0]["masks"][k], m) for k, m in ranks[0]["initial"].items()
    )  # the topology did change
    for key, mask in ranks[0]["masks"].items():
        assert torch.equal(mask, ranks[1]["masks"][key]), key
    for key, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][key]), key


def test_sparse_training_with_two_learners_is_accepted():
    platform = Platform(
        arch="seed", algo=FAST_VTRACE, sparse={"actor": 0.8}, resources={"num_learners": 2}
    )
    assert platform.spec.resources.num_learners == 2 and platform.spec.sparse.enabled


def test_seed_with_two_learners_keeps_them_identical(ray_session, tmp_path):
    from rlfabric.architectures.seed import SeedArchitecture

    platform = Platform(
        arch="seed",
        algo=FAST_VTRACE,
        env={"id": "CartPole-v1", "num_envs": 32},
        resources={"num_learners": 2, "learner_cpus": 0.5, "cpus_per_env_runner": 0.5},
        run={"report_interval_s": 0.5, "logdir": str(tmp_path)},
    )
    arch = SeedArchitecture(platform.spec, platform.env_info, platform.spec.run.stop)
    try:  # a start that fails half-way leaves actors for stop() to end
        arch.start()
        metrics = arch.step()
        while metrics["updates"] < 50:
            metrics = arch.step()
        ray_session.get(arch.learner.stop.remote())  # trainers stop between updates
        learner0 = ray_session.get(arch.learner.algorithm_state.remote())["model"]
        worker = ray_session.get(arch.workers[0].weights.remote())
        for key, value in learner0.items():
            np.testing.assert_array_equal(value.numpy(), worker[key], key)
    finally:
        arch.stop()


def test_bad_learner_counts_fail_before_anything_starts():
    from rlfabric.errors import SpecError

    with pytest.raises(SpecError, match=r"algo.batch_size=8 does not split into"):
        Platform(arch="seed", algo=FAST_VTRACE, resources={"num_learners": 3})
    with pytest.raises(SpecError, match=r"num_learners=2 needs a Ray architecture"):
        Platform(arch="local", algo=FAST_VTRACE, resources={"num_learners": 2})


def test_inference_on_its_own_device_follows_every_update(tmp_path):
    """A separate inference copy (here on the CPU too) acts with the newest weights."""
    run = {"stop": {"env_frames": 60_000}, "display": "none", "logdir": str(tmp_path)}
    platform = Platform(
        arch="local",
        algo=FAST_VTRACE,
        model=SHARED_TORSO,
        env={"id": "CartPole-v1", "num_envs": 64},
        resources={"inference_device": "cpu"},
        run=run,
    )
    result = platform.fit()
    assert result.metrics["episode_return_mean"] > 2 * 22.0

    from rlfabric.runtime.learner import Learner

    learner = Learner(platform.spec, platform.env_info, frame_budget=None)
    assert learner.inference is not learner.algorithm
    learner.update(_batch(0, B=8))
    for key, value in learner.algorithm.model.state_dict().items():
        assert torch.equal(learner.inference.model.state_dict()[key], value), key


def test_an_unknown_inference_device_is_refused():
    from rlfabric.errors import SpecError

    with pytest.raises(SpecError, match=r"resources.inference_device"):
        Platform(arch="seed", algo="vtrace", resources={"inference_device": "tpu"})


def test_the_rendezvous_port_stays_held_from_pick_to_join():
    """Picking a free port by bind-and-close let another process take it before the
    group formed; the rendezvous store keeps it bound."""
    import errno
    import socket

    from rlfabric.runtime.distributed import host_rendezvous

    address, store = host_rendezvous("127.0.0.1", 2, timeout_s=5)
    port = int(address.rsplit(":", 1)[1])
    with socket.socket() as s, pytest.raises(OSError) as err:
        s.bind(("127.0.0.1", port))
    assert err.value.errno == errno.EADDRINUSE
    del store
