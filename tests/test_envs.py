"""rlfabric.envs: spaces and dtypes per family, the NEXT_STEP contract, Atari frame counting
and episodic life, episode bookkeeping, and config validation. Small envs, few steps."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from rlfabric.envs import (
    AtariConfig,
    EnvConfig,
    EpisodeTracker,
    describe_env,
    make_vector_env,
)
from rlfabric.runtime.env_runner import EnvRunner


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    """MuJoCo writes its warnings (HalfCheetah's deprecated settotalmass) to ./MUJOCO_LOG.TXT."""
    monkeypatch.chdir(tmp_path)


def _step_until_done(envs, policy, max_steps: int = 2000):
    """Step until some env is done; return that step's output and the step after it."""
    for _ in range(max_steps):
        out = envs.step(policy())
        if (out[2] | out[3]).any():
            return out, envs.step(policy())
    raise AssertionError("no episode ended")


# --- spaces and dtypes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env_id", "family", "obs_shape", "obs_dtype", "frameskip"),
    [
        ("CartPole-v1", "classic", (4,), np.float32, 1),
        ("ALE/Pong-v5", "atari", (4, 84, 84), np.uint8, 4),
        ("HalfCheetah-v5", "mujoco", (17,), np.float32, 1),
    ],
)
def test_spaces_and_dtypes(env_id, family, obs_shape, obs_dtype, frameskip):
    cfg = EnvConfig(id=env_id)
    info = describe_env(cfg)
    assert (info.env_id, info.family, info.frameskip) == (env_id, family, frameskip)
    assert info.observation_space.shape == obs_shape
    assert info.observation_space.dtype == obs_dtype

    envs = make_vector_env(cfg, num_envs=2, seed=0)
    try:
        assert envs.single_observation_space == info.observation_space
        assert envs.single_action_space == info.action_space
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, *obs_shape) and obs.dtype == obs_dtype
        obs, reward, terminated, truncated, _ = envs.step(envs.action_space.sample())
        assert obs.shape == (2, *obs_shape) and obs.dtype == obs_dtype
        assert isinstance(reward, np.ndarray) and reward.dtype in (np.float32, np.float64)
        assert terminated.dtype == truncated.dtype == np.bool_
    finally:
        envs.close()


def test_registry_facts():
    info = describe_env(EnvConfig(id="CartPole-v1"))
    assert info.reward_threshold == 475.0 and info.max_episode_steps == 500
    assert describe_env(EnvConfig(id="ALE/Pong-v5")).max_episode_steps == 108_000 // 4


def test_atari_game_names():
    info = describe_env(EnvConfig(id="ALE/SpaceInvaders-v5"))
    assert info.family == "atari" and info.action_space.n == 6
    legacy = describe_env(EnvConfig(id="SpaceInvadersNoFrameskip-v4"))
    assert legacy.observation_space == info.observation_space and legacy.frameskip == 4


# --- NEXT_STEP autoreset, termination vs truncation ----------------------------------------


@pytest.mark.parametrize("vectorization", ["auto", "sync"])
def test_cartpole_next_step_autoreset(vectorization):
    envs = make_vector_env(EnvConfig(vectorization=vectorization), num_envs=4, seed=0)
    envs.reset(seed=0)
    push_right = np.ones(4, dtype=np.int64)  # falls over in ~10 steps
    (_, _, terminated, truncated, _), after = _step_until_done(envs, lambda: push_right)
    done = terminated | truncated
    assert terminated[done].all() and not truncated.any()
    obs, reward, terminated, truncated, _ = after
    assert (reward[done] == 0).all() and not (terminated[done] | truncated[done]).any()
    assert (np.abs(obs[done]) <= 0.05).all()  # a reset observation
    envs.close()


@pytest.mark.parametrize("vectorization", ["auto", "sync"])
def test_cartpole_truncation_stays_apart(vectorization):
    cfg = EnvConfig(vectorization=vectorization, kwargs={"max_episode_steps": 5})
    assert describe_env(cfg).max_episode_steps == 5
    envs = make_vector_env(cfg, num_envs=3, seed=0)
    envs.reset(seed=0)
    alternate = [np.full(3, t % 2, dtype=np.int64) for t in range(6)]
    outs = [envs.step(a) for a in alternate]
    assert not any(o[2].any() or o[3].any() for o in outs[:4])
    assert outs[4][3].all() and not outs[4][2].any()  # truncated, not terminated
    assert (outs[5][1] == 0).all() and not (outs[5][2] | outs[5][3]).any()
    envs.close()


def test_mujoco_next_step_autoreset():
    envs = make_vector_env(EnvConfig(id="InvertedPendulum-v5"), num_envs=2, seed=0)
    envs.reset(seed=0)
    (_, _, terminated, _, _), after = _step_until_done(envs, envs.action_space.sample)
    _, reward, terminated_after, truncated_after, _ = after
    assert (reward[terminated] == 0).all()
    assert not (terminated_after[terminated] | truncated_after[terminated]).any()
    envs.close()


