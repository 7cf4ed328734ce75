"""Observation normalization (`model.normalize_obs`): the running moments, one set of them
under every topology, and the same normalized observations after a resume, in
`rlfabric eval` and in the exported policy."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from test_distributed import _free_address
from test_sparse_algorithms import CARTPOLE, OFF_POLICY, PENDULUM, B, T, batch
from test_training import FAST_VTRACE

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS, Algorithm
from rlfabric.errors import SpecError
from rlfabric.models import ModelConfig, ObsNormalizer, build_obs_normalizer
from rlfabric.platform.checkpoint import load_checkpoint, save_checkpoint
from rlfabric.platform.spec import ExperimentSpec
from rlfabric.runtime.distributed import GradientAllReduce, join_group, leave_group, shard_batch
from rlfabric.sparse import SparseConfig

# Observations far from N(0, 1), so that normalizing them changes what a network sees.
SCALE = np.array([1.0, 50.0, 0.1, 3.0], np.float32)
SHIFT = np.array([5.0, -300.0, 100.0, 0.0], np.float32)
NORMALIZE = ModelConfig(normalize_obs=True)


def shifted(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    """`test_sparse_algorithms.batch`, its observations scaled and shifted per feature."""
    out = batch(name, seed)
    dim = out["obs"].shape[-1]
    for key in ("obs", "next_obs"):
        if key in out:
            out[key] = out[key] * SCALE[:dim] + SHIFT[:dim]
    return out


def make(name: str, model: ModelConfig = NORMALIZE, **algo: object) -> Algorithm:
    torch.manual_seed(0)
    cls = ALGORITHMS[name]
    env = PENDULUM if name in OFF_POLICY else CARTPOLE
    return cls(cls.config_cls(**algo), env.observation_space, env.action_space, model)


def merged(name: str, batches: list[dict[str, np.ndarray]]) -> np.ndarray:
    """The observations `update` merges: a trajectory batch's obs[:T], a replay batch's obs."""
    obs = [b["obs"] if name in OFF_POLICY else b["obs"][:-1] for b in batches]
    return np.concatenate([o.reshape(-1, o.shape[-1]) for o in obs]).astype(np.float64)


def stats(algorithm: Algorithm) -> dict[str, torch.Tensor]:
    norm = algorithm.obs_norm
    assert norm is not None
    return {k: v.clone() for k, v in norm.state_dict().items()}


# -- the running moments ------------------------------------------------------------------


def test_running_moments_equal_numpy_over_the_concatenated_batches():
    rng = np.random.default_rng(0)
    norm = ObsNormalizer((2, 3))
    seen = []
    for size in (1, 7, 300, 2):  # a batch of one, and uneven sizes: Chan's merge weighs them
        obs = rng.normal(1000.0, [[0.01, 1.0, 30.0]], size=(size, 2, 3))  # float64, far from 0
        norm.update(torch.as_tensor(obs))
        seen.append(obs)
    everything = np.concatenate(seen)
    assert norm.count.item() == len(everything)
    np.testing.assert_allclose(norm.mean.numpy(), everything.mean(0), rtol=1e-7)
    np.testing.assert_allclose(norm.var.numpy(), everything.var(0), rtol=1e-4)
    # Time-major [T, B, ...] batches merge as their T*B observations.
    again = ObsNormalizer((2, 3))
    again.update(torch.as_tensor(everything[:300].reshape(30, 10, 2, 3)))
    again.update(torch.as_tensor(everything[300:]))
    again.update(torch.zeros(0, 2, 3))  # an empty batch changes nothing
    torch.testing.assert_close(again.mean, norm.mean)
    torch.testing.assert_close(again.var, norm.var)


def test_normalized_observations_are_clipped_float32_and_unchanged_before_any_update():
    norm = ObsNormalizer((3,), clip=5.0)
    obs = torch.tensor([[0.5, -2.0, 100.0]], dtype=torch.float64)
    out = norm(obs)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([[0.5, -2.0, 5.0]]))  # mean 0, var 1: clip only
    norm.update(torch.tensor([[0.0, 10.0, 1.0], [2.0, 10.0, 3.0]]))  # mean 1 10 2, var 1 0 1
    # A constant feature (var 0) divides by sqrt(1e-8): any change hits the clip.
    out = norm(torch.tensor([[3.0, 10.0, -100.0], [1.5, 10.001, 2.0]]))
    np.testing.assert_allclose(out.numpy(), [[2.0, 0.0, -5.0], [0.5, 5.0, 0.0]], atol=1e-6)


def test_the_spec_field_and_what_it_refuses():
    spec = ExperimentSpec.build({"model": {"normalize_obs": True}}, ["model.obs_clip=5"])
    assert spec.model.normalize_obs and spec.model.obs_clip == 5.0
    assert ModelConfig().normalize_obs is False  # off unless asked
    assert build_obs_normalizer(CARTPOLE.observation_space, ModelConfig()) is None
    with pytest.raises(SpecError, match=r"model\.obs_clip"):
        ExperimentSpec.build({}, ["model.obs_clip=0"])
    frames = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    with pytest.raises(ValueError, match=r"model\.normalize_obs=true normalizes vector obs"):
        build_obs_normalizer(frames, NORMALIZE)
    with pytest.raises(SpecError, match=r"ALE/Pong-v5.*model\.normalize_obs=true.*1/255"):
        Platform(env="ALE/Pong-v5", algo="vtrace", model={"normalize_obs": True})


# -- the learner updates them, once per update, before the loss ----------------------------


@pytest.mark.parametrize("name", ["vtrace", "a3c", "ppo", "sac", "td3"])
def test_update_merges_the_batch_before_its_loss(name: str):
    algo = make(name)
    # The first pass over the batch's obs: the critic's (targets run on copies), the torso's.
    net = algo.critic if name in OFF_POLICY else algo.model.torso
    seen: list[torch.Tensor] = []
    net.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach().clone()))
    batches = [shifted(name, seed) for seed in range(3)]
    algo.update(batches[0])
    # The count started at 0, so the statistics are now the batch's own, and the networks
    # saw the batch normalized with them: mean 0, variance 1 per feature.
    features = seen[0] if name in OFF_POLICY else seen[0].reshape(T + 1, B, 4)[:-1].flatten(0, 1)
    np.testing.assert_allclose(features.mean(0).numpy(), 0.0, atol=1e-4)
    np.testing.assert_allclose(features.var(0, correction=0).numpy(), 1.0, atol=1e-3)
    for b in batches[1:]:
        algo.update(b)
    everything = merged(name, batches)
    assert algo.obs_norm.count.item() == len(everything)  # once per update, not per epoch
    np.testing.assert_allclose(algo.obs_norm.mean.numpy(), everything.mean(0), rtol=1e-5)
    np.testing.assert_allclose(algo.obs_norm.var.numpy(), everything.var(0), rtol=1e-4)


def test_buffers_are_no_parameters_nor_sparse_weights_and_survive_bf16_and_an_lstm():
    model = ModelConfig(normalize_obs=True, lstm=8, precision="bf16")
    algo = make("vtrace", model)
    algo.sparsify(SparseConfig(actor=0.8), total_updates=100, seed=0)
    assert not any("obs_norm" in k for k, _ in algo.model.named_parameters())
    assert not any("obs_norm" in k for k in algo.sparse_trainers["actor"].masks)
    for seed in range(2):
        algo.update(shifted("vtrace", seed))
    expected = merged("vtrace", [shifted("vtrace", s) for s in range(2)]).mean(0)
    np.testing.assert_allclose(algo.obs_norm.mean.numpy(), expected, rtol=1e-5)  # not masked
    off = make("td3")
    off.sparsify(SparseConfig(actor=0.9, critic=0.85), total_updates=100, seed=0)
    off.update(shifted("td3"))
    assert off.obs_norm.count.item() == 16
    assert not any("obs_norm" in k for t in off.sparse_trainers.values() for k in t.masks)


# -- data-parallel learners keep one set ----------------------------------------------------


def _rank(rank: int, world: int, address: str, out: dict) -> None:
    torch.set_num_threads(1)
    join_group(address, rank, world, "cpu")
    algorithm = make("vtrace", loss_reduction="mean")  # `reduce` averages; moments must sum
    algorithm.grad_sync = GradientAllReduce(world, algorithm.loss_reduction)
    for seed in range(2):
        algorithm.update(shard_batch(shifted("vtrace", seed), world)[rank])
    out[rank] = stats(algorithm)
    leave_group()


def test_two_learners_merge_the_whole_batch_into_identical_statistics():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(2, _free_address(), out), nprocs=2, join=True)
        ranks = dict(out)
    single = make("vtrace", loss_reduction="mean")
    for seed in range(2):
        single.update(shifted("vtrace", seed))
    for key, value in stats(single).items():
        assert torch.equal(ranks[0][key], ranks[1][key]), key
        torch.testing.assert_close(ranks[0][key], value, rtol=1e-6, atol=1e-6)


# -- checkpoints, evaluation and export carry them ---------------------------------------------


@pytest.mark.parametrize("name", ["sac", "td3"])
def test_offpolicy_state_and_weights_carry_the_statistics(tmp_path, name: str):
    algo, fresh, runner = make(name), make(name), make(name)
    for seed in range(2):
        algo.update(shifted(name, seed))
    state = {"algorithm": algo.state_dict(), "counters": {}}
    fresh.load_state_dict(load_checkpoint(save_checkpoint(tmp_path, state, 0, 1))["algorithm"])
    runner.set_weights(algo.get_weights())  # what an IMPALA runner loads
    obs = shifted(name, 5)["obs"]
    expected = algo.act(obs, deterministic=True)[0]
    for other in (fresh, runner):
        assert all(torch.equal(stats(other)[k], v) for k, v in stats(algo).items())
        np.testing.assert_array_equal(other.act(obs, deterministic=True)[0], expected)
    with pytest.raises(ValueError, match=r"checkpoint was trained with model\.normalize_obs=true"):
        make(name, ModelConfig()).load_state_dict(algo.state_dict())
    with pytest.raises(ValueError, match=r"trained with model\.normalize_obs=false"):
        algo.load_state_dict(make(name, ModelConfig()).state_dict())


@pytest.mark.parametrize(
    ("name", "model"),
    [("vtrace", NORMALIZE), ("ppo", ModelConfig(normalize_obs=True, lstm=8)), ("td3", NORMALIZE)],
)
def test_exported_policy_normalizes_as_the_training_model(tmp_path, name, model):
    from rlfabric.platform.export import export_policy

    algo = make(name, model)
    for seed in range(2):
        algo.update(shifted(name, seed))
    env = "Pendulum-v1" if name in OFF_POLICY else "CartPole-v1"
    spec = ExperimentSpec.build({"env": env, "algo": name, "model": model.model_dump()})
    export_policy(spec, algo, tmp_path, ("torchscript",))
    policy = torch.jit.load(str(tmp_path / "policy.pt"))
    exported = {
        k.rsplit("obs_norm.", 1)[1]: v for k, v in policy.state_dict().items() if "obs_norm." in k
    }
    assert exported and all(torch.equal(exported[k], v) for k, v in stats(algo).items())
    obs = shifted(name, 7)["obs"]
    obs = obs[0] if obs.ndim == 3 else obs
    if algo.initial_state(len(obs)) is None:
        expected = algo.act(obs, deterministic=True)[0]
        np.testing.assert_allclose(policy(torch.as_tensor(obs)).numpy(), expected, rtol=1e-5)
    else:
        state, first = algo.initial_state(len(obs)), np.ones(len(obs), bool)
        expected, _, _ = algo.act(obs, state, first, deterministic=True)
        action, _ = policy(torch.as_tensor(obs), torch.as_tensor(state), torch.as_tensor(first))
        np.testing.assert_array_equal(action.numpy(), expected)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> Path:
    """A short local CartPole run with normalize_obs, and its final checkpoint."""
    logdir = tmp_path_factory.mktemp("runs")
    run = {"stop": {"env_frames": 4_000}, "display": "none", "logdir": str(logdir), "name": "n"}
    env = {"id": "CartPole-v1", "num_envs": 16}
    Platform(arch="local", algo=FAST_VTRACE, env=env, model={"normalize_obs": True}, run=run).fit()
    return logdir / "n"


def _count_matches_updates(state: dict) -> None:
    """On-policy: every update merges its batch's T x B observations, once."""
    per_update = FAST_VTRACE["unroll_length"] * FAST_VTRACE["batch_size"]
    count = state["algorithm"]["model"]["obs_norm.count"].item()
    assert count == state["counters"]["updates"] * per_update > 0


