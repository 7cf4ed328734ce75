"""Thread-safe accumulators for the per-interval throughput breakdown."""

from __future__ import annotations

import threading
from collections import defaultdict


class IntervalStats:
    """Means (and sums) of named values since the last `collect()`.

    Several threads (inference batcher, trainer, request handlers) add to one
    instance; the reporter collects once per interval, which resets it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sum: dict[str, float] = defaultdict(float)
        self._count: dict[str, int] = defaultdict(int)

    def add(self, key: str, value: float) -> None:
        with self._lock:
            self._sum[key] += value
            self._count[key] += 1

    def add_many(self, values: dict[str, float]) -> None:
        with self._lock:
            for key, value in values.items():
                self._sum[key] += value
                self._count[key] += 1

    def collect(self) -> tuple[dict[str, float], dict[str, float]]:
        """Return (means, sums) since the last call and start a new interval."""
        with self._lock:
            means = {k: self._sum[k] / self._count[k] for k in self._sum}
            sums = dict(self._sum)
            self._sum.clear()
            self._count.clear()
        return means, sums
