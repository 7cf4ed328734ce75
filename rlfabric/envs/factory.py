"""Vector environments for the env runners, one factory for every family.

Every vector env made here keeps the contract the platform relies on:

- autoreset is ``NEXT_STEP``: the step after a done returns the reset observation with
  reward 0, ``terminated`` and ``truncated`` False, and ignores its action;
- ``terminated`` and ``truncated`` stay apart (a truncated episode bootstraps);
- float Box observations are float32, rewards a float numpy array;
- continuous actions are clipped to the action-space bounds inside the env, so a policy may
  emit unbounded Gaussian samples while ``single_action_space`` keeps its bounds;
- the user's ``env.wrappers`` wrap each env beneath all of that (``wrappers.py`` says why).

The caller resets: ``envs.reset(seed=seed)`` seeds every env from ``seed`` (sync, async and
ALE: env ``i`` gets ``seed + i``; a native vector env draws all from one generator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import ale_py
import gymnasium
import numpy as np
from ale_py.vector_env import AtariVectorEnv
from gymnasium import spaces
from gymnasium.envs.registration import EnvSpec, load_env_creator
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space
from gymnasium.wrappers.vector import TransformAction, TransformObservation

from rlfabric.envs.config import AtariConfig, EnvConfig, find_spec, is_atari
from rlfabric.envs.wrappers import wrapper_chain
from rlfabric.observations import flat_dict_space, flatten_obs

Family = Literal["classic", "atari", "mujoco", "other"]

# Entry-point module prefixes per family; "other" is whatever matches none.
_FAMILY_PREFIXES: dict[str, Family] = {
    "ale_py": "atari",
    "gymnasium.envs.mujoco": "mujoco",
    "gymnasium.envs.classic_control": "classic",
    "gymnasium.envs.box2d": "classic",
}

# AtariVectorEnv arguments that env.atari owns or that would break the contract above.
_ATARI_FIXED_KWARGS = {
    "frameskip", "repeat_action_probability", "noop_max", "stack_num", "img_height",
    "img_width", "grayscale", "episodic_life", "life_loss_info", "full_action_space",
    "max_num_frames_per_episode", "num_threads", "autoreset_mode", "batch_size", "continuous",
}  # fmt: skip


@dataclass(frozen=True)
class EnvInfo:
    """What the rest of the platform needs to know about an env, without stepping it."""

    env_id: str
    family: Family
    observation_space: spaces.Space
    action_space: spaces.Space
    frameskip: int  # emulator frames per agent step: env_frames = frameskip * agent_steps
    reward_threshold: float | None
    max_episode_steps: int | None  # agent steps before truncation
    # The id's registry entry, for processes where nothing registered it (a Ray worker,
    # for an env the user registered in the driver): `ensure_registered` adds it there.
    registration: EnvSpec | None = None


def env_family(spec: EnvSpec) -> Family:
    """Classify an id by the module of its entry point."""
    entry = spec.entry_point if isinstance(spec.entry_point, str) else ""
    for prefix, family in _FAMILY_PREFIXES.items():
        if entry.startswith(prefix):
            return family
    return "other"


def describe_env(cfg: EnvConfig) -> EnvInfo:
    """Spaces and registry facts of ``cfg.id``, exactly as :func:`make_vector_env` makes it:
    the spaces of the last of ``cfg.wrappers``. Building the env is the probe of the
    wrappers: one that raises is a SpecError naming it, before any actor starts."""
    spec = find_spec(cfg.id)
    # Same spaces as async, without starting a worker process.
    sync = cfg.model_copy(update={"vectorization": "sync"}) if cfg.vectorization == "async" else cfg
    envs = make_vector_env(sync, num_envs=1, seed=0)
    try:
        obs_space, act_space = envs.single_observation_space, envs.single_action_space
    finally:
        envs.close()
    if is_atari(spec):
        frameskip = cfg.atari.frameskip
        max_steps = math.ceil(cfg.atari.max_frames_per_episode / frameskip)
    else:
        frameskip = 1
        max_steps = cfg.kwargs.get("max_episode_steps", spec.max_episode_steps)
    return EnvInfo(
        env_id=cfg.id,
        family=env_family(spec),
        observation_space=obs_space,
        action_space=act_space,
        frameskip=frameskip,
        reward_threshold=spec.reward_threshold,
        max_episode_steps=max_steps,
        registration=spec,
    )


def ensure_registered(info: EnvInfo) -> None:
    """Register the env's id in this process if it is not yet (a Ray worker making an env
    the user registered in the driver). Its entry point travels with it: a class by
    reference (its module is imported here, as an `--import` module would be), a
    function or class of the driver's `__main__` by value."""
    spec = info.registration
    if spec is not None and spec.id not in gymnasium.registry:
        gymnasium.registry[spec.id] = spec


