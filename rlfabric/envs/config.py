"""Environment configuration: which gymnasium id, how many copies, how they are vectorised.

The Atari block holds the DeepMind preprocessing (Mnih et al. 2015, "Human-level control
through deep reinforcement learning", Extended Data Table 1) with the sticky actions of
Machado et al. 2018 ("Revisiting the Arcade Learning Environment", the v5 protocol), as
ale-py's C++ ``AtariVectorEnv`` implements it. These are the IMPALA / SEED RL settings too,
except that rewards are never clipped here: clipping is the algorithm's job.

Validation is cheap on purpose: it looks ids up in the gymnasium registry and imports the
modules of ``env.wrappers``, and never builds an environment, so a spec with a typo fails
before any actor starts (``describe_env`` then applies the wrappers to one probe env).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Literal

import ale_py
import gymnasium
from ale_py.registration import rom_id_to_name
from gymnasium.envs.registration import EnvSpec
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfabric.envs.wrappers import ALLOWED, resolve

# Importing ale_py registers the ALE ids; the call only makes that dependency explicit.
gymnasium.register_envs(ale_py)


class AtariConfig(BaseModel):
    """DeepMind Atari preprocessing and ALE v5 settings, applied to every Atari id.

    The id only names the game: ``PongNoFrameskip-v4`` and ``ALE/Pong-v5`` give the same
    environment here. For the older no-sticky-action protocol (DQN 2015, IMPALA) set
    ``repeat_action_probability=0``.
    """

    model_config = ConfigDict(extra="forbid")

    frameskip: int = Field(
        4, ge=1, description="Emulator frames per agent step (action repeated; max of the last 2)."
    )
    repeat_action_probability: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="Sticky actions: chance per frame to repeat the last action (ALE v5).",
    )
    noop_max: int = Field(
        30, ge=0, description="Up to this many no-op frames after a reset, for varied start states."
    )
    frame_stack: int = Field(4, ge=1, description="Most recent observations stacked along axis 0.")
    screen_size: int = Field(84, ge=8, description="Observation height and width in pixels.")
    grayscale: bool = Field(
        True, description="Gray frames [stack, H, W]; False: RGB [stack, H, W, 3]."
    )
    episodic_life: bool = Field(
        False,
        description="Terminate at each life loss (game goes on; returns still count whole games).",
    )
    full_action_space: bool = Field(
        False, description="All 18 actions, not the game's minimal set."
    )
    max_frames_per_episode: int = Field(
        108_000, ge=1, description="Truncate a game after this many emulator frames (30 min)."
    )
    num_threads: int = Field(
        1,
        ge=1,
        description="C++ threads per vector env (per group); with 2 groups, 1 fills 2 cores.",
    )


class WrapperConfig(BaseModel):
    """One gymnasium wrapper of ``env.wrappers``, applied to each env as
    ``wrapper(env, **kwargs)``; a string entry is shorthand for ``{path: ...}``."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Import path 'module:attr' of a wrapper class or function.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword args for the wrapper, after the env."
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"path": value}
        if not isinstance(value, Mapping):
            raise ValueError(f"{ALLOWED} (given: {value!r})")
        unknown = sorted(str(k) for k in value if k not in cls.model_fields)
        if unknown or "path" not in value:
            what = f"unknown key(s) {unknown}" if unknown else "no path"
            raise ValueError(f"the entry {dict(value)!r} has {what}; {ALLOWED}")
        kwargs = value.get("kwargs")
        if kwargs is None:  # `kwargs:` left empty in YAML
            return {k: v for k, v in value.items() if k != "kwargs"}
        if not isinstance(kwargs, Mapping):
            raise ValueError(
                f"kwargs of {value.get('path')!r} must be a mapping of keyword arguments "
                f"(given: {kwargs!r}); {ALLOWED}"
            )
        return value

    @field_validator("path")
    @classmethod
    def _importable(cls, value: str) -> str:
        try:
            resolve(value)
        except ValueError as err:
            raise ValueError(f"{err}; {ALLOWED}") from None
        return value


