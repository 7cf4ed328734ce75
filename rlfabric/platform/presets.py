"""Presets: tuned settings per algorithm and env family, shipped as data.

The algorithms' defaults are their papers' settings, which are Atari (V-trace,
A3C, PPO) or MuJoCo (SAC, TD3) settings; on CartPole or Pendulum they learn
slowly or not at all. Like the RL Zoo's `hyperparams/<algo>.yml`, each file
`hyperparams/<algo>.yaml` holds, per env family, the values that learn there,
where they came from, and (under `per_arch`) the values one architecture needs
on top (batch size against policy lag, queue capacity).

A spec's values come from three places, in this order: what the user wrote,
the preset for (algorithm, family[, architecture]), the algorithm's default.
`resolve` fills the user's raw mapping from the preset (never overwriting a
key the user wrote) and records where each value came from, so that
`rlfabric spec show` can say it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from rlfabric.envs import EnvConfig, describe_env
from rlfabric.envs.config import find_spec
from rlfabric.envs.factory import env_family

PRESET_DIR = Path(__file__).parent / "hyperparams"
#: Preset families: the env families of `envs.factory.env_family`, with "other" split by
#: observation space into flat vectors and images.
FAMILIES = ("classic", "atari", "mujoco", "vector", "pixels")
#: Names that are not presets: "auto" picks one by (algo, env family), "none" uses none.
AUTO, NONE = "auto", "none"
#: What a names-only spec is, before any preset (the spec's own defaults).
DEFAULT_NAMES = {"env": "CartPole-v1", "algo": "vtrace", "arch": "seed"}


@dataclass(frozen=True)
class Preset:
    """One family's block of one algorithm's file, with the architecture's extras and,
    where the family's values do not fit one env, that env's own block (`per_env`).

    Precedence, most specific first: the env's `per_arch`, the env's `spec`, the
    family's `per_arch`, the family's `spec`.
    """

    name: str  # "<algo>/<family>"
    source: str  # where the values come from (paper, RL Zoo, CleanRL, own sweep)
    settings: dict[str, Any]  # spec sections, as a user would write them
    arch: str | None = None  # the architecture whose `per_arch` block is in `arch_settings`
    arch_settings: dict[str, Any] = field(default_factory=dict)
    env_id: str | None = None  # the env whose `per_env` block is in `env_settings`
    env_settings: dict[str, Any] = field(default_factory=dict)
    env_arch_settings: dict[str, Any] = field(default_factory=dict)

    def label(self, path: tuple[str, ...]) -> str:
        """Where the preset's value at `path` comes from, for `spec show`."""
        if _lookup(self.env_arch_settings, path):
            return f"preset {self.name} ({self.env_id}, {self.arch})"
        if _lookup(self.env_settings, path):
            return f"preset {self.name} ({self.env_id})"
        if _lookup(self.arch_settings, path):
            return f"preset {self.name} ({self.arch})"
        return f"preset {self.name}"

    def yielding_to(self, user: dict[str, Any]) -> Preset:
        """This preset less the values the user's own choices rule out.

        Separate policy and value torsos (`model.shared_torso: false`) need an MLP
        policy without a recurrent core (`models.actor_critic`): a user who adds
        `model.lstm` to an env whose preset separates them gets the shared torso, the
        model's default, unless they set `shared_torso` themselves.
        """
        model = user.get("model")
        if not isinstance(model, dict) or not model.get("lstm") or "shared_torso" in model:
            return self

        def without_separate_torsos(block: dict[str, Any]) -> dict[str, Any]:
            block = copy.deepcopy(block)
            if isinstance(block.get("model"), dict):
                block["model"].pop("shared_torso", None)
            return block

        return dataclasses.replace(
            self,
            settings=without_separate_torsos(self.settings),
            arch_settings=without_separate_torsos(self.arch_settings),
            env_settings=without_separate_torsos(self.env_settings),
            env_arch_settings=without_separate_torsos(self.env_arch_settings),
        )

    def merged(self) -> dict[str, Any]:
        """Every block's settings, the more specific over the more general."""
        out = copy.deepcopy(self.env_arch_settings)
        for block in (self.env_settings, self.arch_settings, self.settings):
            fill(out, block)
        return out


