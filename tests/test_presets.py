"""Presets: chosen by algorithm and env family, applied under the user's own values."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import yaml
from gymnasium.envs.classic_control import CartPoleEnv

from rlfabric import Platform
from rlfabric.algorithms import ALGORITHMS
from rlfabric.architectures import ARCHITECTURES
from rlfabric.architectures.base import ArchConfig
from rlfabric.envs import EnvConfig
from rlfabric.errors import SpecError
from rlfabric.platform import presets
from rlfabric.platform.cli import main
from rlfabric.platform.facade import TargetHit, stop_reason
from rlfabric.platform.presets import load_file
from rlfabric.platform.spec import ExperimentSpec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "specs"


class _TinyPixels(gym.Env):
    """An env outside every known family, with image observations."""

    observation_space = gym.spaces.Box(0, 255, (3, 16, 16), np.uint8)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {}


gym.register("TestFlatOther-v0", entry_point=CartPoleEnv, max_episode_steps=50)
gym.register("TestPixelsOther-v0", entry_point=_TinyPixels, max_episode_steps=50)


@pytest.mark.parametrize(
    ("env_id", "family"),
    [
        ("CartPole-v1", "classic"),
        ("MountainCarContinuous-v0", "classic"),
        ("ALE/Pong-v5", "atari"),
        ("HalfCheetah-v5", "mujoco"),
        ("TestFlatOther-v0", "vector"),
        ("TestPixelsOther-v0", "pixels"),
    ],
)
def test_family_detection(env_id, family):
    assert presets.family_of(EnvConfig(id=env_id)) == family


def test_names_only_get_the_family_preset():
    spec = ExperimentSpec.build({"arch": "seed", "algo": "vtrace"})
    assert spec.env.id == "CartPole-v1" and spec.preset == "vtrace/classic"
    assert (spec.algo.optimizer, spec.algo.batch_size) == ("adam", 4)  # the seed block
    assert ExperimentSpec.build({"arch": "impala", "algo": "vtrace"}).algo.batch_size == 16
    sac = ExperimentSpec.build({"algo": "sac", "env": "Pendulum-v1"})
    assert (sac.env.num_envs, sac.algo.warmup_steps, sac.preset) == (2, 1000, "sac/classic")
    pong = ExperimentSpec.build({"algo": "vtrace", "env": "ALE/Pong-v5"})
    assert (pong.preset, pong.algo.optimizer, pong.algo.epochs, pong.algo.pg_clip) == (
        "vtrace/atari",
        "adam",
        4,
        0.1,
    )
    assert (pong.algo.num_minibatches, pong.algo.batch_size, pong.algo.unroll_length) == (
        4,
        8,
        128,
    )
    assert not pong.algo.recompute_targets
    # The example spec keeps the paper's settings: a spec's own values win.
    paper = ExperimentSpec.from_yaml(EXAMPLES / "pong_seed_vtrace.yaml")
    assert (paper.algo.optimizer, paper.algo.lr, paper.algo.entropy_cost) == (
        "rmsprop_tf",
        6e-4,
        0.01,
    )


@pytest.mark.parametrize("algo", ["vtrace", "a3c", "ppo"])
def test_atari_names_only_clip_rewards_as_the_references(algo):
    # IMPALA, GA3C and CleanRL clip Atari rewards; the algorithms do not clip by default,
    # so the Atari preset must, and no other family does.
    assert ExperimentSpec.build({"algo": algo, "env": "ALE/Pong-v5"}).algo.reward_clip == 1.0
    assert ExperimentSpec.build({"algo": algo, "env": "CartPole-v1"}).algo.reward_clip is None


def test_sac_on_mujoco_runs_bf16_where_the_device_has_it_td3_keeps_fp32():
    # Measured on HalfCheetah: the same return, 1.54x the speed. Pendulum's 2x64 nets stay
    # fp32 (not measured there), and `auto` itself is fp32 without native bf16.
    assert ExperimentSpec.build({"algo": "sac", "env": "HalfCheetah-v5"}).model.precision == "auto"
    assert ExperimentSpec.build({"algo": "sac", "env": "Pendulum-v1"}).model.precision == "fp32"
    # TD3 in bf16 learned less on HalfCheetah (3,765 against 4,065 over four seeds).
    assert ExperimentSpec.build({"algo": "td3", "env": "HalfCheetah-v5"}).model.precision == "fp32"


def test_sac_on_mujoco_under_seed_steps_both_envs_as_one_group():
    # One inference request per vector step, not per env: measured 108.9 against 79.8 agent
    # steps/s under seed. A per-arch setting: `local` has no env groups and IMPALA keeps two.
    def arch(name: str) -> ArchConfig:
        return ExperimentSpec.build({"algo": "sac", "env": "HalfCheetah-v5", "arch": name}).arch

    assert arch("seed").env_groups == 1
    assert arch("impala").env_groups == 2
    assert not hasattr(arch("local"), "env_groups")
    assert ExperimentSpec.build({"algo": "sac", "env": "Pendulum-v1"}).arch.env_groups == 2


def test_preset_none_gives_the_paper_defaults():
    spec = ExperimentSpec.build({"algo": "vtrace", "preset": "none"})
    assert (spec.algo.optimizer, spec.algo.lr, spec.algo.unroll_length) == ("rmsprop_tf", 6e-4, 20)
    assert spec.env.num_envs == 64 and spec.preset == "none"
    assert (
        ExperimentSpec.build(
            {"algo": "sac", "env": "Pendulum-v1", "preset": "none"}
        ).algo.warmup_steps
        == 5000
    )


def test_user_values_win_python_yaml_and_overrides(tmp_path):
    platform = Platform(arch="seed", algo={"name": "vtrace", "lr": 1e-3}, env="CartPole-v1")
    assert platform.spec.algo.lr == 1e-3 and platform.spec.algo.batch_size == 4
    path = tmp_path / "spec.yaml"
    path.write_text("algo: {name: ppo, unroll_length: 7}\nenv: {num_envs: 8}\n")
    spec = ExperimentSpec.from_yaml(path, ["algo.batch_size=5"])
    assert (spec.algo.unroll_length, spec.env.num_envs, spec.algo.batch_size) == (7, 8, 5)
    assert spec.algo.lr == 0.003  # the rest from ppo/classic
    assert spec.origin(("algo", "batch_size")) == "user"
    assert spec.origin(("algo", "lr")) == "preset ppo/classic"
    assert spec.origin(("algo", "clip_coef")) == "default"


def test_an_env_block_refines_its_family(monkeypatch):
    family = {
        "source": "family sweep",
        "spec": {"env": {"num_envs": 64}, "algo": {"lr": 0.003, "unroll_length": 16}},
        "per_arch": {"seed": {"algo": {"batch_size": 4, "lr": 0.004}}},
        "per_env": {
            "Acrobot-v1": {
                "source": "acrobot sweep",
                "spec": {"algo": {"lr": 0.001, "batch_size": 8}},
                "per_arch": {"seed": {"env": {"num_envs": 16}}},
            }
        },
    }
    monkeypatch.setattr(presets, "load_file", lambda algo: {"classic": family})
    spec = ExperimentSpec.build({"env": "Acrobot-v1", "algo": "ppo", "arch": "seed"})
    # The env's per_arch, then the env's spec, then the family's per_arch, then its spec.
    assert (spec.env.num_envs, spec.algo.lr, spec.algo.batch_size) == (16, 0.001, 8)
    assert spec.algo.unroll_length == 16 and spec.preset == "ppo/classic"
    assert spec.origin(("env", "num_envs")) == "preset ppo/classic (Acrobot-v1, seed)"
    assert spec.origin(("algo", "lr")) == "preset ppo/classic (Acrobot-v1)"
    assert spec.origin(("algo", "unroll_length")) == "preset ppo/classic"
    found = presets.find_preset("auto", "ppo", "seed", EnvConfig(id="Acrobot-v1"))
    assert found.source == "Acrobot-v1: acrobot sweep; the rest: family sweep"
    # Another env of the family gets the family's values alone.
    cartpole = ExperimentSpec.build({"env": "CartPole-v1", "algo": "ppo", "arch": "seed"})
    assert (cartpole.env.num_envs, cartpole.algo.lr, cartpole.algo.batch_size) == (64, 0.004, 4)


def test_a_user_lstm_keeps_the_shared_torso_a_preset_would_separate():
    """Separate policy and value torsos need an MLP policy without an LSTM: the Acrobot
    preset separates them, and yields that one value (not the others) to a user's LSTM."""
    acrobot = {"env": "Acrobot-v1", "algo": "vtrace", "arch": "seed"}
    assert ExperimentSpec.build(acrobot).model.shared_torso is False
    spec = ExperimentSpec.build({**acrobot, "model": {"lstm": 16}})
    assert spec.model.shared_torso is True and spec.model.lstm == 16
    assert spec.origin(("model", "shared_torso")) == "default"
    assert spec.origin(("algo", "lr")) == "preset vtrace/classic (Acrobot-v1)"
    # Asked for both, the user gets the model's error naming what is allowed, and a
    # names-only LSTM run on the env builds.
    with pytest.raises(SpecError, match=r"allowed: model\.shared_torso=true"):
        Platform(**acrobot, model={"lstm": 16, "shared_torso": False})
    assert Platform(**acrobot, model={"lstm": 16}).spec.model.shared_torso is True


