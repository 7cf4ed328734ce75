"""rlfabric: one RL platform on Ray in which the distributed architecture is a plug.

from rlfabric import Platform
result = Platform(arch="seed", algo="vtrace", env="CartPole-v1").fit()
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["ExperimentSpec", "Platform", "Result"]


def __getattr__(name: str) -> Any:
    # Lazy: `import rlfabric` stays cheap; torch and Ray load on first use.
    if name in ("Platform", "Result"):
        from rlfabric.platform import facade

        return getattr(facade, name)
    if name == "ExperimentSpec":
        from rlfabric.platform.spec import ExperimentSpec

        return ExperimentSpec
    raise AttributeError(f"module 'rlfabric' has no attribute {name!r}")
