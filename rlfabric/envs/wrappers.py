"""The user's gymnasium wrappers (``env.wrappers``): found by import path, applied per env.

Each env of a vector env is built as, innermost first::

    gymnasium.make(env.id, **env.kwargs)  # the env with its registered wrappers (TimeLimit)
    RecordEnvReward                       # its own reward, into info["rlfabric_env_reward"]
    env.wrappers[0](env, **kwargs)        # the user's wrappers, in list order
    env.wrappers[1](env, **kwargs) ...

and around the vector env sit the platform's own pieces (``factory.py``): Box actions clipped
to their bounds, float Box observations cast to float32. Atari ids have no per-env gymnasium
env to wrap (ale-py's C++ ``AtariVectorEnv`` steps the games and does the DeepMind
preprocessing), so ``env.wrappers`` is refused for them.

Why there. As the RL Zoo's ``env_wrapper`` (Stable-Baselines3's ``make_vec_env`` puts its
``Monitor`` on the env first and the wrapper class over it), the user's wrappers sit right
on the env ``gymnasium.make`` returns, beneath everything rlfabric adds:

- a wrapper that changes the spaces (MiniGrid's ``ImgObsWrapper``: a Dict observation to
  its image) changes what everything after it sees: ``describe_env`` builds the same chain,
  so the driver, the models and the learner get the wrapped spaces, and the platform's
  dtype and clipping contract holds on what the last wrapper emits;
- the reward is recorded beneath them, so a wrapper that scales or shapes rewards changes
  what the agent learns from but not the episode returns reported, which stay sums of the
  env's own rewards (``EpisodeTracker`` reads ``info["rlfabric_env_reward"]``). Where that
  is not possible they are the wrapped rewards: a wrapper that drops the info dict. A
  wrapper that moves where episodes end (a time limit) changes which episodes are counted.

Where they are found. A path is ``module:attr`` (``attr`` may be dotted). The module is
imported as ``rlfabric --import`` imports one: from the installed packages, ``PYTHONPATH``
and the current folder. The spec is validated in the driver (the module imports, the
attribute exists and is callable, and a probe env takes the wrappers: ``describe_env``).
Each env runner resolves the same paths in its own process as it makes its envs
(``wrapper_chain`` in ``make_vector_env``, before any env is built), as ``gymnasium.make``
imports an env's ``module:Class`` entry point there: a wrapper's module must be importable
on every Ray worker, as an env module is.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import gymnasium
import numpy as np

from rlfabric.errors import SpecError

if TYPE_CHECKING:
    from rlfabric.envs.config import WrapperConfig

#: The info key under which RecordEnvReward puts each step's own reward of the env.
ENV_REWARD = "rlfabric_env_reward"
#: What an `env.wrappers` entry may be, for error messages.
ALLOWED = (
    "an entry is an import path 'module:attr' of a gymnasium wrapper (a class or function "
    "called as wrapper(env, **kwargs) that returns the wrapped env), or a mapping "
    "{path: 'module:attr', kwargs: {...}}"
)


def import_user_module(name: str) -> ModuleType:
    """Import a user's module, from the current folder too, as ``rlfabric --import`` does.

    The ``rlfabric`` script's ``sys.path`` starts with its own bin folder, not the folder it
    runs in; Ray's workers look in the driver's folder already.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        here = os.getcwd()
        missing = err.name is not None and name.split(".")[0] == err.name.split(".")[0]
        if not missing or here in sys.path or "" in sys.path:
            raise ValueError(f"cannot import module {name!r} ({err})") from None
        sys.path.insert(0, here)
        return import_user_module(name)
    except Exception as err:  # the module itself raised: name it, not our traceback
        raise ValueError(f"importing module {name!r} raised {type(err).__name__}: {err}") from None


def resolve(path: str) -> Callable[..., gymnasium.Env]:
    """The callable that the import path ``module:attr`` names; a ValueError saying why not."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        module_guess, _, attr_guess = path.rpartition(".")
        hint = f"; did you mean '{module_guess}:{attr_guess}'?" if module_guess else ""
        raise ValueError(f"{path!r} is not an import path of the form 'module:attr'{hint}")
    module = import_user_module(module_name)
    target: Any = module
    for depth, part in enumerate(attr.split(".")):
        try:
            target = getattr(target, part)
        except AttributeError:
            where = ".".join([module_name, *attr.split(".")[:depth]])
            names = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"{where!r} has no attribute {part!r}{hint}") from None
    if not callable(target):
        raise ValueError(
            f"{path!r} names a value of type {type(target).__name__}, not a class or "
            "function: a wrapper is called as wrapper(env, **kwargs)"
        )
    return target


class RecordEnvReward(gymnasium.Wrapper):
    """Puts the env's own reward of each step into ``info["rlfabric_env_reward"]``, beneath
    the user's wrappers, for the episode returns rlfabric reports."""

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        # A float: the vector env's info array takes the dtype of the first value it sees.
        return obs, reward, terminated, truncated, {**info, ENV_REWARD: float(reward)}


def env_rewards(reward: np.ndarray, info: Mapping[str, Any] | None) -> np.ndarray:
    """The env's own rewards of one vector step: what RecordEnvReward put in ``info`` where
    it reached the vector env, else ``reward`` (no wrappers, or one that dropped the info)."""
    if not info or ENV_REWARD not in info:
        return reward
    return np.where(info[f"_{ENV_REWARD}"], info[ENV_REWARD], reward)


def wrapper_chain(wrappers: Sequence[WrapperConfig]) -> list[Callable[[gymnasium.Env], Any]]:
    """What ``gymnasium.make_vec`` applies to each env, innermost first: RecordEnvReward,
    then the user's wrappers in list order ([] without user wrappers)."""
    if not wrappers:
        return []
    chain: list[Callable[[gymnasium.Env], Any]] = [RecordEnvReward]
    for index, entry in enumerate(wrappers):
        try:
            wrapper = resolve(entry.path)
        except ValueError as err:  # a worker that cannot find what the driver found
            raise SpecError(f"invalid spec: env.wrappers.{index}.path: {err}") from None
        chain.append(functools.partial(_apply, index, entry.path, wrapper, dict(entry.kwargs)))
    return chain


def _apply(
    index: int,
    path: str,
    wrapper: Callable[..., Any],
    kwargs: dict[str, Any],
    env: gymnasium.Env,
) -> gymnasium.Env:
    """``wrapper(env, **kwargs)``; a SpecError naming the entry if it raises or returns
    something that is not an env (the driver's probe env meets it first: describe_env)."""
    env_id = env.spec.id if env.spec is not None else type(env.unwrapped).__name__
    entry = f"env.wrappers.{index} ({path!r})"
    try:
        wrapped = wrapper(env, **kwargs)
    except Exception as err:
        raise SpecError(
            f"invalid spec: {entry}: applying it to {env_id} with kwargs {kwargs} raised "
            f"{type(err).__name__}: {err} ({ALLOWED})"
        ) from err
    if not isinstance(wrapped, gymnasium.Env):
        raise SpecError(
            f"invalid spec: {entry}: applied to {env_id} it returned a "
            f"{type(wrapped).__name__}, not a gymnasium.Env ({ALLOWED})"
        )
    return wrapped
