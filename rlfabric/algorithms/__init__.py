"""Algorithms: pure torch losses and update rules, registered by name."""

from rlfabric.algorithms.base import AlgoConfig, Algorithm, TrajectoryConfig
from rlfabric.algorithms.vtrace import VTrace

ALGORITHMS: dict[str, type[Algorithm]] = {
    "vtrace": VTrace,
}

__all__ = ["ALGORITHMS", "AlgoConfig", "Algorithm", "TrajectoryConfig"]
