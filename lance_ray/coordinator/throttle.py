"""Run an action at most every so often, without ever dropping the last request."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager


class Throttled:
    """Runs ``action`` at once if it last ran ``every_s`` ago or more; otherwise once, when
    that interval is over (so the latest request is served at most ``every_s`` late).

    ``lock`` is held while ``action`` runs from the timer; callers of :meth:`request` hold
    it already (it should be re-entrant).
    """

    def __init__(self, action: Callable[[], None], every_s: float,
                 lock: AbstractContextManager[object],
                 clock: Callable[[], float] = time.monotonic):
        self._action, self._every_s, self._lock, self._clock = action, every_s, lock, clock
        self._last = float("-inf")
        self._timer: threading.Timer | None = None

    def request(self) -> None:
        wait = self._last + self._every_s - self._clock()
        if wait <= 0:
            self._run()
        elif self._timer is None:
            self._timer = threading.Timer(wait, self._late)
            self._timer.daemon = True
            self._timer.start()

    def _late(self) -> None:
        with self._lock:
            self._timer = None
            self._run()

    def _run(self) -> None:
        self._action()
        self._last = self._clock()
