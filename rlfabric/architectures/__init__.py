"""Topologies (second layer): which actors exist and what flows between them.

Each file reads like its paper's figure (`seed`, `impala`, `ga3c`, and `local`
in one process) and wires runtime pieces into Ray actors; `topology` is the
driver's side they share, `runner_pool` the env runner actors, `learner_group`
the placement of data-parallel learners. Registered by name: a new topology
is one file and one line here. Imports go only down, to runtime/ and the leaves.
"""

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
