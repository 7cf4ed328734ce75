"""Gymnasium environment factories: classic control, Atari (ale-py) and MuJoCo.

Pure gymnasium and numpy, no Ray or torch: the env runners build their vector envs here.
"""

from rlfabric.envs.config import AtariConfig, EnvConfig, WrapperConfig
from rlfabric.envs.episodes import EpisodeTracker
from rlfabric.envs.factory import EnvInfo, describe_env, ensure_registered, make_vector_env

__all__ = [
    "AtariConfig",
    "EnvConfig",
    "EnvInfo",
    "EpisodeTracker",
    "WrapperConfig",
    "describe_env",
    "ensure_registered",
    "make_vector_env",
]
