"""Every common gymnasium space, and a torso of the user's own, under every topology."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import space_envs  # noqa: F401 - registers CopyBits-v0 and CopyBitsMultiDiscrete-v0
import torch
from space_envs import SmallTorso
from torch.distributions import Bernoulli, Categorical

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS
from rlfabric.errors import SpecError
from rlfabric.models import ActorCritic, ModelConfig, UnsupportedSpaceError
from rlfabric.models.encoders import FlatFeatures, build_torso, flatten_space
from rlfabric.models.networks import MLP, BernoulliHead, MultiCategoricalHead, NatureCNN
from rlfabric.platform.cli import main

S = gym.spaces


@pytest.mark.parametrize(
    ("space", "obs", "expected"),
    [
        (S.Discrete(4, start=2), [3, 5], [[0, 1, 0, 0], [0, 0, 0, 1]]),
        (S.MultiDiscrete([3, 2]), [[2, 0], [0, 1]], [[0, 0, 1, 1, 0], [1, 0, 0, 0, 1]]),
        (S.MultiBinary(3), [[1, 0, 1], [0, 0, 1]], [[1, 0, 1], [0, 0, 1]]),
        (S.Box(-1, 1, (2, 2)), [[[1, 2], [3, 4]], [[5, 6], [7, 8]]], [[1, 2, 3, 4], [5, 6, 7, 8]]),
    ],
)
def test_each_array_space_is_encoded_as_flat_features(space, obs, expected):
    features = FlatFeatures(space)
    out = features(torch.as_tensor(np.asarray(obs, dtype=space.dtype)))
    assert features.out_dim == len(expected[0])
    np.testing.assert_array_equal(out.numpy(), np.asarray(expected, np.float32))


def test_channels_last_images_meet_the_same_cnn_as_channels_first():
    hwc = S.Box(0, 255, (48, 40, 3), np.uint8)
    chw = S.Box(0, 255, (3, 48, 40), np.uint8)
    cfg = ModelConfig()
    last, first = build_torso(hwc, cfg), build_torso(chw, cfg)
    assert isinstance(last, NatureCNN) and last.channels_last and not first.channels_last
    first.load_state_dict(last.state_dict())
    frames = torch.randint(0, 256, (2, 48, 40, 3), dtype=torch.uint8)
    torch.testing.assert_close(last(frames), first(frames.permute(0, 3, 1, 2)))
    # Named in the spec, the layout wins over the guess: [48, 40, 3] read as 48 channels.
    named = build_torso(hwc, ModelConfig(torso="impala_cnn", image_layout="chw"))
    assert named.conv[0].in_channels == 48


def test_float_images_are_not_rescaled_and_small_grids_go_to_the_mlp():
    floats = build_torso(S.Box(0.0, 1.0, (40, 40, 1)), ModelConfig(torso="cnn"))
    assert floats.scale == 1.0 and floats.channels_last
    grid = S.Box(0, 255, (7, 7, 3), np.uint8)  # MiniGrid's partial view: no frame for a CNN
    assert isinstance(build_torso(grid, ModelConfig()), MLP)
    with pytest.raises(UnsupportedSpaceError, match=r"at least 36x36 pixels.*7x7"):
        build_torso(grid, ModelConfig(torso="cnn"))


def test_multidiscrete_head_scores_as_one_categorical_per_dimension():
    head = MultiCategoricalHead(8, (3, 2, 4))
    params = head(torch.randn(5, 8)) * 50  # far from uniform
    dist = head.distribution(params)
    action = dist.sample()
    assert action.shape == (5, 3) and action.dtype == torch.int64
    parts = [Categorical(logits=p) for p in params.split((3, 2, 4), -1)]
    logp = sum(p.log_prob(a) for p, a in zip(parts, action.unbind(-1)))
    torch.testing.assert_close(dist.log_prob(action), logp)
    torch.testing.assert_close(dist.entropy(), sum(p.entropy() for p in parts))
    np.testing.assert_array_equal(
        head.mode(params).numpy(), np.stack([p.probs.argmax(-1) for p in parts], -1)
    )
    space = S.MultiDiscrete([3, 2, 4])
    assert all(space.contains(a) for a in action.numpy())


def test_multibinary_head_scores_as_independent_bernoullis():
    head = BernoulliHead(8, 4)
    params = head(torch.randn(5, 8)) * 50
    dist = head.distribution(params)
    action = dist.sample().to(torch.int8)  # as the env takes it
    reference = Bernoulli(logits=params)
    torch.testing.assert_close(dist.log_prob(action), reference.log_prob(action.float()).sum(-1))
    torch.testing.assert_close(dist.entropy(), reference.entropy().sum(-1))
    np.testing.assert_array_equal(head.mode(params).numpy(), (params > 0).numpy())


@pytest.mark.parametrize(
    "obs_space",
    [
        S.Discrete(16),
        S.MultiDiscrete([3, 4]),
        S.MultiBinary(5),
        S.Box(-1, 1, (2, 3, 4)),
        S.Box(0, 255, (7, 7, 3), np.uint8),
    ],
    ids=str,
)
@pytest.mark.parametrize(
    "action_space",
    [S.Discrete(3), S.MultiDiscrete([2, 3]), S.MultiBinary(3), S.Box(-1, 1, (2,))],
    ids=str,
)
def test_the_policy_acts_in_every_space_pair(obs_space, action_space):
    cls = ALGORITHMS["ppo"]
    algo = cls(cls.config_cls(), obs_space, action_space, ModelConfig())
    obs = np.stack([obs_space.sample() for _ in range(6)])
    action, extras, _ = algo.act(obs)
    assert len(action) == 6 and extras["logp"].shape == (6,)
    assert action.dtype == action_space.dtype
    if not isinstance(action_space, S.Box):  # a Gaussian's samples leave the box
        assert all(action_space.contains(a) for a in action)
    model: ActorCritic = algo.model
    params, _ = model(torch.as_tensor(obs)[None])
    logp = model.distribution(params[0]).log_prob(torch.as_tensor(action))
    np.testing.assert_allclose(logp.detach().numpy(), extras["logp"], rtol=1e-5, atol=1e-6)


def test_entries_that_are_not_arrays_are_named_with_the_wrapper_to_use():
    space = S.Dict({"image": S.Box(0, 255, (7, 7, 3), np.uint8), "mission": S.Text(20)})
    with pytest.raises(UnsupportedSpaceError, match=r"entry 'mission' is Text.*env.wrappers"):
        flatten_space(space)
    nested = S.Dict({"a": S.Tuple((S.Discrete(2), S.Dict({"b": S.MultiBinary(2)})))})
    assert list(flatten_space(nested)) == ["a/0", "a/1/b"]


@pytest.mark.parametrize(
    ("action_space", "match"),
    [
        (S.Tuple((S.Discrete(2), S.Discrete(2))), "cannot act in action space Tuple"),
        (S.MultiDiscrete([[2, 2], [2, 2]]), "allowed: a 1-D MultiDiscrete"),
        (S.Discrete(3, start=1), "starts at 1"),
    ],
)
def test_action_spaces_still_unsupported_are_refused_by_name(action_space, match):
    cls = ALGORITHMS["ppo"]
    with pytest.raises(ValueError, match=match):
        cls.check_spaces(S.Box(-1, 1, (3,)), action_space)
        cls(cls.config_cls(), S.Box(-1, 1, (3,)), action_space, ModelConfig())


@pytest.mark.parametrize(
    ("torso", "kwargs", "match"),
    [
        ("no_such_module:Torso", {}, "cannot import module 'no_such_module'"),
        ("space_envs:NoSuchTorso", {}, "has no attribute 'NoSuchTorso'"),
        (
            "space_envs:flatten_only",
            {},
            "built Flatten; a torso is an nn.Module with a positive int `out_dim`",
        ),
        ("space_envs:SmallTorso", {"depth": 3}, "failed to build.*unexpected keyword"),
    ],
)
def test_a_torso_that_cannot_be_built_fails_before_actors_start(torso, kwargs, match):
    model = {"torso": torso, "torso_kwargs": kwargs}
    with pytest.raises(SpecError, match=match):
        Platform(arch="local", algo="ppo", env="CartPole-v1", model=model)


def test_unknown_torso_names_and_offpolicy_torsos_are_spec_errors():
    with pytest.raises(SpecError, match="unknown torso 'resnet'; allowed: auto, mlp, cnn"):
        Platform(env="CartPole-v1", model={"torso": "resnet"})
    with pytest.raises(SpecError, match=r"'sac' builds MLP actors.*space_envs:SmallTorso"):
        Platform(algo="sac", env="Pendulum-v1", model={"torso": SmallTorso})
    with pytest.raises(ValueError, match="'td3' takes Box observations"):
        ALGORITHMS["td3"].check_spaces(S.Discrete(4), S.Box(-1, 1, (2,)))


def _run(tmp_path: Path, arch: str, env: str, frames: int, **sections) -> Platform:
    run = {"stop": {"env_frames": frames}, "display": "none", "logdir": str(tmp_path)}
    run.update(sections.pop("run", {}))
    sections.setdefault("env", {"id": env, "num_envs": 8})
    return Platform(arch=arch, run=run, **sections)


def test_multibinary_actions_learn_under_local(tmp_path):
    """Copying 3 bits: a uniform policy returns 4 of 8; PPO's presets learn it in seconds."""
    algo = {"name": "ppo", "unroll_length": 32, "batch_size": 8, "lr": 3e-3}
    result = _run(tmp_path, "local", "CopyBits-v0", 20_000, algo=algo).fit()
    assert result.metrics["episode_return_mean"] > 6.5, result.metrics["episode_return_mean"]