def test_atari_truncation_and_next_step_autoreset():
    cfg = EnvConfig(id="ALE/Pong-v5", atari=AtariConfig(max_frames_per_episode=40))
    envs = make_vector_env(cfg, num_envs=2, seed=0)
    envs.reset(seed=0)
    noop = np.zeros(2, dtype=np.int64)
    outs = [envs.step(noop) for _ in range(11)]
    assert not any(o[2].any() or o[3].any() for o in outs[:9])
    assert outs[9][3].all() and not outs[9][2].any()  # 40 frames = 10 agent steps
    _, reward, terminated, truncated, info = outs[10]
    assert (reward == 0).all() and not (terminated | truncated).any()
    assert (info["episode_frame_number"] < 40).all()  # a fresh game
    envs.close()


def test_pong_frameskip_counts_frames():
    cfg = EnvConfig(id="ALE/Pong-v5")  # sticky actions on: they change actions, not frames
    assert describe_env(cfg).frameskip == 4
    envs = make_vector_env(cfg, num_envs=2, seed=0)
    _, info = envs.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(20):
        before = info
        _, _, _, _, info = envs.step(rng.integers(0, 6, size=2))
        for key in ("frame_number", "episode_frame_number"):
            assert (info[key] - before[key] == 4).all()
    envs.close()


def test_continuous_actions_are_clipped():
    envs = make_vector_env(EnvConfig(id="InvertedPendulum-v5"), num_envs=2, seed=0)
    assert envs.single_action_space.high[0] == 3.0  # bounds survive the clipping
    envs.reset(seed=[7, 7])
    obs, *_ = envs.step(np.array([[100.0], [3.0]]))
    np.testing.assert_array_equal(obs[0], obs[1])
    envs.close()


# --- episodic life (Atari) -----------------------------------------------------------------


def test_breakout_episodic_life_goes_on_and_reports_whole_games():
    cfg = EnvConfig(id="ALE/Breakout-v5", atari=AtariConfig(episodic_life=True))
    envs = make_vector_env(cfg, num_envs=2, seed=0)
    _, info = envs.reset(seed=0)
    tracker = EpisodeTracker(2, episodic_life=True)
    rng = np.random.default_rng(0)
    game_return, game_length, life_losses, games = np.zeros(2), np.zeros(2, int), 0, []
    prev_done = life_lost = np.zeros(2, dtype=bool)
    for _ in range(3000):
        before = info
        _, reward, terminated, truncated, info = envs.step(rng.integers(0, 4, size=2))
        returns, lengths = tracker.update(reward, terminated, truncated, info)
        np.testing.assert_array_equal(tracker.first, prev_done)  # reset obs just returned
        assert (reward[prev_done] == 0).all() and not (terminated | truncated)[prev_done].any()
        for i in np.flatnonzero(life_lost):  # the step after a life loss: same game goes on
            assert info["episode_frame_number"][i] > before["episode_frame_number"][i]
            assert info["lives"][i] == before["lives"][i]
        game_return += np.where(prev_done, 0.0, reward)
        game_length += ~prev_done
        game_over = (terminated | truncated) & (info["lives"] == 0)
        life_lost = terminated & (info["lives"] > 0)
        life_losses += int(life_lost.sum())
        assert len(returns) == game_over.sum()
        np.testing.assert_array_equal(returns, game_return[game_over])
        np.testing.assert_array_equal(lengths, game_length[game_over])
        games += list(returns)
        game_return[game_over], game_length[game_over] = 0.0, 0
        prev_done = terminated | truncated
        if len(games) >= 2:
            break
    envs.close()
    assert len(games) >= 2 and life_losses >= 4


def test_env_runner_counts_whole_games_with_episodic_life():
    """Through an EnvRunner (what the learner's returns, episode counts and threshold stop
    see): a life loss ends no episode; the game over ends one with the whole game's return."""
    cfg = EnvConfig(id="ALE/Breakout-v5", num_envs=2, atari=AtariConfig(episodic_life=True))
    runner = EnvRunner(cfg, index=0, seed=0, num_groups=2)  # one env per group; group 0 plays
    rng = np.random.default_rng(0)
    runner.reset(0)
    life_losses, game_return = 0, 0.0
    for _ in range(3000):
        request = runner.step(0, rng.integers(0, 4, size=1))
        game_return += float(request["reward"][0])
        if runner.tally.episode_returns:
            break
        life_losses += int(request["terminated"][0])
    runner.close()
    assert life_losses == 4  # Breakout's 5 lives: 4 life losses, then the game over
    assert runner.tally.take()["episode_returns"] == [pytest.approx(game_return)]


def _play_breakout(max_frames: int, steps: int) -> list[tuple]:
    """Seeded (so replayable) Breakout with episodic life: the outputs of ``steps`` steps."""
    cfg = EnvConfig(
        id="ALE/Breakout-v5",
        atari=AtariConfig(episodic_life=True, max_frames_per_episode=max_frames),
    )
    envs = make_vector_env(cfg, num_envs=1, seed=0)
    envs.reset(seed=0)
    rng = np.random.default_rng(0)
    outs = [envs.step(rng.integers(0, 4, size=1)) for _ in range(steps)]
    envs.close()
    return outs


