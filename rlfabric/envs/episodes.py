"""Episode returns and lengths for N envs under NEXT_STEP autoreset, in numpy.

Under NEXT_STEP autoreset (see ``factory.py``) the step after a done is not part of any
episode: it only swaps in the reset observation, with reward 0 and its action ignored. The
tracker therefore counts a step only where the previous step was not done, and ``first``
marks the reset observations that such a step returns (and every observation of
``envs.reset()``): where a recurrent state starts afresh.

With DeepMind's episodic life (``AtariConfig.episodic_life``) an env is *terminated* at each
life loss while the game goes on; what we report is the whole game, as in published Atari
scores. A life loss is a termination with ``info["lives"] > 0``. ALE may still restart the
game right after it (the game ended with lives left, or hit the frame limit), which the step
after shows by ``info["episode_frame_number"]`` dropping: the game is then reported one step
late, at that reset step.

Returns are sums of the env's own rewards: with ``env.wrappers`` the reward each env gave
before the user's wrappers, which ``info["rlfabric_env_reward"]`` carries (``wrappers.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rlfabric.envs.wrappers import env_rewards


class EpisodeTracker:
    """Running return and length (agent steps) of the current episode of each env.

    Call :meth:`reset` after ``envs.reset()`` and :meth:`update` after every ``envs.step()``.
    """

    def __init__(self, num_envs: int, episodic_life: bool = False) -> None:
        self.num_envs = num_envs
        self.episodic_life = episodic_life
        self._returns = np.zeros(num_envs, dtype=np.float64)
        self._lengths = np.zeros(num_envs, dtype=np.int64)
        self._first = np.ones(num_envs, dtype=bool)
        # Where the last step was done, so the next step is an autoreset step. Unlike
        # `first`, False after reset(): the step from a reset() observation is a real one.
        self._autoreset = np.zeros(num_envs, dtype=bool)
        # Episodic life: envs whose last done was a life loss, and the game's frame count then.
        self._life_lost = np.zeros(num_envs, dtype=bool)
        self._frame_at_life_loss = np.zeros(num_envs, dtype=np.int64)
        self.ended = np.zeros(num_envs, dtype=bool)
        """bool [N]: the envs whose episode the last `update` ended (its returns' order)."""

    @property
    def first(self) -> np.ndarray:
        """bool [N]: the most recent observation is the first of an episode (a reset obs).

        All True after :meth:`reset`; after :meth:`update`, True exactly where the step
        before was done (terminated or truncated, life losses included): under NEXT_STEP
        autoreset the step after a done is the one that returns the reset observation.
        """
        return self._first.copy()

    def reset(self) -> None:
        """Start fresh episodes in every env (after ``envs.reset()``)."""
        self._returns[:] = 0.0
        self._lengths[:] = 0
        self._first[:] = True
        self._autoreset[:] = False
        self._life_lost[:] = False

    def update(
        self,
        reward: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        info: Mapping[str, Any] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Account one vector step; return (returns, lengths) of the episodes it ended.

        Both arrays have one entry per ended episode (float64 and int64; empty if none).
        ``info`` gives the env's own rewards where the user's wrappers changed them
        (``rlfabric_env_reward``) and, with ``episodic_life``, ``lives`` and
        ``episode_frame_number``.
        """
        counted = ~self._autoreset
        self._returns += np.where(counted, env_rewards(reward, info), 0.0)
        self._lengths += counted
        done = (terminated | truncated) & counted
        ended = done
        if self.episodic_life:
            if info is None or not {"lives", "episode_frame_number"} <= info.keys():
                raise ValueError("episodic_life needs info 'lives' and 'episode_frame_number'")
            frame = np.asarray(info["episode_frame_number"])
            # A game thought to go on after a life loss was restarted after all.
            restarted = self._life_lost & self._autoreset & (frame < self._frame_at_life_loss)
            life_lost = terminated & ~truncated & counted & (np.asarray(info["lives"]) > 0)
            ended = (done & ~life_lost) | restarted
            self._life_lost = life_lost
            self._frame_at_life_loss = np.where(life_lost, frame, self._frame_at_life_loss)
        self.ended = ended
        returns, lengths = self._returns[ended], self._lengths[ended]
        self._returns[ended] = 0.0
        self._lengths[ended] = 0
        self._first = self._autoreset
        self._autoreset = np.asarray(terminated | truncated, dtype=bool)
        return returns, lengths