@pytest.mark.parametrize(
    ("arch", "env", "algo", "torso"),
    [
        ("impala", "FrozenLake-v1", "a3c", SmallTorso),  # Discrete observations; a class
        ("ga3c", "CopyBits-v0", "vtrace", "space_envs:SmallTorso"),  # MultiBinary actions
    ],
)
def test_spaces_and_a_users_torso_run_under_impala_and_ga3c(
    ray_session, tmp_path, arch, env, algo, torso
):
    model = {"torso": torso, "torso_kwargs": {"width": 24}}
    result = _run(tmp_path, arch, env, 2_000, algo={"name": algo}, model=model).fit()
    assert result.metrics["updates"] >= 1 and np.isfinite(result.metrics["loss"])
    weights = torch.load(result.checkpoint, weights_only=False)["algorithm"]["model"]
    assert weights["torso.net.0.weight"].shape[0] == 24  # the user's module, its kwargs


def test_a_torso_by_import_path_trains_resumes_evaluates_and_exports_under_seed(
    ray_session, tmp_path
):
    """MultiBinary observations, MultiDiscrete actions and the user's torso, end to end."""
    model = {"torso": "space_envs:SmallTorso", "torso_kwargs": {"width": 24}}
    run = {"name": "own"}
    first = _run(tmp_path, "seed", "CopyBitsMultiDiscrete-v0", 2_000, model=model, run=run).fit()
    folder = Path(first.logdir)
    weights = torch.load(first.checkpoint, weights_only=False)["algorithm"]["model"]
    assert weights["torso.net.0.weight"].shape == (24, 3)
    resumed = Platform.resume(folder, ["run.stop.env_frames=4000"]).fit()
    assert resumed.metrics["env_frames"] >= 4_000
    assert main(["eval", str(folder), "--episodes", "2"]) == 0
    assert main(["export", str(folder), "--out", str(tmp_path / "exported")]) == 0
    policy = torch.jit.load(str(tmp_path / "exported" / "policy.pt"))
    bits = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.int8)
    assert policy(bits).shape == (2, 3)
    saved = json.loads((tmp_path / "exported" / "policy.json").read_text())
    assert saved["obs_shape"] == [3] and saved["obs_dtype"] == "int8"


def test_a_torso_class_passed_in_python_is_saved_by_its_import_path(tmp_path):
    result = _run(tmp_path, "local", "CartPole-v1", 1_000, model={"torso": SmallTorso}).fit()
    spec_text = (Path(result.logdir) / "spec.yaml").read_text()
    assert "torso: space_envs:SmallTorso" in spec_text
    resumed = Platform.resume(result.logdir, ["run.stop.env_frames=2000"]).fit()
    assert resumed.metrics["env_frames"] >= 2_000
