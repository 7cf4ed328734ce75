"""Networks and heads: pure torch, built from the spaces and the model spec."""

from rlfabric.models.actor_critic import ActorCritic, UnsupportedSpaceError
from rlfabric.models.config import ModelConfig
from rlfabric.models.normalization import ObsNormalizer, RewardScaler, build_obs_normalizer

__all__ = [
    "ActorCritic",
    "ModelConfig",
    "ObsNormalizer",
    "RewardScaler",
    "UnsupportedSpaceError",
    "build_obs_normalizer",
]
