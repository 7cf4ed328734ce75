"""Unrolls assembled from per-step requests, and learner batches from unrolls.

Used where steps arrive one vector step at a time (SEED's learner-side
assembly, the local architecture). Following scalable_agent and SEED RL, an
unroll holds T+1 observations and consecutive unrolls of one env overlap by
one step: the last observation of an unroll bootstraps it and is the first of
the next one. Arrays are time-major: `[T+1, n, ...]` for `obs` and
`is_first`, `[T, n, ...]` for everything that follows an action, and
`[1, n, ...]` for a recurrent policy's `state` at the unroll's first step.
Dict observations are a dict of such arrays under `obs` (`rlfabric.observations`).

With reward normalization on (`algo.normalize_reward`), an unroll also carries
`return` `[T, n]`: each env's running discounted sum of rewards after step t,
as SB3's `VecNormalize` keeps it (`ret = ret * gamma + reward`, zeroed where an
episode ended). The sum runs across unrolls, which only the assembler sees in
order, one env group at a time; the learner turns its variance into the reward
scale (`models.normalization.RewardScaler`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlfabric.observations import concat, empty_like, first_array, obs_map, write

#: Keys carried by a step request that describe the step just taken.
STEP_OUTCOME = ("reward", "terminated", "truncated")


@dataclass
class _Block:
    run_id: str
    arrays: dict[str, np.ndarray]
    t: int = 0  # actions recorded so far in this block


def _empty_block(
    run_id: str,
    request: dict[str, Any],
    action: np.ndarray,
    extras: dict[str, np.ndarray],
    length: int,
    state: np.ndarray | None,
    with_return: bool,
) -> _Block:
    def alloc(steps: int, like: np.ndarray) -> np.ndarray:
        return np.empty((steps, *like.shape), dtype=like.dtype)

    arrays = {
        "obs": empty_like(request["obs"], (length + 1,)),
        "is_first": alloc(length + 1, request["is_first"]),
        "action": alloc(length, action),
        **{k: alloc(length, request[k]) for k in STEP_OUTCOME},
        **{k: alloc(length, v) for k, v in extras.items()},
    }
    if with_return:
        arrays["return"] = np.empty((length, *request["reward"].shape), np.float32)
    if state is not None:  # the recurrent state obs[0] was acted on with: [1, n, ...]
        arrays["state"] = state[None].copy()
    return _Block(run_id, arrays)


@dataclass
class UnrollAssembler:
    """Per (runner, group) ring of T+1 steps; emits full unrolls.

    A request holds the observation after the previous action together with
    that action's reward and done flags. A new `run_id` for a key means the
    runner restarted: its partial unroll is dropped and counted, and its
    running return (`return_gamma`: the discount of `return`, None: none) restarts at 0.
    """

    unroll_length: int
    return_gamma: float | None = None
    dropped_unrolls: int = 0
    _blocks: dict[Any, _Block] = field(default_factory=dict)
    _returns: dict[Any, np.ndarray] = field(default_factory=dict)

    def add(
        self,
        key: Any,
        request: dict[str, Any],
        action: np.ndarray,
        extras: dict[str, np.ndarray],
        state: np.ndarray | None = None,
    ) -> dict[str, np.ndarray] | None:
        """Record one vector step; return a finished unroll when one completes.

        `state` is the recurrent state the policy acted on `request["obs"]`
        with (before any reset at an episode start); the unroll keeps the one
        of its first step, from which the learner recomputes the rest.
        """
        block = self._blocks.get(key)
        run_id = request["run_id"]
        finished = None
        if block is None or block.run_id != run_id:
            if block is not None and block.t > 0:
                self.dropped_unrolls += 1
            block = self._blocks[key] = self._new_block(run_id, request, action, extras, state)
            write(block.arrays["obs"], 0, request["obs"])
            block.arrays["is_first"][0] = request["is_first"]
            if self.return_gamma is not None:
                self._returns[key] = np.zeros(request["reward"].shape, np.float32)
        else:
            t, a = block.t, block.arrays
            for k in STEP_OUTCOME:
                a[k][t - 1] = request[k]
            write(a["obs"], t, request["obs"])
            a["is_first"][t] = request["is_first"]
            if self.return_gamma is not None:
                self._running_return(key, request, out=a["return"][t - 1])
            if t == self.unroll_length:
                finished = a
                block = self._blocks[key] = self._new_block(run_id, request, action, extras, state)
                write(block.arrays["obs"], 0, obs_map(lambda x: x[t], a["obs"]))
                block.arrays["is_first"][0] = a["is_first"][t]
        a, t = block.arrays, block.t
        a["action"][t] = action
        for k, v in extras.items():
            a[k][t] = v
        block.t = t + 1
        return finished

    def _new_block(
        self,
        run_id: str,
        request: dict[str, Any],
        action: np.ndarray,
        extras: dict[str, np.ndarray],
        state: np.ndarray | None,
    ) -> _Block:
        with_return = self.return_gamma is not None
        return _empty_block(run_id, request, action, extras, self.unroll_length, state, with_return)

    def _running_return(self, key: Any, request: dict[str, Any], out: np.ndarray) -> None:
        """Write SB3 VecNormalize's `returns` after this step into `out`: the step's reward
        added to the discounted sum, which then restarts where the episode ended. An
        autoreset step (reward 0, not done) leaves the restarted sum at 0."""
        ret = self._returns[key]
        ret *= self.return_gamma
        ret += request["reward"]
        out[:] = ret
        ret[request["terminated"] | request["truncated"]] = 0.0


class BatchBuilder:
    """Concatenate unrolls along the batch axis into batches of exactly B columns."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self._pending: list[dict[str, np.ndarray]] = []
        self._columns = 0

    def add(self, unroll: dict[str, Any]) -> list[dict[str, Any]]:
        self._pending.append(unroll)
        self._columns += first_array(next(iter(unroll.values()))).shape[1]
        batches = []
        size = self.batch_size
        while self._columns >= size:
            merged = {k: concat([u[k] for u in self._pending], axis=1) for k in self._pending[0]}
            batches.append({k: obs_map(lambda x: x[:, :size], v) for k, v in merged.items()})
            self._columns -= size
            self._pending = (
                [{k: obs_map(lambda x: x[:, size:], v) for k, v in merged.items()}]
                if self._columns
                else []
            )
        return batches
