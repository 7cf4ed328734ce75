"""Observation batches as the platform carries them: an array, or a flat dict of arrays.

A `Dict` or `Tuple` observation space, nested or not, is flattened once, where the envs
are made, into a one-level `Dict` whose keys are the entries' paths (`"agent/pos"`,
Tuple positions as `"0"`, `"1"`); every later layer (env runners, Ray's object store,
unrolls, learner batches, models) sees either one array `[N, ...]` or a dict of them
with those keys, all with the same leading axes. The helpers here treat both alike, for
numpy arrays and torch tensors, so no layer needs a branch per case and no entry travels
in a message of its own (a dict of numpy arrays pickles zero-copy like one array).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import gymnasium as gym
import numpy as np

SEPARATOR = "/"
"""Joins the keys of nested Dict/Tuple entries into one flat name."""

ARRAY_SPACES = (
    gym.spaces.Box,
    gym.spaces.Discrete,
    gym.spaces.MultiDiscrete,
    gym.spaces.MultiBinary,
)
COMPOSITE_SPACES = (gym.spaces.Dict, gym.spaces.Tuple)

T = TypeVar("T")


class UnsupportedSpaceError(ValueError):
    """An observation or action space no model here can handle."""


def _items(space: gym.Space) -> list[tuple[str, gym.Space]]:
    if isinstance(space, gym.spaces.Dict):
        return [(str(k), sub) for k, sub in space.spaces.items()]
    return [(str(i), sub) for i, sub in enumerate(space.spaces)]


def flatten_space(space: gym.Space, prefix: str = "") -> dict[str, gym.Space]:
    """The array entries of a Dict/Tuple space by their flattened names, in the space's
    order (gymnasium sorts Dict keys); raises naming the first entry that is no array."""
    if not isinstance(space, COMPOSITE_SPACES):
        raise TypeError(f"{space} is not a Dict or Tuple space")
    entries: dict[str, gym.Space] = {}
    for key, sub in _items(space):
        name = f"{prefix}{SEPARATOR}{key}" if prefix else key
        if isinstance(sub, COMPOSITE_SPACES):
            entries.update(flatten_space(sub, name))
        elif isinstance(sub, ARRAY_SPACES):
            entries[name] = sub
        else:
            raise UnsupportedSpaceError(
                f"observation entry '{name}' is {sub}, which is not an array; allowed entries: "
                "Box, Discrete, MultiDiscrete, MultiBinary (nested in Dict/Tuple). Drop or "
                "encode it with a wrapper in env.wrappers (MiniGrid's text 'mission': "
                "minigrid.wrappers:ImgObsWrapper keeps only the image)"
            )
    return entries


def flat_dict_space(space: gym.Space) -> gym.spaces.Dict | None:
    """The one-level Dict a composite space flattens to; None for an array space, or for
    one with an entry that is no array (left as it is, for the model's error to name)."""
    if not isinstance(space, COMPOSITE_SPACES):
        return None
    try:
        entries = flatten_space(space)
    except UnsupportedSpaceError:
        return None
    return gym.spaces.Dict(OrderedDict(entries))  # a plain dict would be sorted again


def flatten_obs(obs: Any, prefix: str = "") -> dict[str, Any]:
    """A (batched) nested Dict/Tuple observation as the flat dict `flatten_space` names."""
    items = obs.items() if isinstance(obs, Mapping) else enumerate(obs)
    flat: dict[str, Any] = {}
    for key, value in items:
        name = f"{prefix}{SEPARATOR}{key}" if prefix else str(key)
        if isinstance(value, (Mapping, tuple)):
            flat.update(flatten_obs(value, name))
        else:
            flat[name] = value
    return flat


def obs_map(fn: Callable[..., T], obs: Any, *more: Any) -> Any:
    """`fn` on an observation batch's array, or on each of its entries (with the same
    entry of each of `more`)."""
    if isinstance(obs, Mapping):
        return {key: fn(value, *(m[key] for m in more)) for key, value in obs.items()}
    return fn(obs, *more)


def first_array(obs: Any) -> Any:
    """An array of the batch, for its leading shape, dtype family or device."""
    return next(iter(obs.values())) if isinstance(obs, Mapping) else obs


def batch_len(obs: Any) -> int:
    """The leading size of an observation batch (`len` of a dict counts its keys)."""
    return len(first_array(obs))


def concat(batches: Sequence[Any], axis: int = 0) -> Any:
    """Observation batches joined along `axis` (one batch is returned as it is)."""
    if len(batches) == 1:
        return batches[0]
    if isinstance(batches[0], Mapping):
        return {k: np.concatenate([b[k] for b in batches], axis) for k in batches[0]}
    return np.concatenate(batches, axis)


def empty_like(obs: Any, lead: tuple[int, ...]) -> Any:
    """Uninitialised arrays of `lead + obs[i].shape`, dtype per entry, for a block to fill."""
    return obs_map(lambda x: np.empty(lead + np.shape(x), np.asarray(x).dtype), obs)


def write(out: Any, index: Any, obs: Any) -> None:
    """`out[index] = obs`, entry by entry for a dict."""
    if isinstance(out, Mapping):
        for key, value in obs.items():
            out[key][index] = value
    else:
        out[index] = obs


def sample_batch(space: gym.Space, n: int) -> Any:
    """`n` samples of an observation space, stacked as the envs give them."""
    samples = [space.sample() for _ in range(n)]
    if isinstance(space, gym.spaces.Dict):
        return {k: np.stack([s[k] for s in samples]) for k in space.spaces}
    return np.stack(samples)