def test_spec_show_says_where_each_value_came_from(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text("arch: ga3c\nalgo: ppo\n")
    assert main(["spec", "show", str(path), "algo.lr=0.01"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.01  # user" in out
    assert "batch_size: 32  # preset ppo/classic (ga3c)" in out
    assert "max_env_runners: 2  # preset ppo/classic (ga3c)" in out
    assert "unroll_length: 16  # preset ppo/classic" in out
    assert "clip_coef: 0.2  # default" in out
    assert "name: ga3c  # user" in out
    assert yaml.safe_load(out)["algo"]["lr"] == 0.01  # still YAML


def test_resolved_spec_reproduces_the_run(tmp_path):
    spec = ExperimentSpec.build({"arch": "seed", "algo": "vtrace"}, ["algo.lr=0.002"])
    path = tmp_path / "spec.yaml"
    path.write_text(spec.to_yaml())
    again = ExperimentSpec.from_yaml(path)
    assert again == spec and again.preset == "vtrace/classic"
    # A value the first run resolved is never replaced by the preset on resume.
    data = yaml.safe_load(path.read_text())
    data["algo"]["batch_size"] = 99
    assert ExperimentSpec.build(data).algo.batch_size == 99


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"preset": "fancy"}, ["unknown preset 'fancy'", "vtrace/classic"]),
        ({"algo": "sac", "env": "Pendulum-v1", "preset": "atari"}, ["unknown preset 'atari'"]),
        ({"algo": "a3c", "preset": "ppo/mujoco"}, ["ppo/mujoco", "algo.epochs: unknown field"]),
        ({"preset": 3}, ["preset: must be a name"]),
    ],
)
def test_bad_preset_is_a_spec_error(data, expected):
    with pytest.raises(SpecError) as err:
        ExperimentSpec.build(data)
    for text in expected:
        assert text in str(err.value)