def make_vector_env(cfg: EnvConfig, num_envs: int, seed: int) -> VectorEnv:
    """``num_envs`` copies of ``cfg.id`` as one vector env, not yet reset.

    ``seed`` seeds the action spaces (reproducible ``action_space.sample()`` for random
    warm-up); the caller resets with ``envs.reset(seed=seed)``.
    """
    spec = find_spec(cfg.id)
    if is_atari(spec):
        envs = make_atari_vector_env(spec.kwargs["game"], num_envs, cfg.atari, cfg.kwargs)
    else:
        wrappers = wrapper_chain(cfg.wrappers)  # imports their modules in this process
        mode = _vectorization_mode(spec, cfg.vectorization, wrapped=bool(wrappers))
        envs = gymnasium.make_vec(
            cfg.id,
            num_envs=num_envs,
            vectorization_mode=mode,
            vector_kwargs=(
                {} if mode == "vector_entry_point" else {"autoreset_mode": AutoresetMode.NEXT_STEP}
            ),
            wrappers=wrappers,
            **cfg.kwargs,
        )
        envs = _flat_dict_observations(_float32_observations(_clipped_actions(envs)))
    envs.action_space.seed(seed)
    envs.single_action_space.seed(seed)
    return envs


def make_atari_vector_env(
    game: str, num_envs: int, atari: AtariConfig, kwargs: dict[str, Any] | None = None
) -> AtariVectorEnv:
    """ale-py's threaded C++ vector env with the DeepMind preprocessing of ``atari``.

    ``game`` is the ROM name in snake case (``"space_invaders"``); the registry's ``kwargs``
    hold it for every ALE id. ``kwargs`` pass through (e.g. ``use_fire_reset``, ``maxpool``,
    ``thread_affinity_offset``) except the arguments that ``atari`` owns.
    """
    kwargs = dict(kwargs or {})
    clash = sorted(_ATARI_FIXED_KWARGS & kwargs.keys())
    if clash:
        raise ValueError(f"env.kwargs {clash} are set through env.atari or fixed by rlfabric")
    return _DeepMindAtariVectorEnv(
        game,
        num_envs,
        episodic_life=atari.episodic_life,
        frameskip=atari.frameskip,
        repeat_action_probability=atari.repeat_action_probability,
        noop_max=atari.noop_max,
        stack_num=atari.frame_stack,
        img_height=atari.screen_size,
        img_width=atari.screen_size,
        grayscale=atari.grayscale,
        full_action_space=atari.full_action_space,
        max_num_frames_per_episode=atari.max_frames_per_episode,
        num_threads=atari.num_threads,
        **{"reward_clipping": False, **kwargs},
    )


