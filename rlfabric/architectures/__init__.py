"""Topologies, registered by name: a new one is one file and one line here."""

from rlfabric.architectures.base import ArchConfig, Architecture
from rlfabric.architectures.impala import ImpalaArchitecture
from rlfabric.architectures.local import LocalArchitecture
from rlfabric.architectures.seed import SeedArchitecture

ARCHITECTURES: dict[str, type[Architecture]] = {
    "seed": SeedArchitecture,
    "impala": ImpalaArchitecture,
    "local": LocalArchitecture,
}

__all__ = ["ARCHITECTURES", "ArchConfig", "Architecture"]