def _shipped() -> list[tuple[str, str, str | None]]:
    """Every (algo, family, env id) with a block of its own: env None is the family's."""
    out, seen = [], set()
    for name in presets.preset_names():
        algo, family = name.split("/")
        out.append((algo, family, None))
        block = load_file(algo)[family]
        if id(block) not in seen:  # `vector: *classic` is the same block
            seen.add(id(block))
            out += [(algo, family, env) for env in block.get("per_env") or {}]
    return out


@pytest.mark.parametrize(("algo", "family", "env"), _shipped())
def test_every_shipped_preset_validates(algo, family, env):
    assert algo in ALGORITHMS
    for arch in ARCHITECTURES:
        data = {"algo": algo, "arch": arch, "preset": f"{algo}/{family}"}
        spec = ExperimentSpec.build(data | ({"env": env} if env else {}))
        assert spec.preset == f"{algo}/{family}" and spec.algo.name == algo
        if env:
            assert presets.family_of(spec.env) == family  # a block under the wrong family
            assert f"({env}" in spec.origin(next(_leaves(load_file(algo)[family]["per_env"][env])))


def _leaves(block: dict) -> Iterator[tuple[str, ...]]:
    """The paths of a preset block's values (its `spec`, then its `per_arch` blocks')."""

    def walk(node: dict, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
        for key, value in node.items():
            yield from walk(value, (*path, key)) if isinstance(value, dict) else [(*path, key)]

    yield from walk(block.get("spec") or {}, ())


def _distinct_runs() -> list:
    """(preset, algo, arch, env) with distinct resolved settings (vector is classic's alias).

    The default suite runs every preset under `local` (about a second each) and the
    on-policy presets with per-architecture blocks under every architecture; the rest under
    Ray (about 10 s a run on 2 cores, settings as under `local`) are marked slow. A replay
    preset's per-architecture block runs only under the architectures it names: its
    warm-up under Ray takes minutes, and the others' settings are `local`'s.
    Env blocks run on their own env.
    """
    seen, runs = set(), []
    for algo, family, env in _shipped():
        for arch in ARCHITECTURES:
            env_config = EnvConfig(id=env) if env else EnvConfig()
            preset = presets.find_preset(f"{algo}/{family}", algo, arch, env_config)
            key = (algo, arch, env, yaml.safe_dump(preset.merged()))
            if key in seen:
                continue
            seen.add(key)
            block = load_file(algo)[family]
            if env:
                block = block["per_env"][env]
            per_arch = block.get("per_arch") or {}
            replay = ALGORITHMS[algo].data == "replay"
            fast = arch == "local" or arch in per_arch or (bool(per_arch) and not replay)
            marks = () if fast else (pytest.mark.slow,)
            runs.append(pytest.param(f"{algo}/{family}", algo, arch, env, marks=marks))
    return runs


@pytest.mark.parametrize(("preset", "algo", "arch", "env"), _distinct_runs())
def test_every_shipped_preset_trains_under_every_architecture(
    ray_session, tmp_path, preset, algo, arch, env
):
    """A few updates on a cheap env of the right action space (the settings are under test)."""
    replay = ALGORITHMS[algo].data == "replay"
    data = {"algo": algo, "arch": arch, "preset": preset}
    data["env"] = env or ("Pendulum-v1" if replay else "CartPole-v1")
    probe = ExperimentSpec.build(data)
    if replay:  # the warm-up (and a first batch in the buffer), then a few updates
        frames = max(probe.algo.warmup_steps, probe.algo.batch_size) + 64 * probe.env.num_envs
    else:  # two batches; each vector step of a runner gives num_envs unrolls' steps
        frames = 2 * probe.algo.unroll_length * max(probe.algo.batch_size, probe.env.num_envs)
    data["run"] = {
        "stop": {"env_frames": frames},
        "display": "none",
        "logdir": str(tmp_path),
        "checkpoint_interval_s": 0,
    }
    result = Platform(data).fit()
    assert result.metrics["updates"] >= 1, result.metrics


def test_return_window_and_eval_stop():
    with pytest.raises(SpecError, match=r"eval_return_mean=100\.0 needs periodic evaluations"):
        ExperimentSpec.build({"run": {"stop": {"eval_return_mean": 100}}})
    spec = ExperimentSpec.build(
        {"run": {"return_window": 10, "eval_interval_s": 5, "stop": {"eval_return_mean": 100}}}
    )
    stop = spec.run.stop
    assert stop_reason({"eval_return_mean": 99.0}, stop) == ""
    assert stop_reason({"eval_return_mean": 100.0}, stop).startswith("eval_return_mean")
    returns = ExperimentSpec.build({"run": {"stop": {"episode_return_mean": 50}}}).run.stop
    early = {"episode_return_mean": 60.0, "episodes": 10}
    assert stop_reason(early, returns, window=10) and not stop_reason(early, returns, window=100)
    hit = TargetHit(50.0)
    hit.observe({"episode_return_mean": 60.0, "episodes": 5, "env_frames": 1}, window=10)
    hit.observe(
        {"episode_return_mean": 60.0, "episodes": 10, "env_frames": 7, "wall_time_s": 2}, 10
    )
    hit.observe(
        {"episode_return_mean": 70.0, "episodes": 20, "env_frames": 9, "wall_time_s": 3}, 10
    )
    assert (hit.env_frames, hit.wall_time_s) == (7, 2)
    assert "first reached at 7 env frames" in hit.describe(20.0, 10)
