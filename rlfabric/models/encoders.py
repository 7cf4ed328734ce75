"""Torsos from the observation space: every common gymnasium space, and the user's own.

A torso is an `nn.Module` built as `Torso(obs_space, **kwargs)` that maps a batch of
observations `[N, ...]` to features `[N, out_dim]` and exposes `out_dim` (SB3's
features-extractor contract, `features_dim`). The built-in ones meet it as a user's
does:

- an image `Box` (3-D uint8, channels first or last): the Nature CNN, or IMPALA's
  ResNet (`model.torso: impala_cnn`);
- any other `Box` flattened, `Discrete` one-hot, `MultiDiscrete` one-hot per dimension,
  `MultiBinary` as 0/1: the features of an MLP;
- `Dict` and `Tuple`, nested: flattened into entries named by their path (`"a/b"`,
  Tuple positions as `"0"`, `"1"`), every image entry through a CNN of its own, the
  rest concatenated into one MLP, and all the features concatenated, as SB3's
  `CombinedExtractor` encodes a Dict (one small encoder per key). Such observations
  are a dict of tensors keyed by those names.

Entries that are not arrays (MiniGrid's `mission` text, Graph, Sequence) have no
encoding here: the error names the entry and the wrapper that removes it.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from rlfabric.models.config import BUILTIN_TORSOS, ModelConfig, torso_name
from rlfabric.models.networks import MLP, ImpalaCNN, NatureCNN, PixelTorso
from rlfabric.observations import (
    ARRAY_SPACES,
    COMPOSITE_SPACES,
    UnsupportedSpaceError,
    flatten_space,
)

Obs = torch.Tensor | dict[str, torch.Tensor]
"""A batch of observations: one tensor, or one per flattened Dict/Tuple entry."""


def check_observation_space(space: gym.Space) -> None:
    """Raise UnsupportedSpaceError naming what no torso here can encode."""
    if isinstance(space, COMPOSITE_SPACES):
        flatten_space(space)
    elif not isinstance(space, ARRAY_SPACES):
        raise UnsupportedSpaceError(
            f"observation space {space} is not supported; allowed: Box, Discrete, "
            "MultiDiscrete, MultiBinary, and Dict/Tuple of these. A wrapper in env.wrappers "
            "can map it to one of them"
        )


class FlatFeatures(nn.Module):
    """One array entry as float features `[N, out_dim]`: a Box flattened, a Discrete
    one-hot, a MultiDiscrete one-hot per dimension (concatenated), a MultiBinary as 0/1."""

    def __init__(self, space: gym.Space) -> None:
        super().__init__()
        self.one_hot = isinstance(space, (gym.spaces.Discrete, gym.spaces.MultiDiscrete))
        if isinstance(space, gym.spaces.Discrete):
            sizes, start = np.array([space.n]), np.array([space.start])
        elif isinstance(space, gym.spaces.MultiDiscrete):
            sizes, start = space.nvec.reshape(-1), np.asarray(space.start).reshape(-1)
        else:
            sizes, start = np.ones(int(np.prod(space.shape)), np.int64), None
        self.out_dim = int(sizes.sum())
        if self.one_hot:
            # Value v of dimension d sets column offset[d] + v - start[d].
            offset = np.concatenate([[0], np.cumsum(sizes)[:-1]]) - start
            self.register_buffer("offset", torch.as_tensor(offset, dtype=torch.long), False)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        n = obs.shape[0]
        if not self.one_hot:
            return obs.reshape(n, -1).float()
        columns = obs.reshape(n, -1).long() + self.offset
        return torch.zeros(n, self.out_dim, device=obs.device).scatter_(1, columns, 1.0)


def image_layout(space: gym.Space, layout: str) -> str | None:
    """'chw' or 'hwc' for a 3-D Box (the channel axis is the shorter of the first and the
    last under 'auto': Atari's [4, 84, 84], MiniGrid's [7, 7, 3]); None for other spaces."""
    if not isinstance(space, gym.spaces.Box) or len(space.shape) != 3:
        return None
    if layout != "auto":
        return layout
    return "hwc" if space.shape[-1] < space.shape[0] else "chw"


def pixel_torso(space: gym.spaces.Box, kind: str, cfg: ModelConfig) -> PixelTorso:
    """The Nature CNN ('cnn') or IMPALA's ResNet ('impala_cnn') on a 3-D Box, either
    layout; uint8 pixels scaled by 1/255, float images taken as they are."""
    layout = image_layout(space, cfg.image_layout)
    if layout is None:
        raise UnsupportedSpaceError(
            f"model.torso={kind!r} needs image observations (a 3-D Box, [C, H, W] or "
            f"[H, W, C]), got {space} (allowed: 'mlp', 'auto', or a torso of your own)"
        )
    shape = space.shape if layout == "chw" else (space.shape[2], *space.shape[:2])
    cls = ImpalaCNN if kind == "impala_cnn" else NatureCNN
    if min(shape[1:]) < cls.min_side:
        raise UnsupportedSpaceError(
            f"model.torso={kind!r} (the Nature CNN) takes frames of at least {cls.min_side}x"
            f"{cls.min_side} pixels; {space} ({layout}) is {shape[1]}x{shape[2]} (allowed: "
            "'impala_cnn', 'mlp', or model.image_layout if the channel axis was misread)"
        )
    scale = 1.0 / 255.0 if space.dtype == np.uint8 else 1.0
    features = cfg.impala_features if kind == "impala_cnn" else cfg.cnn_features
    return cls(tuple(shape), features, channels_last=layout == "hwc", scale=scale)


def auto_image(space: gym.Space, cfg: ModelConfig) -> bool:
    """Whether 'auto' gives this entry the Nature CNN: a uint8 3-D Box whose frames the
    CNN takes. Smaller grids (MiniGrid's 7x7 view) go flattened into the MLP, as the RL
    Zoo's MiniGrid settings do."""
    layout = image_layout(space, cfg.image_layout)
    if layout is None or space.dtype != np.uint8:
        return False
    side = min(space.shape[1:]) if layout == "chw" else min(space.shape[:2])
    return side >= NatureCNN.min_side


class CombinedTorso(nn.Module):
    """Dict/Tuple observations: a CNN per image entry, one MLP over the rest, the features
    concatenated (SB3's `CombinedExtractor`)."""

    def __init__(self, space: gym.Space, cfg: ModelConfig) -> None:
        super().__init__()
        entries = flatten_space(space)
        images = [
            key
            for key, sub in entries.items()
            if (cfg.torso == "auto" and auto_image(sub, cfg))
            or (cfg.torso in ("cnn", "impala_cnn") and image_layout(sub, cfg.image_layout))
        ]
        if cfg.torso in ("cnn", "impala_cnn") and not images:
            raise UnsupportedSpaceError(
                f"model.torso={cfg.torso!r} encodes the image entries of {space}, which has "
                "none (a 3-D Box); allowed: 'auto' or 'mlp'"
            )
        kind = "cnn" if cfg.torso == "auto" else cfg.torso
        # Module names may not hold '.', which Dict keys may: keep the key beside each.
        self.image_keys = images
        self.cnns = nn.ModuleList([pixel_torso(entries[k], kind, cfg) for k in images])
        self.flat_keys = [k for k in entries if k not in images]
        self.flat = nn.ModuleList([FlatFeatures(entries[k]) for k in self.flat_keys])
        flat_dim = sum(f.out_dim for f in self.flat)
        self.mlp = MLP(flat_dim, cfg.hidden, cfg.activation) if self.flat else None
        self.out_dim = sum(c.out_dim for c in self.cnns) + (self.mlp.out_dim if self.mlp else 0)

    def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [cnn(obs[key]) for key, cnn in zip(self.image_keys, self.cnns)]
        if self.mlp is not None:
            flat = [enc(obs[key]) for key, enc in zip(self.flat_keys, self.flat)]
            parts.append(self.mlp(torch.cat(flat, dim=1)))
        return torch.cat(parts, dim=1)


def load_torso(path: str) -> Callable[..., nn.Module]:
    """The class or factory an import path `module:attr` names (attr may be dotted).

    The current folder is searched first, as the CLI's `--import` does; Ray's workers
    already look in the driver's folder, so a module next to the spec is found there too.
    """
    module_name, _, attr = path.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise UnsupportedSpaceError(
            f"model.torso={path!r}: cannot import module '{module_name}' ({err}); an import "
            "path is 'module:Class', the module on the Python path or in the current folder"
        ) from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UnsupportedSpaceError(
                f"model.torso={path!r}: module '{module_name}' has no attribute '{attr}'"
            )
        target = getattr(target, part)
    if not callable(target):
        raise UnsupportedSpaceError(f"model.torso={path!r} is not a class or a function")
    return target


def user_torso(obs_space: gym.Space, cfg: ModelConfig) -> nn.Module:
    """Build the user's torso as `Torso(obs_space, **model.torso_kwargs)` and check the
    contract: an nn.Module with a positive int `out_dim`."""
    factory = load_torso(cfg.torso) if isinstance(cfg.torso, str) else cfg.torso
    name = torso_name(cfg.torso)
    try:
        torso = factory(obs_space, **cfg.torso_kwargs)
    except Exception as err:  # the user's code: say whose call failed, and how
        raise UnsupportedSpaceError(
            f"model.torso={name!r} failed to build as Torso(obs_space, **model.torso_kwargs) "
            f"with torso_kwargs {cfg.torso_kwargs}: {type(err).__name__}: {err}"
        ) from err
    out_dim = getattr(torso, "out_dim", None)
    if not isinstance(torso, nn.Module) or not isinstance(out_dim, int) or out_dim <= 0:
        raise UnsupportedSpaceError(
            f"model.torso={name!r} built {type(torso).__name__}; a torso is an nn.Module "
            "with a positive int `out_dim` (its features' width), mapping observations "
            "[N, ...] to features [N, out_dim]"
        )
    return torso


def build_torso(obs_space: gym.Space, cfg: ModelConfig) -> nn.Module:
    """The torso `model.torso` names, or the one the observation space calls for."""
    if cfg.torso not in BUILTIN_TORSOS:
        return user_torso(obs_space, cfg)
    check_observation_space(obs_space)
    if isinstance(obs_space, COMPOSITE_SPACES):
        return CombinedTorso(obs_space, cfg)
    kind = cfg.torso
    if kind == "auto":
        kind = "cnn" if auto_image(obs_space, cfg) else "mlp"
    if kind in ("cnn", "impala_cnn"):
        return pixel_torso(obs_space, kind, cfg)
    features = FlatFeatures(obs_space)
    return MLP(features.out_dim, cfg.hidden, cfg.activation, encode=features)
