"""Export a run's greedy policy: TorchScript (and ONNX when the `onnx` package is there).

The exported file runs with torch alone, no rlfabric: `torch.jit.load` it and
call it on a batch of observations as the env produces them (for Atari, the
DeepMind-preprocessed uint8 frame stacks; scaling is inside; for Dict observations, a
dict of tensors keyed by each entry's path, as `policy.json` lists them). A recurrent
policy takes `(obs, state, first)` and returns `(action, next_state)`; its
initial state is zeros `[N, 2, H]`. Next to the policy go `policy.json`
(shapes, dtypes, the env id) and `load_policy.py`, a tiny script that loads
the policy and acts on one observation.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import torch

from rlfabric.algorithms import Algorithm
from rlfabric.errors import RLFabricError
from rlfabric.observations import obs_map, sample_batch
from rlfabric.platform.spec import ExperimentSpec

log = logging.getLogger(__name__)

FORMATS = ("torchscript", "onnx")

_EXAMPLE = '''"""Load the exported policy with torch alone and act on one observation."""

import json
from pathlib import Path

import numpy as np
import torch

here = Path(__file__).parent
info = json.loads((here / "policy.json").read_text())
policy = torch.jit.load(str(here / "policy.pt"))
if isinstance(info["obs_shape"], dict):  # Dict observations: one array per entry
    obs = {
        key: torch.as_tensor(np.zeros([1, *shape], dtype=info["obs_dtype"][key]))
        for key, shape in info["obs_shape"].items()
    }
else:
    obs = torch.as_tensor(np.zeros([1, *info["obs_shape"]], dtype=info["obs_dtype"]))
if info["recurrent"]:
    state = torch.zeros([1, *info["state_shape"]])
    action, state = policy(obs, state, torch.ones(1, dtype=torch.bool))
else:
    action = policy(obs)
print(f"{info['env_id']}: action {action.tolist()} for a zero observation")
'''


def _per_entry(space: gym.Space, fact: Callable[[gym.Space], Any]) -> Any:
    """`fact` of the observation space, or of each entry of a (flat) Dict space."""
    if isinstance(space, gym.spaces.Dict):
        return {key: fact(sub) for key, sub in space.spaces.items()}
    return fact(space)


def example_inputs(algorithm: Algorithm, batch: int = 2) -> tuple[torch.Tensor, ...]:
    """Observations (and state, first flags) shaped as the env and policy expect."""
    obs = obs_map(torch.as_tensor, sample_batch(algorithm.obs_space, batch))
    state = algorithm.initial_state(batch)
    if state is None:
        return (obs,)
    return obs, torch.as_tensor(state), torch.ones(batch, dtype=torch.bool)


def export_policy(
    spec: ExperimentSpec, algorithm: Algorithm, out: Path, formats: tuple[str, ...]
) -> list[Path]:
    """Write the policy in each format to `out`; returns the files written."""
    for fmt in formats:
        if fmt not in FORMATS:
            raise RLFabricError(f"unknown export format {fmt!r}; allowed: {', '.join(FORMATS)}")
    out.mkdir(parents=True, exist_ok=True)
    policy = copy.deepcopy(algorithm.greedy_policy()).eval().requires_grad_(False)
    inputs = example_inputs(algorithm)
    written = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice
        if "torchscript" in formats:
            traced = torch.jit.trace(policy, inputs, check_trace=False)
            traced.save(str(out / "policy.pt"))
            written.append(out / "policy.pt")
        if "onnx" in formats:
            if importlib.util.find_spec("onnx") is None:
                raise RLFabricError("ONNX export needs the 'onnx' package: pip install onnx")
            torch.onnx.export(policy, inputs, str(out / "policy.onnx"), dynamo=False)
            written.append(out / "policy.onnx")
    state = algorithm.initial_state(1)
    info = {
        "env_id": spec.env.id,
        "algo": spec.algo.name,
        "obs_shape": _per_entry(algorithm.obs_space, lambda s: list(s.shape)),
        "obs_dtype": _per_entry(algorithm.obs_space, lambda s: str(s.dtype)),
        "action_space": str(algorithm.action_space),
        "recurrent": state is not None,
        "state_shape": None if state is None else list(state.shape[1:]),
    }
    (out / "policy.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "load_policy.py").write_text(_EXAMPLE)
    return [*written, out / "policy.json", out / "load_policy.py"]