@cache
def load_file(algo: str) -> dict[str, Any]:
    """The presets of one algorithm, by family ({} if the algorithm ships none)."""
    path = PRESET_DIR / f"{algo}.yaml"
    if not path.is_file():
        return {}
    return yaml.safe_load(path.read_text()) or {}


def preset_names() -> list[str]:
    """Every shipped preset, as `<algo>/<family>`."""
    return sorted(
        f"{path.stem}/{family}"
        for path in PRESET_DIR.glob("*.yaml")
        for family in load_file(path.stem)
    )


def family_of(env: EnvConfig) -> str:
    """The preset family of an env: by its registry entry, else by its observation space.

    An id outside the known families gets `vector` settings when its observations
    are flat (the classic-control values are the safe start there) and `pixels`
    (the papers' Atari settings) when they are images.
    """
    family = env_family(find_spec(env.id))
    if family != "other":
        return family
    shape = describe_env(env).observation_space.shape or ()
    return "pixels" if len(shape) >= 2 else "vector"


def find_preset(name: str, algo: str, arch: str, env: EnvConfig) -> Preset | None:
    """The preset `name` ("auto", "none", "<family>" or "<algo>/<family>") picks.

    Raises ValueError naming the preset and the ones there are when it does not exist.
    """
    if name == NONE:
        return None
    if name == AUTO:
        preset_algo, family = algo, family_of(env)
    else:
        preset_algo, _, family = name.rpartition("/")
        preset_algo = preset_algo or algo
    block = load_file(preset_algo).get(family)
    if block is None:
        if name == AUTO:
            return None  # no preset for this pair: the algorithm's defaults
        raise ValueError(
            f"unknown preset {name!r}; shipped: {', '.join(preset_names())} "
            f"(or {AUTO!r}, {NONE!r}, or a family name: {', '.join(FAMILIES)})"
        )
    env_block = (block.get("per_env") or {}).get(env.id) or {}
    source = block.get("source", "")
    if env_block.get("source"):
        source = f"{env.id}: {env_block['source']}; the rest: {source}"
    return Preset(
        name=f"{preset_algo}/{family}",
        source=source,
        settings=block.get("spec") or {},
        arch=arch,
        arch_settings=(block.get("per_arch") or {}).get(arch) or {},
        env_id=env.id if env_block else None,
        env_settings=env_block.get("spec") or {},
        env_arch_settings=(env_block.get("per_arch") or {}).get(arch) or {},
    )


def normalize(data: dict[str, Any]) -> dict[str, Any]:
    """A raw spec with its shorthands expanded (`algo: ppo` -> `algo: {name: ppo}`)."""
    data = copy.deepcopy(data)
    for section, key in (("env", "id"), ("algo", "name"), ("arch", "name")):
        if isinstance(data.get(section), str):
            data[section] = {key: data[section]}
    return data


def names(data: dict[str, Any]) -> dict[str, Any]:
    """The env id, algorithm and architecture a normalized raw spec names (or defaults)."""
    out = {}
    for section, key in (("env", "id"), ("algo", "name"), ("arch", "name")):
        node = data.get(section)
        value = node.get(key) if isinstance(node, dict) else None
        out[section] = value if value is not None else DEFAULT_NAMES[section]
    return out


def fill(target: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    """Copy into `target` every key of `source` it lacks, recursing into mappings both have."""
    for key, value in source.items():
        if key not in target:
            target[key] = copy.deepcopy(value)
        elif isinstance(target[key], dict) and isinstance(value, dict):
            fill(target[key], value)
    return target


def _lookup(data: Any, path: tuple[str, ...]) -> bool:
    """Whether `data` holds a value at `path` (or at a prefix of it that is not a mapping)."""
    for part in path:
        if not isinstance(data, dict):
            return True
        if part not in data:
            return False
        data = data[part]
    return True


@dataclass
class Provenance:
    """Where each value of a resolved spec came from: user, a preset, or the default."""

    user: dict[str, Any]
    preset: Preset | None

    def origin(self, path: tuple[str, ...]) -> str:
        if _lookup(self.user, path):
            return "user"
        if path == ("preset",):
            return f"default ({AUTO})"
        if self.preset is not None and _lookup(self.preset.merged(), path):
            return self.preset.label(path)
        return "default"
