"""Networks and heads: pure torch, built from the spaces and the model spec."""

from rlfabric.models.actor_critic import ActorCritic, UnsupportedSpaceError
from rlfabric.models.config import ModelConfig

__all__ = ["ActorCritic", "ModelConfig", "UnsupportedSpaceError"]
