"""Small pieces every way of iterating a view shares: the one-live-iterator lease, the
consumer's wait per batch, and the rows a view reads when failed rows drop (the rule of one
live iterator itself is kept by ``view/core.py``)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..read.requests import ReadCost
from ..stream.order import RankStream

T = TypeVar("T")
CONCURRENT = ("StreamingDataset does not support concurrent iteration: only one active "
              "iterator per dataset instance is allowed. Exhaust or close() the running "
              "iterator (or call load_state_dict()/set_epoch()) before starting another")
Survivor = tuple[int, int, Any, ReadCost]  # split, position, item, cost booked with it


def every_row(stream: RankStream) -> RankStream:
    """Every row not yet read of ``stream``'s splits: what a view reads when failed rows
    drop out (which rows survive is known only after their transform)."""
    return RankStream(stream.splits, stream.positions, stream.positions, stream.split_len)


Lease = list["weakref.ref[Iterator[Any]]"]


def timed(batches: Iterator[T]) -> Iterator[tuple[T, float]]:
    """Each batch with the time the consumer waited for it."""
    while True:
        started = time.monotonic()
        batch = next(batches, None)
        if batch is None:
            return
        yield batch, time.monotonic() - started


def leased(start: Callable[[Lease], Iterator[T]]) -> Iterator[T]:
    """The iterator ``start(lease)`` makes, with ``lease`` holding a weak reference to it:
    the generator checks, when it starts, that it is its dataset's one live iterator."""
    lease: Lease = []
    it = start(lease)
    lease.append(weakref.ref(it))
    return it