def test_episodic_life_game_ending_on_restart_step():
    """If the game ends during the step after a life loss (here by the frame limit), the env
    is reset at once and the tracker reports the game at that step."""
    life_loss_step = next(t for t, out in enumerate(_play_breakout(108_000, 200)) if out[2][0])
    frames_played = 4 * (life_loss_step + 1)
    outs = _play_breakout(frames_played + 2, life_loss_step + 2)
    assert outs[-2][2][0] and outs[-2][4]["lives"][0] == 4  # the life loss, as before
    _, reward, terminated, truncated, info = outs[-1]
    assert reward[0] == 0 and not (terminated[0] or truncated[0])
    assert info["lives"][0] == 5 and info["episode_frame_number"][0] < frames_played  # new game
    tracker = EpisodeTracker(1, episodic_life=True)
    reported = [len(tracker.update(*out[1:])[0]) for out in outs]
    assert reported == [0] * (life_loss_step + 1) + [1]


# --- EpisodeTracker on hand-made sequences -------------------------------------------------


def _flags(*rows):
    return [np.array(r, dtype=bool) for r in rows]


def test_tracker_skips_autoreset_step_and_flags_first():
    tracker = EpisodeTracker(3)
    assert tracker.first.all()
    rewards = [[1, 2, 3], [1, 2, 3], [0, 0, 3], [5, 5, 3]]
    terminated = _flags([0, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0])
    truncated = _flags([0, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 1])
    expected_first = _flags([0, 0, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0])
    ended = []
    for r, te, tr, first in zip(rewards, terminated, truncated, expected_first, strict=True):
        ended.append(tracker.update(np.array(r, dtype=np.float32), te, tr))
        np.testing.assert_array_equal(tracker.first, first)
    assert [len(e[0]) for e in ended] == [0, 2, 0, 1]
    np.testing.assert_array_equal(ended[1][0], [2.0, 4.0])
    np.testing.assert_array_equal(ended[1][1], [2, 2])
    np.testing.assert_array_equal(ended[3][0], [12.0])  # env 2: 4 steps of 3
    np.testing.assert_array_equal(ended[3][1], [4])
    # Envs 0 and 1 restarted at step 2 (a reset step, not counted) and run one step since.
    terminated = np.array([True, True, False])
    returns, lengths = tracker.update(np.ones(3), terminated, np.zeros(3, dtype=bool))
    np.testing.assert_array_equal(returns, [6.0, 6.0])
    np.testing.assert_array_equal(lengths, [2, 2])


def test_tracker_episodic_life():
    tracker = EpisodeTracker(1, episodic_life=True)

    def step(reward, terminated, lives, frame, truncated=False):
        info = {"lives": np.array([lives]), "episode_frame_number": np.array([frame])}
        flags = np.array([terminated]), np.array([truncated])
        return tracker.update(np.array([reward]), *flags, info)

    assert len(step(1.0, False, 2, 20)[0]) == 0
    assert len(step(1.0, True, 1, 24)[0]) == 0  # life lost: episode ends, game goes on
    assert not tracker.first.any()
    assert len(step(0.0, False, 1, 28)[0]) == 0  # restart step, not counted
    assert tracker.first.all()
    returns, lengths = step(3.0, True, 0, 32)  # game over
    np.testing.assert_array_equal(returns, [5.0])
    np.testing.assert_array_equal(lengths, [3])
    # A "life loss" after which ALE restarts the game (frame count drops): reported late.
    assert len(step(0.0, False, 2, 12)[0]) == 0  # reset step
    assert len(step(2.0, True, 1, 16)[0]) == 0
    returns, lengths = step(0.0, False, 2, 10)
    np.testing.assert_array_equal(returns, [2.0])
    np.testing.assert_array_equal(lengths, [1])
    returns, _ = step(1.0, False, 2, 14, truncated=True)  # time limit with lives left
    np.testing.assert_array_equal(returns, [1.0])
    tracker.reset()
    assert tracker.first.all()


# --- config validation ---------------------------------------------------------------------


def test_unknown_id_names_it_and_suggests():
    with pytest.raises(ValueError, match=r"'CartPol-v1'.*'CartPole-v1'.*ids are registered"):
        EnvConfig(id="CartPol-v1")
    with pytest.raises(ValueError, match=r"'Pong-v5'.*'ALE/Pong-v5'"):
        EnvConfig(id="Pong-v5")


def test_config_refusals():
    with pytest.raises(ValueError, match="ALE/Pong-v5"):
        EnvConfig(id="Pong-v0")
    with pytest.raises(ValueError, match="AtariVectorEnv"):
        EnvConfig(id="ALE/Pong-v5", vectorization="async")
    with pytest.raises(ValidationError):
        EnvConfig(num_env=4)
    with pytest.raises(ValidationError):
        EnvConfig(num_envs=1)
    with pytest.raises(ValueError, match="frameskip"):
        make_vector_env(EnvConfig(id="ALE/Pong-v5", kwargs={"frameskip": 2}), 2, 0)
