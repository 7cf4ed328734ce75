"""Evaluate a policy on fresh envs: one whole episode per env, greedy by default.

Training returns are those of the exploring policy (SAC's samples, TD3's
noise, the random warm-up) averaged over a window that trails the run;
evaluation answers what the policy does now. Each of the `episodes` envs
plays exactly its first episode, so short episodes are not over-counted (the
first N finishes of fewer envs would favour them). Atari games are played
whole, without the training's episodic life.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlfabric.algorithms import Algorithm
from rlfabric.envs import EnvConfig, EpisodeTracker, describe_env, make_vector_env
from rlfabric.envs.config import find_spec, is_atari
from rlfabric.envs.wrappers import env_rewards
from rlfabric.errors import CheckpointError, RLFabricError
from rlfabric.platform.checkpoint import newest_checkpoint
from rlfabric.platform.spec import ExperimentSpec
from rlfabric.runtime.learner import make_algorithm


@dataclass
class Evaluation:
    returns: np.ndarray
    lengths: np.ndarray

    @property
    def mean(self) -> float:
        return float(self.returns.mean())

    @property
    def std(self) -> float:
        return float(self.returns.std())


def whole_games(env_cfg: EnvConfig) -> EnvConfig:
    """The env as trained, but an Atari episode is the whole game (no episodic life)."""
    return env_cfg.model_copy(
        update={"atari": env_cfg.atari.model_copy(update={"episodic_life": False})}
    )


def evaluate(
    algorithm: Algorithm,
    env_cfg: EnvConfig,
    episodes: int = 10,
    *,
    deterministic: bool = True,
    seed: int = 1_000_003,
) -> Evaluation:
    """Play `episodes` episodes, one per env, with `algorithm.act` (deterministic: its mode).

    The default seed keeps evaluation episodes apart from the training envs' seeds.
    """
    envs = make_vector_env(whole_games(env_cfg), episodes, seed)
    try:
        obs, _ = envs.reset(seed=seed)
        state = algorithm.initial_state(episodes)
        tracker = EpisodeTracker(episodes)
        returns, lengths = np.full(episodes, np.nan), np.zeros(episodes, np.int64)
        while np.isnan(returns).any():
            action, _, state = algorithm.act(obs, state, tracker.first, deterministic=deterministic)
            obs, reward, terminated, truncated, info = envs.step(action)
            ended_returns, ended_lengths = tracker.update(reward, terminated, truncated, info)
            first_time = np.isnan(returns[tracker.ended])  # keep each env's first episode
            envs_ended = np.flatnonzero(tracker.ended)[first_time]
            returns[envs_ended] = ended_returns[first_time]
            lengths[envs_ended] = ended_lengths[first_time]
        return Evaluation(returns, lengths)
    finally:
        envs.close()


def load_policy(logdir: str | Path) -> tuple[ExperimentSpec, Algorithm]:
    """The spec of the run in `logdir` and its algorithm with the newest checkpoint loaded."""
    logdir = Path(logdir)
    if not (logdir / "spec.yaml").is_file():
        raise CheckpointError(f"{str(logdir)!r} is not a run folder: it has no spec.yaml")
    _, state = newest_checkpoint(logdir / "checkpoints", replay=False)
    spec = ExperimentSpec.from_yaml(logdir / "spec.yaml")
    env_info = describe_env(spec.env)
    budget = spec.stop_conditions(env_info.reward_threshold).env_frames
    algorithm = make_algorithm(spec, env_info, budget)
    algorithm.load_state_dict(state["algorithm"])
    return spec, algorithm


def record_video(
    algorithm: Algorithm,
    env_cfg: EnvConfig,
    path: Path,
    *,
    deterministic: bool = True,
    seed: int = 1_000_003,
    max_steps: int = 5_000,
    fps: int = 30,
) -> tuple[Path, float]:
    """Play one episode and write it as a GIF (or MP4 when imageio-ffmpeg is installed).

    Frames are the env's own `rgb_array` renders; Atari envs (ale-py's vector env
    does not render) show what the agent sees, the newest frame of each stack,
    enlarged 3x. Returns the file written and the episode's return.
    """
    import imageio.v3 as iio

    atari = is_atari(find_spec(env_cfg.id))
    cfg = whole_games(env_cfg)
    if not atari:
        cfg = cfg.model_copy(update={"kwargs": {**cfg.kwargs, "render_mode": "rgb_array"}})
    envs = make_vector_env(cfg, 1, seed)
    frames, total = [], 0.0
    try:
        obs, _ = envs.reset(seed=seed)
        state = algorithm.initial_state(1)
        first = np.ones(1, bool)
        for _ in range(max_steps):
            if atari:
                frame = np.asarray(obs[0][-1])
                frames.append(np.repeat(np.repeat(frame, 3, axis=0), 3, axis=1))
            else:
                frames.append(_render(envs, env_cfg.id))
            action, _, state = algorithm.act(obs, state, first, deterministic=deterministic)
            obs, reward, terminated, truncated, info = envs.step(action)
            total += float(env_rewards(reward, info)[0])  # the env's own, as training reports
            first = np.zeros(1, bool)
            if terminated[0] or truncated[0]:
                break
    finally:
        envs.close()
    if importlib.util.find_spec("imageio_ffmpeg") is not None:
        path = path.with_suffix(".mp4")
        iio.imwrite(path, np.stack(frames), fps=fps)
    else:
        path = path.with_suffix(".gif")
        iio.imwrite(path, np.stack(frames), duration=1000 / fps, loop=0)
    return path, total


def _render(envs: Any, env_id: str) -> np.ndarray:
    """Env 0's `rgb_array` frame, or a clear error naming what rendering needs."""
    try:
        return np.asarray(envs.render()[0])
    except Exception as err:  # pygame missing, no OpenGL: a message, not a traceback
        raise RLFabricError(
            f"cannot render {env_id} for a video ({type(err).__name__}: {err}). Classic "
            "control needs pygame; MuJoCo without a display needs MUJOCO_GL=egl or osmesa"
        ) from err
