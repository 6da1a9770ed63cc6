"""Plans built ahead of need: the next epoch's plan is built on a background thread.

``BackgroundPlans`` is a small keyed cache of builds. ``get`` returns a key's value, waiting
for its background build if one is running (or building it on the caller's thread if none
is); ``prefetch`` starts a build on a thread and returns at once. A failed build is
forgotten once ``get`` has raised its error, so asking again retries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Background builds in a process run one at a time: each has a whole epoch to finish, and
# several at once (a mixture's sources) would take the cores from the reads they run beside.
_ONE_BUILD_AT_A_TIME = threading.Lock()


class BackgroundPlans(Generic[K, V]):
    """Builds ``build(key)`` once per key, on demand or ahead of time; keeps ``keep`` keys."""

    def __init__(self, build: Callable[[K], V], *, keep: int = 2, name: str = "plan"):
        self._build, self._keep, self._name = build, keep, name
        self._lock = threading.Lock()
        self._futures: OrderedDict[K, Future[V]] = OrderedDict()
        self.builds = 0  # builds started (on demand or in the background)
        self.background_hits = 0  # gets answered by a build that prefetch started

    def _claim(self, key: K, *, background: bool) -> tuple[Future[V], bool]:
        """The future of ``key`` and whether the caller must run its build."""
        with self._lock:
            fut = self._futures.get(key)
            if fut is not None:
                self._futures.move_to_end(key)
                if not background and getattr(fut, "prefetched", False):
                    self.background_hits += 1
                return fut, False
            fut = Future()
            fut.prefetched = background  # type: ignore[attr-defined]
            self._futures[key] = fut
            self.builds += 1
            while len(self._futures) > self._keep:
                self._futures.popitem(last=False)
            return fut, True

    def _run(self, key: K, fut: Future[V]) -> None:
        started = time.monotonic()
        try:
            fut.set_result(self._build(key))
        except BaseException as e:  # handed to whoever gets this key
            fut.set_exception(e)
        else:
            logger.info("%s %s built in %.2fs", self._name, key, time.monotonic() - started)

    def get(self, key: K) -> V:
        """The value of ``key``, built now unless a (background) build already has it."""
        fut, mine = self._claim(key, background=False)
        if mine:
            self._run(key, fut)
        try:
            return fut.result()
        except BaseException:
            with self._lock:
                if self._futures.get(key) is fut:
                    del self._futures[key]
            raise

    def prefetch(self, key: K) -> None:
        """Start building ``key`` on a thread unless it is built or being built.

        Not a daemon thread: the interpreter waits for it at exit, because a Lance scan cut
        off by interpreter shutdown aborts the process (measured: exit code 134).
        """
        fut, mine = self._claim(key, background=True)
        if mine:
            threading.Thread(target=self._run_in_background, args=(key, fut),
                             name=f"lance_ray-{self._name}-prefetch").start()

    def _run_in_background(self, key: K, fut: Future[V]) -> None:
        with _ONE_BUILD_AT_A_TIME:
            self._run(key, fut)

    def ready(self, key: K) -> V | None:
        """The value of ``key`` if its build has finished successfully, else None."""
        with self._lock:
            fut = self._futures.get(key)
        if fut is None or not fut.done() or fut.exception() is not None:
            return None
        return fut.result()

    def wait(self, key: K, timeout: float | None = None) -> bool:
        """Wait until a started build of ``key`` finishes; False if none was started."""
        with self._lock:
            fut = self._futures.get(key)
        if fut is None:
            return False
        fut.exception(timeout)
        return True
