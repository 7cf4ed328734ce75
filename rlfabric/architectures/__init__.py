"""Topologies, registered by name: a new one is one file and one line here."""

from rlfabric.architectures.base import ArchConfig, Architecture
from rlfabric.architectures.ga3c import GA3CArchitecture
from rlfabric.architectures.impala import ImpalaArchitecture
from rlfabric.architectures.local import LocalArchitecture
from rlfabric.architectures.seed import SeedArchitecture

ARCHITECTURES: dict[str, type[Architecture]] = {
    "seed": SeedArchitecture,
    "impala": ImpalaArchitecture,
    "ga3c": GA3CArchitecture,
    "local": LocalArchitecture,
}

__all__ = ["ARCHITECTURES", "ArchConfig", "Architecture"]
