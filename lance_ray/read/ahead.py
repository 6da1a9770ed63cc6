"""Work done ahead of its consumer: ``fn(item)`` for each item, in order, on background
threads, each result handed over as soon as it (and every earlier one) is done.

The items are pulled on a producer thread of their own, so a slow or blocking source (Ray
Data blocks arriving from a pipeline) never holds back a result already computed: the
consumer waits only for the result it asks for, never for more items to arrive.
``Started`` begins computing an iterator's first item at once, on a thread of its own.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
THREAD_PREFIX = "lance_ray_read"
_END = object()  # the items ran out


@dataclass
class Held:
    """Bytes a reader holds ahead of its consumer: reads submitted, running or done but not
    yet handed over (estimated from the request's rows), and the most it ever held."""

    nbytes: int = 0
    peak: int = 0

    def add(self, nbytes: int) -> None:
        self.nbytes += nbytes
        self.peak = max(self.peak, self.nbytes)


@dataclass
class _Handover(Generic[T]):
    """What the producer and the consumer of one ``ahead`` share, guarded by ``lock``."""

    fn: Callable[[Any], T]
    pool: ThreadPoolExecutor
    depth: int
    budget: int | None
    held: Held
    lock: threading.Condition = field(default_factory=threading.Condition)
    staged: tuple[Any, int] | None = None  # an item pulled, waiting for room, and its bytes
    ready: deque[tuple[Future[T], int]] = field(default_factory=deque)  # submitted, not taken
    asked: int = 0  # results the consumer has asked for
    submitted: int = 0
    owed: int = 0  # items submitted and not yet handed over
    owed_bytes: int = 0
    finished: bool = False  # the producer is done: items ran out, raised, or it was stopped
    error: BaseException | None = None  # what the items raised, after the last result
    stopped: bool = False  # the consumer is gone

    def advance(self) -> None:
        """Submit the staged item if it may go now: at most ``depth`` beyond the results
        asked for, and within the budget (one item always allowed)."""
        if self.staged is None or self.stopped or self.submitted >= self.asked + self.depth:
            return
        item, nbytes = self.staged
        if self.owed and self.budget is not None and self.held.nbytes + nbytes > self.budget:
            return
        self.staged = None
        self.ready.append((self.pool.submit(self.fn, item), nbytes))
        self.submitted += 1
        self.owed += 1
        self.owed_bytes += nbytes
        self.held.add(nbytes)
        self.lock.notify_all()

    def handed(self, nbytes: int) -> None:
        self.owed -= 1
        self.owed_bytes -= nbytes
        self.held.add(-nbytes)
        self.advance()
        self.lock.notify_all()


def _produce(items: Iterable[Any], share: _Handover[T], cost: Callable[[Any], int] | None
             ) -> None:
    """Pull ``items`` (on this thread only), staging each until it may be submitted; stop
    when the consumer is gone."""
    lock = share.lock
    try:
        it = iter(items)
        while True:
            item = next(it, _END)
            if item is _END:
                return
            nbytes = cost(item) if cost is not None else 0
            with lock:
                if share.stopped:
                    return
                share.staged = (item, nbytes)
                # Submitted here if there is room, else by the consumer when it asks for a
                # result or hands one over: instant items then cost no wait for this thread.
                share.advance()
                lock.wait_for(lambda: share.staged is None or share.stopped)
                if share.stopped:
                    return
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer, in its place
        share.error = e
    finally:
        with lock:
            share.finished = True
            lock.notify_all()


def ahead(fn: Callable[[Any], T], items: Iterable[Any], depth: int, threads: int = 1, *,
          cost: Callable[[Any], int] | None = None, budget: int | None = None,
          held: Held | None = None) -> Generator[T, None, None]:
    """``fn(item)`` for each item in order, computed up to ``depth`` items ahead on
    ``threads`` background threads (Lance, Arrow, numpy and torch release the GIL), each
    handed over as soon as it and every earlier one is done.

    ``items`` is iterated on one producer thread (never two threads at once), at most one
    item beyond the ``depth`` submitted ahead of the consumer: that item waits, pulled, for
    room, and the consumer submits it as it asks for a result, so instant items wait for no
    thread hand-off. With ``cost`` (an item's
    bytes) and ``budget``, an item is submitted only while the items held stay within
    ``budget`` bytes (one item is always allowed, however large); ``held`` counts them.
    An exception from ``fn`` is raised in place of its result, one from ``items`` after the
    results of the items before it.

    Closing the generator stops the producer and waits for it to leave a ``next(items)``
    in progress (so the caller may close ``items`` afterwards) and for the ``fn`` calls
    running; items not yet submitted are never pulled.
    """
    pool = ThreadPoolExecutor(threads, thread_name_prefix=THREAD_PREFIX)
    share: _Handover[T] = _Handover(fn, pool, max(depth, 0), budget,
                                    held if held is not None else Held())
    lock = share.lock
    # Daemon: a generator never closed nor collected must not keep the interpreter from
    # exiting (its producer waits for a consumer that is gone).
    producer = threading.Thread(target=_produce, name=f"{THREAD_PREFIX}_items", daemon=True,
                                args=(items, share, cost))
    try:
        producer.start()
        while True:
            with lock:
                share.asked += 1
                share.advance()
                lock.wait_for(lambda: share.ready or share.finished)
                if not share.ready:
                    if share.error is not None:
                        raise share.error
                    return
                future, nbytes = share.ready.popleft()
            result = future.result()
            with lock:
                share.handed(nbytes)
            yield result
    finally:
        with lock:
            share.stopped = True
            lock.notify_all()
        me = threading.current_thread()
        if producer is not me and producer.ident is not None:
            producer.join()
        # An abandoned generator may be finalised by the garbage collector on one of the
        # pool's own threads, which cannot join itself.
        own = me in getattr(pool, "_threads", ())
        pool.shutdown(wait=not own, cancel_futures=True)
        with lock:  # what was never handed over is no longer held
            share.held.add(-share.owed_bytes)
            share.owed_bytes = share.owed = 0


class Started(Iterator[T]):
    """``items`` whose first item is already being computed on a background thread, so a
    slow start (a Ray Data pipeline's) overlaps with the caller's own work. ``close()``
    waits for that first item, then closes ``items``."""

    def __init__(self, items: Iterator[T]):
        self._items = items
        self._first: list[tuple[bool, Any]] = []
        # Waited on instead of joining the thread: a join that Ctrl-C interrupts leaves the
        # thread looking finished (CPython 3.11) while it is still in next(items), and
        # closing the items then fails ("generator already executing").
        self._done = threading.Event()
        self._waiting = True
        threading.Thread(target=self._start, name="lance_ray_start", daemon=True).start()

    def _start(self) -> None:
        try:
            self._first.append((True, next(self._items)))
        except BaseException as exc:  # StopIteration included: handed to the consumer
            self._first.append((False, exc))
        finally:
            self._done.set()

    def __next__(self) -> T:
        if not self._waiting:
            return next(self._items)
        self._done.wait()
        self._waiting = False
        ok, value = self._first.pop()
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._waiting:
            self._done.wait()
            self._waiting = False
        close = getattr(self._items, "close", None)
        if close is not None:
            close()
