"""`env.wrappers`: gymnasium wrappers named by import path, applied to each env in the env
runners in list order; the spaces the platform sees are the wrapped ones, the episode
returns it reports the env's own, and a bad entry fails before anything starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_training import FAST_VTRACE

from rlfabric import Platform
from rlfabric.envs import EnvConfig
from rlfabric.errors import SpecError
from rlfabric.platform import presets
from rlfabric.platform.checkpoint import load_checkpoint
from rlfabric.platform.evaluate import evaluate
from rlfabric.platform.spec import ExperimentSpec
from rlfabric.runtime.env_runner import EnvRunner
from rlfabric.runtime.learner import make_algorithm

# tests/wrapper_helpers.py, found by path alone: the env runners import it themselves.
PAD = {"path": "wrapper_helpers:PaddedObservation", "kwargs": {"extra": 2, "value": 1.0}}
SCALE = {"path": "wrapper_helpers:ScaledReward", "kwargs": {"scale": 100.0}}
CARTPOLE_MAX_RETURN = 500.0  # a return above it can only be a scaled one


def _cartpole(*wrappers, num_envs: int = 4) -> dict:
    return {"id": "CartPole-v1", "num_envs": num_envs, "wrappers": list(wrappers)}


def _platform(tmp_path: Path, arch: str, env: dict) -> Platform:
    return Platform(
        arch=arch,
        algo=FAST_VTRACE,
        env=env,
        run={"display": "none", "logdir": str(tmp_path), "stop": {"env_frames": 1_500}},
    )


def _input_widths(checkpoint: str) -> set[int]:
    weights = load_checkpoint(Path(checkpoint))["algorithm"]["model"]
    return {w.shape[1] for w in weights.values() if w.ndim == 2}


def test_wrappers_apply_in_list_order_and_returns_stay_the_envs_own():
    # A string entry takes the wrapper's defaults (one 0.0), PAD then adds two 1.0s.
    cfg = EnvConfig(**_cartpole("wrapper_helpers:PaddedObservation", PAD, SCALE))
    runner = EnvRunner(cfg, index=0, seed=0, num_groups=1)
    request = runner.reset(0)
    for _ in range(100):
        assert request["obs"].shape == (4, 7)
        np.testing.assert_array_equal(request["obs"][:, 4:], [[0.0, 1.0, 1.0]] * 4)
        request = runner.step(0, runner.envs[0].action_space.sample())
        stepped = ~request["is_first"]  # the autoreset steps give 0
        np.testing.assert_array_equal(request["reward"][stepped], 100.0)  # what is learned
    tally = runner.tally.take()
    returns, lengths = tally["episode_returns"], tally["episode_lengths"]
    assert returns and returns == [float(n) for n in lengths]  # CartPole's own reward: 1
    runner.close()


def test_a_wrapper_by_path_with_kwargs_changes_the_spaces_and_runs_under_local(tmp_path):
    platform = _platform(tmp_path, "local", _cartpole(PAD, SCALE))
    assert platform.env_info.observation_space.shape == (6,)
    assert platform.env_info.observation_space.low[-1] == 1.0
    result = platform.fit()
    assert result.metrics["env_frames"] >= 1_500
    assert 0 < result.metrics["episode_return_mean"] <= CARTPOLE_MAX_RETURN
    assert 6 in _input_widths(result.checkpoint) and 4 not in _input_widths(result.checkpoint)
    # Evaluation plays the same wrapped envs and reports the env's own returns too.
    algorithm = make_algorithm(platform.spec, platform.env_info, None)
    episodes = evaluate(algorithm, platform.spec.env, episodes=2)
    np.testing.assert_array_equal(episodes.returns, episodes.lengths)


def test_wrappers_are_found_and_applied_in_the_ray_env_runners(ray_session, tmp_path):
    result = _platform(tmp_path, "seed", _cartpole(PAD, SCALE)).fit()
    assert result.metrics["env_frames"] >= 1_500 and result.metrics["runner_restarts"] == 0
    assert 0 < result.metrics["episode_return_mean"] <= CARTPOLE_MAX_RETURN
    assert 6 in _input_widths(result.checkpoint)


ALLOWED = "import path 'module:attr'"


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        (
            "no_such_wrapper_module:Wrap",
            r"env\.wrappers\.0\.path: cannot import module 'no_such_wrapper_module'",
        ),
        (
            "wrapper_helpers:PaddedObservatoin",
            r"env\.wrappers\.0\.path: 'wrapper_helpers' has no attribute 'PaddedObservatoin'; "
            r"did you mean 'PaddedObservation'\?",
        ),
        (
            "wrapper_helpers:NOT_A_WRAPPER",
            r"env\.wrappers\.0\.path: 'wrapper_helpers:NOT_A_WRAPPER' names a value of type int",
        ),
        (
            "wrapper_helpers.PaddedObservation",
            r"env\.wrappers\.0\.path: .* did you mean 'wrapper_helpers:PaddedObservation'\?",
        ),
        (
            {"path": "wrapper_helpers:PaddedObservation", "kwargs": [2]},
            r"env\.wrappers\.0: kwargs of 'wrapper_helpers:PaddedObservation' must be a "
            r"mapping of keyword arguments \(given: \[2\]\)",
        ),
        (3, r"env\.wrappers\.0: an entry is an import path"),
    ],
    ids=["no-module", "no-attribute", "not-callable", "not-module-attr", "kwargs", "not-entry"],
)
def test_a_bad_entry_fails_validation_naming_it_and_what_is_allowed(entry, error):
    with pytest.raises(SpecError, match=error) as err:
        ExperimentSpec.build({"env": _cartpole(entry)})
    assert ALLOWED in str(err.value)


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        (
            "wrapper_helpers:NeedsImages",
            r"env\.wrappers\.1 \('wrapper_helpers:NeedsImages'\): applying it to CartPole-v1 .*"
            r"raised ValueError: NeedsImages wraps image observations",
        ),
        (
            {"path": "wrapper_helpers:PaddedObservation", "kwargs": {"extar": 2}},
            r"env\.wrappers\.1 \('wrapper_helpers:PaddedObservation'\): .* raised TypeError: "
            r".*unexpected keyword argument 'extar'",
        ),
    ],
    ids=["raises", "wrong-kwarg"],
)
def test_a_wrapper_that_fails_on_the_probe_env_fails_before_anything_starts(entry, error):
    with pytest.raises(SpecError, match=error) as err:
        Platform(arch="local", algo=FAST_VTRACE, env=_cartpole(PAD, entry))
    assert ALLOWED in str(err.value)


def test_atari_ids_refuse_wrappers():
    with pytest.raises(SpecError, match=r"env.wrappers is not available for 'ALE/Pong-v5'"):
        ExperimentSpec.build({"env": {"id": "ALE/Pong-v5", "wrappers": [PAD]}})


def test_a_preset_sets_wrappers_and_the_users_list_replaces_it(monkeypatch):
    preset = {"classic": {"source": "test", "spec": {"env": {"wrappers": [PAD]}}}}
    monkeypatch.setattr(presets, "load_file", lambda algo: preset if algo == "vtrace" else {})
    spec = ExperimentSpec.build({"env": "CartPole-v1", "algo": "vtrace"})
    assert [w.model_dump() for w in spec.env.wrappers] == [PAD]
    assert spec.origin(("env", "wrappers")) == "preset vtrace/classic"
    spec = ExperimentSpec.build({"env": _cartpole(SCALE), "algo": "vtrace"})
    assert [w.model_dump() for w in spec.env.wrappers] == [SCALE]  # replaced, not appended
    assert spec.origin(("env", "wrappers")) == "user"
    assert ExperimentSpec.build({"env": _cartpole(), "algo": "vtrace"}).env.wrappers == []
