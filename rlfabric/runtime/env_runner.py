"""EnvRunner: a vector of envs split into groups that step alternately.

A runner answers one request per *group* vector step, never per env. Two
groups let one group step while the other waits for its actions (Sample
Factory's double-buffered sampling; SEED RL's actors do the same with
threads). The runner knows nothing of Ray or of who picks the actions: an
architecture drives `reset` and `step` and ships the requests.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlfabric.envs import EnvConfig, EpisodeTracker, make_vector_env
from rlfabric.envs.config import find_spec, is_atari
from rlfabric.observations import batch_len

Request = dict[str, Any]


@dataclass
class StepTally:
    """Step and episode counts of a runner since it last shipped them.

    The one route by which the learner learns of env steps: every runner counts
    its own steps here, and ships `take()` with what it sends the learner (each
    request under SEED and GA3C, each unroll under IMPALA); the learner records
    it (`Learner.record_steps`).
    """

    requests: int = 0
    stepped_requests: int = 0  # requests that followed an env step (not a reset)
    vector_steps: int = 0  # env steps, autoreset steps included
    agent_steps: int = 0  # env steps that were real decisions
    env_step_s: float = 0.0
    inference_s: float = 0.0  # runner-side inference (IMPALA); SEED times it on the server
    weight_syncs: int = 0  # new weight versions a runner loaded
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)

    def add(
        self, is_first: np.ndarray, episodes: tuple[np.ndarray, np.ndarray], env_step_s: float
    ) -> None:
        """Count one group step whose observations start an episode where `is_first`."""
        self.requests += 1
        self.stepped_requests += env_step_s > 0
        self.vector_steps += len(is_first)
        self.agent_steps += int(len(is_first) - np.count_nonzero(is_first))
        self.env_step_s += env_step_s
        self.episode_returns += np.asarray(episodes[0], np.float64).tolist()
        self.episode_lengths += np.asarray(episodes[1], np.int64).tolist()

    def take(self) -> dict[str, Any]:
        """The counts so far, as a plain dict; start counting afresh."""
        out = dict(self.__dict__)
        self.__init__()  # type: ignore[misc]
        return out


def group_sizes(num_envs: int, num_groups: int) -> list[int]:
    """Split `num_envs` into `num_groups` near-equal groups."""
    base, extra = divmod(num_envs, num_groups)
    return [base + (g < extra) for g in range(num_groups)]


class EnvRunner:
    """Steps `env.num_envs` envs in `num_groups` vector groups.

    Each request carries the observation after the last action together with
    that action's reward and done flags (SEED RL's actor message) and the
    `is_first` flags (the observation starts an episode). The runner counts its
    steps, finished episodes and step time in `tally`, which the architecture
    ships to the learner with its next message.
    """

    def __init__(self, env_cfg: EnvConfig, index: int, seed: int, num_groups: int = 2) -> None:
        self.index = index
        self.run_id = uuid.uuid4().hex  # a restarted runner gets a new one (SEED's run_id)
        sizes = group_sizes(env_cfg.num_envs, num_groups)
        offsets = np.cumsum([0, *sizes])
        base = seed + index * env_cfg.num_envs
        self.envs = [make_vector_env(env_cfg, n, int(base + off)) for n, off in zip(sizes, offsets)]
        self.seeds = [int(base + off) for off in offsets[:-1]]
        # With episodic life a life loss terminates the env but the game goes on: the
        # tracker must know, or every life counts as an episode in the returns and counts.
        life = env_cfg.atari.episodic_life and is_atari(find_spec(env_cfg.id))
        self.trackers = [EpisodeTracker(n, episodic_life=life) for n in sizes]
        self.tally = StepTally()
        self.steps_done = 0  # group steps completed: the runner's heartbeat

    @property
    def num_groups(self) -> int:
        return len(self.envs)

    def reset(self, group: int) -> Request:
        obs, _ = self.envs[group].reset(seed=self.seeds[group])
        tracker = self.trackers[group]
        n = batch_len(obs)
        return self._request(
            group,
            obs,
            reward=np.zeros(n, np.float32),
            terminated=np.zeros(n, bool),
            truncated=np.zeros(n, bool),
            is_first=tracker.first.copy(),
            episodes=(np.zeros(0, np.float32), np.zeros(0, np.int64)),
            env_step_s=0.0,
        )

    def step(self, group: int, action: np.ndarray) -> Request:
        start = time.perf_counter()
        obs, reward, terminated, truncated, info = self.envs[group].step(action)
        elapsed = time.perf_counter() - start
        self.steps_done += 1
        tracker = self.trackers[group]
        episodes = tracker.update(reward, terminated, truncated, info)
        return self._request(
            group,
            obs,
            reward=np.asarray(reward, np.float32),
            terminated=np.asarray(terminated, bool),
            truncated=np.asarray(truncated, bool),
            is_first=tracker.first.copy(),
            episodes=episodes,
            env_step_s=elapsed,
        )

    def _request(
        self,
        group: int,
        obs: np.ndarray,
        *,
        episodes: tuple[np.ndarray, np.ndarray],
        env_step_s: float,
        **fields: Any,
    ) -> Request:
        self.tally.add(fields["is_first"], episodes, env_step_s)
        return {"key": (self.index, group), "run_id": self.run_id, "obs": obs, **fields}

    def close(self) -> None:
        for env in self.envs:
            env.close()
