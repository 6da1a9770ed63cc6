"""Coalesced progress reports: how a view's commits reach the coordinator.

A view commits a batch far more often than the coordinator needs to hear about it (a
thousand ranks each reporting every batch is more calls than one actor can answer). A
:class:`Reporter` buffers each committed step and sends the buffered steps as one
:class:`~lance_ray.state.ledger.ReportBatch`

* once ``every_batches`` steps are buffered, or the oldest has waited the policy's interval
  (checked at each commit and by one background thread per process, so a rank that stops
  between batches is still heard within the interval plus ``TICK_S``);
* at once at the end of an epoch;
* and, waiting for the coordinator's acknowledgement of every report sent so far, at a
  checkpoint (``flush(wait=True)``): a checkpoint never depends on a report in flight.

Reports sent since the last checkpoint are kept (at most ``PENDING_WINDOW`` steps: older
ones could not seal any more) until the coordinator has made them durable (``confirm``): a
coordinator that Ray restarted in between may have lost some it had acknowledged, and they
are sent again (``resend``; recording a report twice changes nothing).

Calls are fire and forget, with at most ``max_in_flight`` unanswered at a time (the next
send waits for the oldest: back-pressure, and a bound on what the actor queues per rank).
A failed call (e.g. a stale world size) is raised by the next ``add`` or ``flush``.
Every step is sent: coalescing changes how many calls carry the steps, never which steps
can seal.

The transport is a :class:`Channel`, so this module needs no Ray (the coordinator's
channel is a Ray actor handle).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..checks import positive_int
from .ledger import PENDING_WINDOW, RankReport, ReportBatch, columns_of

logger = logging.getLogger(__name__)

TICK_S = 0.05  # how often the background thread looks for buffers past their interval
# One actor answers on the order of a thousand calls a second on a small machine;
# time-triggered reports of all ranks together aim at half of that.
CALLS_PER_S = 500.0
MIN_EVERY_S = 0.5


@dataclass(frozen=True)
class ReportPolicy:
    """When a view sends its buffered progress to the coordinator.

    ``every_batches`` also bounds how many steps a view holds back, which must stay well
    under the ledger's ``PENDING_WINDOW``. ``every_s=None`` scales the interval with the
    world size: ``max(MIN_EVERY_S, world_size / CALLS_PER_S)`` seconds (0.5 s up to 250
    ranks, 2 s at 1,024), so the ranks' calls together stay within what one actor answers.
    """

    every_batches: int = 100
    every_s: float | None = None
    max_in_flight: int = 4

    def __post_init__(self) -> None:
        for name in ("every_batches", "max_in_flight"):
            value = getattr(self, name)
            positive_int(f"report {name}", value)
        if self.every_batches > PENDING_WINDOW // 2:
            raise ValueError(f"report every_batches must be at most {PENDING_WINDOW // 2} "
                             f"(half the coordinator's pending window), got {self.every_batches}")
        if self.every_s is not None and (isinstance(self.every_s, bool) or not isinstance(
                self.every_s, int | float) or not self.every_s > 0):
            raise ValueError(f"report every_s must be a positive number of seconds or None, "
                             f"got {self.every_s!r}")

    def interval_s(self, world_size: int) -> float:
        """Seconds the oldest buffered step may wait, for a run of ``world_size`` ranks."""
        if self.every_s is not None:
            return float(self.every_s)
        return max(MIN_EVERY_S, world_size / CALLS_PER_S)


class Channel(Protocol):
    """Where report batches go."""

    def send(self, batch: ReportBatch) -> Any:
        """Start sending ``batch``; returns a reply handle without waiting."""
        ...

    def finished(self, replies: list[Any]) -> list[Any]:
        """Those of ``replies`` that are answered (without waiting)."""
        ...

    def result(self, reply: Any) -> Any:
        """Wait for ``reply``; raises the error the call failed with."""
        ...


class Reporter:
    """Buffers one view's committed steps and sends them as coalesced report batches."""

    def __init__(self, channel: Channel, policy: ReportPolicy,
                 clock: Callable[[], float] = time.monotonic):
        self._channel, self._policy, self._clock = channel, policy, clock
        self._lock = threading.Lock()
        self._key: tuple[int, int, int] | None = None  # (rank, world_size, epoch) buffered
        self._steps: list[int] = []
        # Per-split progress lists of each buffered step: samples, positions (packed mode:
        # blocks, buffered).
        self._columns: tuple[list[Sequence[int]], ...] = ()
        self._oldest = 0.0  # when the oldest buffered step was added
        self._interval = policy.interval_s(1)
        self._in_flight: deque[Any] = deque()
        self._answered: list[Any] = []  # replies whose result the caller has not seen yet
        # Sent, not known durable (to resend), each with its number among the reports sent.
        self._unconfirmed: deque[tuple[int, ReportBatch]] = deque()
        self._sent = 0
        self.generation: int | None = None  # the coordinator's, when the view attached

    @property
    def buffered_steps(self) -> int:
        return len(self._steps)

    def add(self, report: RankReport, *, final: bool = False) -> None:
        """Buffer the rank's progress after its step; ``final``: the epoch ends here."""
        rank, world_size, epoch = report.rank, report.world_size, report.epoch
        progress = columns_of(report.samples, report.positions, report.blocks,
                              report.buffered)
        with self._lock:
            self._raise_answered()
            key = (rank, world_size, epoch)
            if self._steps and key != self._key:
                self._send(block=True)  # one batch carries one (rank, world size, epoch)
            if self._steps and len(progress) != len(self._columns):
                raise ValueError("a view reported packed and row progress to one reporter")
            if not self._steps:
                if key != self._key:
                    self._interval = self._policy.interval_s(world_size)
                self._key, self._oldest = key, self._clock()
                self._columns = tuple([] for _ in progress)
            self._steps.append(report.step)
            for column, values in zip(self._columns, progress):
                column.append(values)
            if len(self._steps) == 1:
                _TICKER.watch(self)  # after the append: the ticker forgets only empty buffers
            if final or len(self._steps) >= self._policy.every_batches or \
                    self._clock() - self._oldest >= self._interval:
                self._send(block=True)

    def flush(self, *, wait: bool = True) -> None:
        """Send what is buffered; with ``wait``, until the coordinator acknowledged every
        report sent so far (raising the error of any that failed)."""
        with self._lock:
            if self._steps:
                self._send(block=True)
            if wait:
                self._answered.extend(self._in_flight)
                self._in_flight.clear()
            self._raise_answered()

    @property
    def sent(self) -> int:
        """How many reports were sent so far (a mark for :meth:`confirm`)."""
        return self._sent

    def confirm(self, sent: int) -> None:
        """The first ``sent`` reports are durable at the coordinator (those sent before it
        was asked to make them so; one sent meanwhile by another thread may not be):
        forget them."""
        with self._lock:
            while self._unconfirmed and self._unconfirmed[0][0] < sent:
                self._unconfirmed.popleft()

    def resend(self) -> None:
        """Send every report not confirmed durable again, and wait for the coordinator to
        acknowledge them (raising the error of any it refused)."""
        with self._lock:
            for _, batch in self._unconfirmed:
                self._channel.result(self._channel.send(batch))

    def tick(self) -> bool:
        """Send the buffer if its oldest step is due (the background thread's call);
        returns whether anything is still buffered."""
        if not self._lock.acquire(blocking=False):
            return True  # the view is sending or flushing right now
        try:
            if self._steps and self._clock() - self._oldest >= self._interval:
                self._send(block=False)
            return bool(self._steps)
        finally:
            self._lock.release()

    def _send(self, *, block: bool) -> None:
        """Send the buffer (lock held). ``block``: the view's own thread, which raises the
        error of an answered call and waits for a free call slot; otherwise (the
        background thread) send only if a slot is free, and never raise."""
        if self._in_flight:
            done = self._channel.finished(list(self._in_flight))
            if done:
                self._answered.extend(done)
                self._in_flight = deque(r for r in self._in_flight if r not in done)
        if block:
            self._raise_answered()
        while len(self._in_flight) >= self._policy.max_in_flight:
            if not block:
                return
            self._channel.result(self._in_flight.popleft())  # waits: back-pressure
        assert self._key is not None
        rank, world_size, epoch = self._key
        batch = ReportBatch(rank, world_size, epoch, self._steps, *self._columns,
                            generation=self.generation)
        self._in_flight.append(self._channel.send(batch))
        self._unconfirmed.append((self._sent, batch))
        self._sent += 1
        kept = sum(len(b.steps) for _, b in self._unconfirmed)
        while kept - len(self._unconfirmed[0][1].steps) >= PENDING_WINDOW:
            kept -= len(self._unconfirmed.popleft()[1].steps)  # too old to seal if resent
        self._steps, self._columns = [], ()

    def _raise_answered(self) -> None:
        """Raise the error of an answered call, if one failed (caller's thread only)."""
        answered, self._answered = self._answered, []
        for reply in answered:
            self._channel.result(reply)


class _Ticker:
    """One daemon thread per process that sends buffers nobody else will send in time.

    It holds the reporters that have something buffered (strongly, so the last steps of a
    view that was just dropped still go out) and forgets each once its buffer is empty.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffered: set[Reporter] = set()
        self._thread: threading.Thread | None = None

    def watch(self, reporter: Reporter) -> None:
        with self._lock:
            self._buffered.add(reporter)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lance_ray-reports",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(TICK_S)
            with self._lock:
                reporters = list(self._buffered)
            for reporter in reporters:
                try:
                    if reporter.tick():
                        continue
                except Exception:  # Ray shut down, say: the view's own next call will tell
                    logger.warning("could not send buffered progress reports", exc_info=True)
                    with self._lock:
                        self._buffered.discard(reporter)
                    continue
                with self._lock:
                    if not reporter.buffered_steps:  # an add() may have just refilled it
                        self._buffered.discard(reporter)


_TICKER = _Ticker()