def test_eval_loads_the_statistics_of_the_checkpoint(local_run, capsys):
    from rlfabric.platform.checkpoint import list_checkpoints
    from rlfabric.platform.cli import main
    from rlfabric.platform.evaluate import load_policy

    saved = load_checkpoint(list_checkpoints(local_run / "checkpoints")[-1])
    _count_matches_updates(saved)
    _, policy = load_policy(local_run)
    for key in ("mean", "var", "count"):
        assert torch.equal(stats(policy)[key], saved["algorithm"]["model"][f"obs_norm.{key}"])
    assert main(["eval", str(local_run), "--episodes", "2"]) == 0
    assert "greedy policy, 2 episodes" in capsys.readouterr().out


def test_a_resumed_run_normalizes_as_the_saved_one(local_run):
    from rlfabric.architectures.local import LocalArchitecture
    from rlfabric.platform.checkpoint import list_checkpoints

    saved = load_checkpoint(list_checkpoints(local_run / "checkpoints")[-1])
    model = saved["algorithm"]["model"]
    obs = torch.as_tensor(shifted("vtrace")["obs"][0])
    expected = ((obs - model["obs_norm.mean"]) / torch.sqrt(model["obs_norm.var"] + 1e-8)).clamp(
        -10, 10
    )
    platform = Platform.resume(local_run)
    arch = LocalArchitecture(platform.spec, platform.env_info, platform.spec.run.stop)
    arch.start(saved)
    torch.testing.assert_close(arch.learner.algorithm.model.obs_norm(obs), expected)
    # Training on: the resumed statistics go on counting from the saved ones.
    resumed = Platform.resume(local_run, ["run.stop.env_frames=6000"]).fit()
    final = load_checkpoint(Path(resumed.checkpoint))
    assert final["counters"]["updates"] > saved["counters"]["updates"]
    _count_matches_updates(final)


