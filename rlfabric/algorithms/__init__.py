"""Algorithms: pure torch losses and update rules, registered by name."""

from rlfabric.algorithms.a3c import A3C
from rlfabric.algorithms.base import AlgoConfig, Algorithm, TrajectoryConfig
from rlfabric.algorithms.ppo import PPO
from rlfabric.algorithms.sac import SAC
from rlfabric.algorithms.td3 import TD3
from rlfabric.algorithms.vtrace import VTrace

ALGORITHMS: dict[str, type[Algorithm]] = {
    "a3c": A3C,
    "ppo": PPO,
    "sac": SAC,
    "td3": TD3,
    "vtrace": VTrace,
}

__all__ = ["ALGORITHMS", "AlgoConfig", "Algorithm", "TrajectoryConfig"]
