"""One policy step for a list of runner requests, with each env's recurrent state.

Wherever inference runs (the learner under SEED and GA3C, the runner under
IMPALA, the one process of `local`), requests from several env groups are
stacked into one forward pass and the results split back. A recurrent policy's
state lives next to that inference, per env group, as SEED RL keeps it on the
learner: a group whose runner restarted (new run id) starts from a fresh
state, and the policy itself resets the state of envs whose observation
starts an episode.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np

from rlfabric.observations import batch_len, concat

Request = dict[str, Any]
#: (obs, state, first) -> (action, extras, next state)
ActFn = Callable[
    [np.ndarray, np.ndarray | None, np.ndarray],
    tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None],
]


class Acted(NamedTuple):
    """The policy's answer for one request."""

    action: np.ndarray
    extras: dict[str, np.ndarray]
    state: np.ndarray | None
    """The state the policy acted with (before resets): what an unroll starting here keeps."""


class RecurrentStates:
    """Per env group recurrent state; empty (all None) for a policy without memory."""

    def __init__(self, initial: Callable[[int], np.ndarray | None]) -> None:
        self.initial = initial
        self._states: dict[Any, tuple[str, np.ndarray]] = {}

    def get(self, request: Request) -> np.ndarray | None:
        entry = self._states.get(request["key"])
        if entry is None or entry[0] != request["run_id"]:
            return self.initial(batch_len(request["obs"]))
        return entry[1]

    def put(self, request: Request, state: np.ndarray | None) -> None:
        if state is not None:
            self._states[request["key"]] = (request["run_id"], state)


class UniformActions:
    """Uniform random actions in a Box: the warm-up policy of replay algorithms.

    CleanRL's SAC/TD3 sample `envs.action_space.sample()` until `learning_starts`.
    The extras are the replay algorithms' (`policy_action`, what RLx2's policy
    distance compares with), here the random action itself, so that unrolls
    keep one set of keys across the switch to the learned policy.
    """

    def __init__(self, space: gym.spaces.Box, seed: int) -> None:
        self.space = space
        self.rng = np.random.default_rng(seed)

    def __call__(self, n: int) -> tuple[np.ndarray, dict[str, np.ndarray], None]:
        low, high = self.space.low, self.space.high
        action = self.rng.uniform(low, high, (n, *self.space.shape)).astype(self.space.dtype)
        return action, {"policy_action": action}, None


def act_on_requests(act: ActFn, states: RecurrentStates, requests: list[Request]) -> list[Acted]:
    """One forward pass for all requests; returns one `Acted` per request, in order."""
    held = [states.get(r) for r in requests]
    state_in = None if held[0] is None else concat(held)
    action, extras, state_out = act(
        concat([r["obs"] for r in requests]), state_in, concat([r["is_first"] for r in requests])
    )
    acted, start = [], 0
    for request in requests:
        rows = slice(start, start + batch_len(request["obs"]))
        start = rows.stop
        if state_out is not None:
            states.put(request, state_out[rows])
        acted.append(
            Acted(
                action[rows],
                {k: v[rows] for k, v in extras.items()},
                None if state_in is None else state_in[rows],
            )
        )
    return acted


class ActedLedger:
    """What the policy computed for each step it acted on, kept next to inference
    until the runner's unroll of those steps arrives (GA3C's learner side).

    Per env group (request key), in acting order: the extras (behaviour
    log-probs, policy version, ...) and the recurrent state acted with. A
    runner's requests for one group are sequential, and its unrolls arrive in
    order, each holding the next `T` actions, so the oldest `T` entries are
    that unroll's. A new run id (a restarted runner) starts the group afresh;
    an unroll from a run that is no longer current is dropped and counted.
    """

    def __init__(self) -> None:
        self._groups: dict[Any, tuple[str, deque[Acted]]] = {}
        self._lock = threading.Lock()  # predictor threads record, runner calls attach
        self.dropped_unrolls = 0

    def record(self, request: Request, acted: Acted) -> None:
        run_id = request["run_id"]
        with self._lock:
            entry = self._groups.get(request["key"])
            if entry is None or entry[0] != run_id:
                entry = self._groups[request["key"]] = (run_id, deque())
            entry[1].append(acted)

    def attach(
        self, unroll: dict[str, np.ndarray], key: Any, run_id: str
    ) -> dict[str, np.ndarray] | None:
        """`unroll` with the extras of its `T` steps (`[T, n, ...]`) and, for a recurrent
        policy, the state its first step was acted with (`[1, n, ...]`); None if stale."""
        steps = len(unroll["action"])
        with self._lock:
            entry = self._groups.get(key)
            if entry is None or entry[0] != run_id or len(entry[1]) < steps:
                self.dropped_unrolls += 1
                return None
            acted = [entry[1].popleft() for _ in range(steps)]
        full = dict(unroll)
        for name in acted[0].extras:
            full[name] = np.stack([a.extras[name] for a in acted])
        if acted[0].state is not None:
            full["state"] = acted[0].state[None].copy()
        return full
