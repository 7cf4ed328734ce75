"""ExperimentSpec: loading, shorthand, overrides, round trips and every kind of bad input."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import pytest
import yaml

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS
from rlfabric.algorithms.vtrace import VTrace, VTraceConfig
from rlfabric.errors import SpecError
from rlfabric.platform.spec import DEFAULT_ENV_FRAMES, ExperimentSpec, apply_overrides


def test_defaults_and_shorthand():
    spec = ExperimentSpec.build({"arch": "seed", "algo": "vtrace", "env": "CartPole-v1"})
    assert spec.arch.name == "seed" and spec.algo.name == "vtrace"
    assert spec.env.id == "CartPole-v1"
    # Names only: the classic-control preset under SEED, not IMPALA's Atari unroll of 20.
    assert isinstance(spec.algo, VTraceConfig) and spec.algo.unroll_length == 10
    assert spec.preset == "vtrace/classic"
    bare = ExperimentSpec.build({"arch": "seed", "algo": "vtrace", "preset": "none"})
    assert bare.algo.unroll_length == 20 and bare.preset == "none"


def test_platform_keyword_sections():
    platform = Platform(
        arch="seed",
        algo={"name": "vtrace", "lr": 1e-3},
        env="CartPole-v1",
        run={"stop": {"env_frames": 1_000_000}},
    )
    assert platform.spec.algo.lr == 1e-3
    assert platform.spec.run.stop.env_frames == 1_000_000
    assert platform.env_info.action_space == gym.spaces.Discrete(2)


def test_yaml_round_trip(tmp_path):
    spec = ExperimentSpec.build({"algo": {"name": "vtrace", "lambda": 0.9, "lr": 2e-4}})
    path = tmp_path / "spec.yaml"
    path.write_text(spec.to_yaml())
    again = ExperimentSpec.from_yaml(path)
    assert again == spec
    assert again.algo.lambda_ == 0.9
    assert yaml.safe_load(path.read_text())["algo"]["lambda"] == 0.9


def test_overrides_parse_values_and_expand_shorthand():
    data = {"algo": "vtrace", "env": "CartPole-v1"}
    spec = ExperimentSpec.build(
        data,
        [
            "algo.lr=1e-3",
            "run.seed=3",
            "algo.reward_clip=null",
            "env.num_envs=8",
            "run.stop.env_frames=200000",
            "model.hidden=[32, 32]",
        ],
    )
    assert spec.algo.lr == 1e-3 and spec.run.seed == 3 and spec.algo.reward_clip is None
    assert spec.env.num_envs == 8 and spec.run.stop.env_frames == 200_000
    assert spec.model.hidden == [32, 32]
    assert data == {"algo": "vtrace", "env": "CartPole-v1"}  # the input is not mutated
    assert apply_overrides({}, ["a.b.c=1"]) == {"a": {"b": {"c": 1}}}


def test_default_stop_uses_reward_threshold_and_frame_budget():
    spec = ExperimentSpec.build({})
    stop = spec.stop_conditions(475.0)
    assert stop.episode_return_mean == 475.0 and stop.env_frames == DEFAULT_ENV_FRAMES
    given = ExperimentSpec.build({"run": {"stop": {"wall_time_s": 5}}}).stop_conditions(475.0)
    assert given.wall_time_s == 5 and given.episode_return_mean is None


@pytest.mark.parametrize(
    ("data", "overrides", "expected"),
    [
        ({"algo": {"name": "vtrace", "lrr": 1}}, [], ["algo.lrr", "unknown field", "lr"]),
        ({"algo": {"name": "vtrace", "lr": "fast"}}, [], ["algo.lr", "'fast'", "number"]),
        ({"algo": {"name": "vtrace", "lr": -1}}, [], ["algo.lr", "greater than 0", "-1"]),
        ({"algo": "dqn"}, [], ["unknown algorithm 'dqn'", "a3c, ppo, sac, td3, vtrace"]),
        ({"arch": "mpi"}, [], ["unknown architecture 'mpi'", "local, seed"]),
        ({"env": "CartPol-v1"}, [], ["CartPol-v1", "CartPole-v1"]),
        ({"runn": {}}, [], ["runn", "unknown field", "resources"]),
        ({}, ["run.stop.env_frames=lots"], ["run.stop.env_frames", "'lots'"]),
        ({}, ["run.display=tv"], ["run.display", "'rich'", "'tv'"]),
        ({}, ["sparse.actor=1.0"], ["sparse.actor", "less than 1", "1.0"]),
        ({}, ["algo"], ["not of the form"]),
        (
            {"resources": {"num_learners": 2, "num_gpus_per_learner": 0.5}},
            [],
            ["num_gpus_per_learner=0.5 with num_learners=2", "own GPU", "whole number"],
        ),
    ],
)
def test_bad_specs_name_field_value_and_allowed(data, overrides, expected):
    with pytest.raises(SpecError) as err:
        ExperimentSpec.build(data, overrides)
    for text in expected:
        assert text in str(err.value)


def test_bad_yaml_files(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        ExperimentSpec.from_yaml(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("env: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        ExperimentSpec.from_yaml(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(SpecError, match="must hold a mapping"):
        ExperimentSpec.from_yaml(scalar)
    unsafe = tmp_path / "unsafe.yaml"
    unsafe.write_text("env: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        ExperimentSpec.from_yaml(unsafe)


def test_unknown_platform_section():
    with pytest.raises(SpecError, match="allowed: env, arch, algo"):
        Platform(algorithm="vtrace")


def test_model_that_cannot_handle_the_observations_is_refused():
    with pytest.raises(SpecError, match=r"torso='cnn'"):
        Platform(env="CartPole-v1", model={"torso": "cnn"})


def test_continuous_actions_with_a_discrete_only_algorithm_are_refused(monkeypatch):
    class DiscreteOnly(VTrace):
        action_spaces = (gym.spaces.Discrete,)

    monkeypatch.setitem(ALGORITHMS, "vtrace", DiscreteOnly)
    with pytest.raises(SpecError, match=r"Pendulum-v1.*cannot act in action space Box.*Discrete"):
        Platform(env="Pendulum-v1", algo="vtrace")


def test_an_architecture_refuses_data_it_cannot_feed(monkeypatch):
    from rlfabric.architectures import ARCHITECTURES

    monkeypatch.setattr(ARCHITECTURES["seed"], "data_kinds", ("trajectory",))
    with pytest.raises(SpecError, match=r"arch 'seed' cannot feed algorithm 'sac' \(replay data\)"):
        Platform(arch="seed", algo="sac", env="Pendulum-v1")


def test_a_replay_actor_needs_ray():
    with pytest.raises(SpecError, match=r"resources.replay_actor=true needs a Ray architecture"):
        Platform(arch="local", algo="sac", env="Pendulum-v1", resources={"replay_actor": True})


def test_sparse_roles_and_budget_are_checked_before_anything_starts():
    with pytest.raises(SpecError, match=r"sparse.critic=0.5.*roles: actor"):
        Platform(arch="seed", algo="vtrace", env="CartPole-v1", sparse={"critic": 0.5})
    Platform(arch="seed", algo="td3", env="Pendulum-v1", sparse={"actor": 0.9, "critic": 0.85})


def test_discrete_envs_are_refused_by_continuous_only_algorithms():
    with pytest.raises(SpecError, match=r"CartPole-v1 with algo 'td3'.*Discrete"):
        Platform(arch="seed", algo="td3", env="CartPole-v1")


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).resolve().parents[1] / "examples" / "specs").glob("*.yaml")),
    ids=lambda p: p.stem,
)
def test_every_example_spec_passes_every_check(path):
    """What `rlfabric train <spec>` checks before starting anything (spaces, sparse roles)."""
    Platform.from_yaml(path)


def test_a_spec_never_imports_a_module_through_the_env_id():
    with pytest.raises(SpecError, match=r"names a module to import; a spec never runs code"):
        Platform(env="os:CartPole-v1")