class EnvConfig(BaseModel):
    """Which environment, how many copies per env runner, and how they are stepped."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(
        "CartPole-v1", description="Registered gymnasium id, e.g. ALE/Pong-v5, HalfCheetah-v5."
    )
    num_envs: int = Field(
        64,
        ge=2,
        description="Envs per env runner, in groups that step alternately (arch.env_groups).",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword args for the env or vector env constructor.",
    )
    vectorization: Literal["auto", "sync", "async"] = Field(
        "auto", description="auto: a native vector env where one exists, else sync (one process)."
    )
    atari: AtariConfig = Field(
        default_factory=AtariConfig, description="Atari preprocessing (ALE ids only)."
    )
    wrappers: list[WrapperConfig] = Field(
        default_factory=list,
        description="Gymnasium wrappers for each env, in order: 'module:attr' or {path, kwargs}.",
    )

    @field_validator("id")
    @classmethod
    def _known_id(cls, value: str) -> str:
        if ":" in value:  # gymnasium.make("pkg.module:Env-v0") imports pkg.module
            raise ValueError(
                f"env id {value!r} names a module to import; a spec never runs code. "
                "Register the env in your own code (gymnasium.register) and use its id"
            )
        spec = find_spec(value)
        if is_atari(spec) and not _is_supported_atari_id(value):
            name = rom_id_to_name(spec.kwargs["game"])
            raise ValueError(
                f"Atari id {value!r} has its own frame skip / sticky-action protocol; use "
                f"'ALE/{name}-v5' (or '{name}NoFrameskip-v4'): the preprocessing "
                "comes from env.atari"
            )
        return value

    @model_validator(mode="after")
    def _atari_is_always_native(self) -> EnvConfig:
        if is_atari(find_spec(self.id)) and self.vectorization != "auto":
            raise ValueError(
                f"vectorization={self.vectorization!r} is not available for {self.id!r}: Atari ids "
                "always run in ale-py's C++ AtariVectorEnv; use vectorization='auto'"
            )
        return self

    @model_validator(mode="after")
    def _wrappers_need_gymnasium_envs(self) -> EnvConfig:
        if self.wrappers and is_atari(find_spec(self.id)):
            raise ValueError(
                f"env.wrappers is not available for {self.id!r}: Atari ids run in ale-py's C++ "
                "AtariVectorEnv, with no gymnasium env per game to wrap; the preprocessing "
                "comes from env.atari (allowed: wrappers: [])"
            )
        return self


def find_spec(env_id: str) -> EnvSpec:
    """The registry entry of ``env_id``; a ValueError with close matches if there is none."""
    try:
        return gymnasium.spec(env_id)
    except gymnasium.error.Error:
        usable = {i.lower(): i for i, spec in gymnasium.registry.items() if _is_usable(i, spec)}
        query = env_id.lower()
        close = difflib.get_close_matches(query, list(usable), n=5, cutoff=0.6)
        close += [i for i in usable if query in i and i not in close]
        hint = f"did you mean {', '.join(repr(usable[c]) for c in close[:5])}? " if close else ""
        raise ValueError(
            f"unknown env id {env_id!r}: {hint}({len(gymnasium.registry)} ids are registered; "
            "gymnasium.pprint_registry() lists them)"
        ) from None


def is_atari(spec: EnvSpec) -> bool:
    """True for ids served by ale-py (the emulator's entry point)."""
    return isinstance(spec.entry_point, str) and spec.entry_point.startswith("ale_py")


def _is_supported_atari_id(env_id: str) -> bool:
    return env_id.startswith("ALE/") or env_id.endswith("NoFrameskip-v4")


def _is_usable(env_id: str, spec: EnvSpec) -> bool:
    """Worth suggesting: not a stub that only raises (mujoco-py ids), not refused Atari."""
    if not isinstance(spec.entry_point, str):
        return False
    return not is_atari(spec) or _is_supported_atari_id(env_id)
