"""GA3C's dynamic adjuster: a random walk over worker counts, kept only if it paid.

Babaeizadeh et al. 2017 (GA3C, arXiv 1611.06256), NVlabs/GA3C
`ThreadDynamicAdjustment.py`: every window (20 s there) each count moves by
-1, 0 or +1 within its bounds; after the window the change is kept if the
throughput measured over it did not drop below the last kept one, and
reverted otherwise. Here a "count" is an index into a list of allowed values,
so the same walk also tunes sizes that should move in powers of two.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

log = logging.getLogger(__name__)


class DynamicAdjuster:
    """Random-walk search over knobs; feed it one throughput figure per window."""

    def __init__(self, knobs: dict[str, Sequence[int]], start: dict[str, int], seed: int = 0):
        self.values = {name: list(values) for name, values in knobs.items()}
        self.index = {name: self.values[name].index(start[name]) for name in knobs}
        self.rng = random.Random(seed)
        self.baseline: float | None = None  # throughput of the last kept setting
        self._before: dict[str, int] | None = None  # setting before the change on trial
        self.decisions: list[str] = []

    @property
    def setting(self) -> dict[str, int]:
        return {name: self.values[name][i] for name, i in self.index.items()}

    def step(self, throughput: float) -> dict[str, int]:
        """Judge the window that just ended, then propose the setting for the next one."""
        if self._before is None or self.baseline is None or throughput >= self.baseline:
            if self._before is not None:
                self._decide(f"kept {self.setting} ({throughput:.1f} >= {self.baseline})")
            self.baseline = throughput
        else:
            tried = self.setting
            self.index = dict(self._before)
            self._decide(f"reverted {tried} ({throughput:.1f} < {self.baseline:.1f})")
        self._before = dict(self.index)
        for name, i in self.index.items():
            self.index[name] = min(
                max(i + self.rng.choice((-1, 0, 1)), 0), len(self.values[name]) - 1
            )
        return self.setting

    def _decide(self, text: str) -> None:
        self.decisions.append(text)
        log.info("dynamic adjuster: %s", text)
