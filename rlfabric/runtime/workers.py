"""A resizable pool of threads that each run the same step in a loop.

GA3C's predictors and trainers are such pools, and its dynamic adjuster
changes their sizes at run time; the InferenceServer's batchers are one too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class ThreadPool:
    """`size` threads, each calling `step()` until the pool shrinks or stops.

    `step` must return within a fraction of a second (block with timeouts),
    so that a shrink or stop takes effect promptly. An exception in `step`
    stops that thread and is kept in `error` for the owner to raise.
    """

    def __init__(self, step: Callable[[], object], name: str) -> None:
        self.step = step
        self.name = name
        self.error: BaseException | None = None
        self._workers: list[tuple[threading.Thread, threading.Event]] = []
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self._workers)

    def resize(self, size: int) -> None:
        with self._lock:
            while len(self._workers) > size:
                _, stop = self._workers.pop()
                stop.set()
            while len(self._workers) < size:
                stop = threading.Event()
                thread = threading.Thread(
                    target=self._run,
                    args=(stop,),
                    name=f"{self.name}-{len(self._workers)}",
                    daemon=True,
                )
                self._workers.append((thread, stop))
                thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            workers, self._workers = self._workers, []
        for _, stop in workers:
            stop.set()
        for thread, _ in workers:
            thread.join(timeout)

    def _run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self.step()
        except BaseException as err:
            self.error = err