def test_separate_inference_copy_gets_the_statistics_after_every_update():
    from rlfabric.envs import describe_env
    from rlfabric.runtime.learner import Learner

    spec = ExperimentSpec.build(
        {"arch": "local", "algo": FAST_VTRACE, "model": {"normalize_obs": True}},
        ["resources.inference_device=cpu"],
    )
    learner = Learner(spec, describe_env(spec.env), frame_budget=None)
    assert learner.inference is not learner.algorithm
    learner.update(shifted("vtrace"))
    assert learner.inference.obs_norm.count.item() == T * B
    for key, value in stats(learner.algorithm).items():
        assert torch.equal(stats(learner.inference)[key], value), key


# -- one set under every Ray topology ----------------------------------------------------------


@pytest.mark.parametrize("arch", ["seed", "impala", "ga3c"])
def test_one_set_of_statistics_under_each_topology(ray_session, tmp_path, arch):
    """The learner merges every runner's data into one set (its count is exactly its updates'
    observations); under IMPALA a runner acts with the learner's set of its version. The
    reward statistics (`algo.normalize_reward`) are one set too: the learner merged its
    updates' valid steps, whose running returns each topology's unrolls carried."""
    from rlfabric.architectures import ARCHITECTURES

    platform = Platform(
        arch=arch,
        algo={**FAST_VTRACE, "normalize_reward": True},
        env={"id": "CartPole-v1", "num_envs": 8},
        model={"normalize_obs": True},
        resources={"num_env_runners": 2, "cpus_per_env_runner": 0.5, "learner_cpus": 0.5},
        run={"report_interval_s": 0.2, "logdir": str(tmp_path)},
    )
    spec = platform.spec
    per_update = spec.algo.unroll_length * spec.algo.batch_size
    topology = ARCHITECTURES[arch](spec, platform.env_info, spec.run.stop)
    try:  # a start that fails half-way leaves actors for stop() to end
        topology.start()
        while topology.step()["updates"] < 3:
            pass
        ray_session.get(topology.learner.stop.remote())  # no update after this
        state = ray_session.get(topology.learner.get_state.remote())
        count = state["algorithm"]["model"]["obs_norm.count"].item()
        assert count == state["counters"]["updates"] * per_update
        # CartPole pays 1 per step, so returns are >= 1; autoreset steps (one per episode,
        # and an episode lasts 8 steps or more) are left out.
        returns = state["algorithm"]["reward_scaler"]
        assert count / 2 < returns["count"].item() <= count
        assert returns["mean"].item() > 1.0 and returns["var"].item() > 0.0
        if arch == "impala":
            versions = []
            for runner in topology.runners.runners.values():
                version, weights = ray_session.get(runner.policy_weights.remote())
                assert weights["obs_norm.count"] == version * per_update
                versions.append(version)
                if version == state["counters"]["updates"]:
                    for key in ("mean", "var"):
                        np.testing.assert_array_equal(
                            weights[f"obs_norm.{key}"],
                            state["algorithm"]["model"][f"obs_norm.{key}"].numpy(),
                        )
            assert max(versions) > 0  # runners acted with trained statistics
    finally:
        topology.stop()