class _DeepMindAtariVectorEnv(AtariVectorEnv):
    """AtariVectorEnv with float rewards and DeepMind's episodic life.

    ale-py 0.12's own ``episodic_life=True`` *restarts the game* at every life loss (its
    NEXT_STEP reset calls ``reset_game``), so an agent would never see a second life and
    whole-game scores would not exist. DeepMind's ``EpisodicLifeEnv`` (baselines
    ``atari_wrappers.py``) instead ends the *episode* at a life loss and goes on with the
    same game. We get that from ``life_loss_info=True`` (terminated at a life loss, the game
    continues) plus one step that keeps NEXT_STEP semantics: the step after a life loss
    plays FIRE (if the game has it and ``use_fire_reset``, like the reset does) or NOOP
    instead of the agent's action, and reports reward 0, not terminated, not truncated.
    The frame stack is not cleared there. ``info["lives"]`` and
    ``info["episode_frame_number"]`` tell a game over from a life loss (see EpisodeTracker).
    """

    def __init__(self, game: str, num_envs: int, *, episodic_life: bool, **kwargs: Any) -> None:
        super().__init__(
            game, num_envs, life_loss_info=episodic_life, autoreset_mode=AutoresetMode.NEXT_STEP,
            **kwargs,
        )  # fmt: skip
        self._episodic_life = episodic_life
        self._life_restart = np.zeros(num_envs, dtype=bool)
        action_set = self.ale.get_action_set()
        fire = kwargs.get("use_fire_reset", True) and ale_py.Action.FIRE in action_set
        self._life_start_action = action_set.index(ale_py.Action.FIRE) if fire else 0

    def reset(
        self, *, seed: int | np.ndarray | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        mask = (options or {}).get("reset_mask")
        self._life_restart[slice(None) if mask is None else mask] = False
        return super().reset(seed=seed, options=options)

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        self.send(actions)
        return self.recv()

    def send(self, actions: np.ndarray) -> None:
        """Queue the actions; the C++ threads step while the caller does other work."""
        if self._life_restart.any():
            actions = np.where(self._life_restart, self._life_start_action, actions)
        super().send(actions)

    def recv(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """Wait for the step queued by :meth:`send`."""
        obs, reward, terminated, truncated, info = super().recv()
        reward = reward.astype(np.float32)
        restart = self._life_restart
        if restart.any():
            game_ended = restart & (terminated | truncated)
            reward[restart] = 0.0
            terminated[restart] = False
            truncated[restart] = False
            if game_ended.any():
                # The restart step itself ended the game (a life lost within `frameskip`
                # frames, or the frame limit): reset now so the contract holds.
                reset_obs, reset_info = super().reset(options={"reset_mask": game_ended})
                obs[game_ended] = reset_obs[game_ended]
                for key, value in info.items():
                    value[game_ended] = reset_info[key][game_ended]
        if self._episodic_life:
            self._life_restart = terminated & (info["lives"] > 0)
        return obs, reward, terminated, truncated, info


def _vectorization_mode(spec: EnvSpec, vectorization: str, wrapped: bool = False) -> str:
    """auto picks the id's own vector env, but only one that autoresets in NEXT_STEP mode
    and only without per-env wrappers (a native vector env has no single env to wrap)."""
    if vectorization == "auto" and spec.vector_entry_point is not None and not wrapped:
        creator = load_env_creator(spec.vector_entry_point)
        if getattr(creator, "metadata", {}).get("autoreset_mode") == AutoresetMode.NEXT_STEP:
            return "vector_entry_point"
    return "async" if vectorization == "async" else "sync"


def _clipped_actions(envs: VectorEnv) -> VectorEnv:
    """Clip Box actions to their bounds; unlike gymnasium's ClipAction the space stays bounded."""
    space = envs.single_action_space
    if not isinstance(space, spaces.Box) or not np.issubdtype(space.dtype, np.floating):
        return envs
    low, high, dtype = space.low, space.high, space.dtype
    return TransformAction(envs, lambda a: np.clip(np.asarray(a, dtype=dtype), low, high))


def _flat_dict_observations(envs: VectorEnv) -> VectorEnv:
    """Dict/Tuple observations, nested or not, as one flat dict of arrays keyed by each
    entry's path (`rlfabric.observations`): every later layer sees one level of keys.
    Float Box entries become float32, as whole Box observations do."""
    flat = flat_dict_space(envs.single_observation_space)
    if flat is None:
        return envs
    floats = {
        k
        for k, sub in flat.spaces.items()
        if isinstance(sub, spaces.Box) and np.issubdtype(sub.dtype, np.floating)
    }
    for key in floats:
        sub = flat.spaces[key]
        flat.spaces[key] = spaces.Box(
            sub.low.astype(np.float32), sub.high.astype(np.float32), dtype=np.float32
        )

    def flatten(obs: Any) -> dict[str, np.ndarray]:
        entries = flatten_obs(obs)
        for key in floats:
            entries[key] = entries[key].astype(np.float32, copy=False)
        return entries

    return TransformObservation(
        envs,
        flatten,
        observation_space=batch_space(flat, envs.num_envs),
        single_observation_space=flat,
    )


def _float32_observations(envs: VectorEnv) -> VectorEnv:
    """Cast float Box observations (MuJoCo gives float64) to float32, the models' dtype."""
    space = envs.single_observation_space
    if (
        not isinstance(space, spaces.Box)
        or not np.issubdtype(space.dtype, np.floating)
        or space.dtype == np.float32
    ):
        return envs
    single = spaces.Box(
        space.low.astype(np.float32), space.high.astype(np.float32), dtype=np.float32
    )
    return TransformObservation(
        envs, lambda obs: obs.astype(np.float32), single_observation_space=single
    )
