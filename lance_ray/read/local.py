"""The in-process reader: the same reads as the Ray reader, on prefetching threads. Used in
DataLoader worker processes (which cannot host a Ray driver), without a cluster, and in tests."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa

from ..plan.table import TableRef
from .convert import to_columns
from .documents import DocumentReads
from .items import note_objects
from .requests import ChunkRequest, ChunkResult, ReadCost, ReadSizing, span_results
from .take import take_sorted
from .transform import TransformPolicy

T = TypeVar("T")


@dataclass
class Held:
    """Bytes a reader holds ahead of its consumer: reads submitted, running or done but not
    yet handed over (estimated from the request's rows), and the most it ever held."""

    nbytes: int = 0
    peak: int = 0

    def add(self, nbytes: int) -> None:
        self.nbytes += nbytes
        self.peak = max(self.peak, self.nbytes)


def ahead(fn: Callable[[Any], T], items: Iterable[Any], depth: int, threads: int = 1, *,
          cost: Callable[[Any], int] | None = None, budget: int | None = None,
          held: Held | None = None) -> Iterator[T]:
    """``fn(item)`` for each item in order, computed up to ``depth`` items ahead on
    ``threads`` background threads (Lance, Arrow, numpy and torch release the GIL).

    With ``cost`` (an item's bytes) and ``budget``, an item is submitted only while the
    items held stay within ``budget`` bytes (one item is always allowed, however large).
    """
    pool = ThreadPoolExecutor(threads, thread_name_prefix="lance_ray_read")
    held = held if held is not None else Held()
    try:
        pending: deque[tuple[Future[T], int]] = deque()

        def handed() -> T:
            future, nbytes = pending.popleft()
            result = future.result()
            held.add(-nbytes)
            return result

        for item in items:
            nbytes = cost(item) if cost is not None else 0
            while pending and budget is not None and held.nbytes + nbytes > budget:
                yield handed()
            pending.append((pool.submit(fn, item), nbytes))
            held.add(nbytes)
            if len(pending) > depth:
                yield handed()
        while pending:
            yield handed()
    finally:
        # An abandoned generator may be finalised by the garbage collector on one of the
        # pool's own threads, which cannot join itself.
        own = threading.current_thread() in getattr(pool, "_threads", ())
        pool.shutdown(wait=not own, cancel_futures=True)


class Started(Iterator[T]):
    """``items`` whose first item is already being computed on a background thread, so a
    slow start (a Ray Data pipeline's) overlaps with the caller's own work. ``close()``
    waits for that first item, then closes ``items``."""

    def __init__(self, items: Iterator[T]):
        self._items = items
        self._first: list[tuple[bool, Any]] = []
        self._thread: threading.Thread | None = threading.Thread(
            target=self._start, name="lance_ray_start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            self._first.append((True, next(self._items)))
        except BaseException as exc:  # StopIteration included: handed to the consumer
            self._first.append((False, exc))

    def __next__(self) -> T:
        if self._thread is None:
            return next(self._items)
        self._thread.join()
        self._thread = None
        ok, value = self._first.pop()
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        close = getattr(self._items, "close", None)
        if close is not None:
            close()


class LocalReader:
    """Reads chunks in this process, ``prefetch`` chunks ahead on background threads, and no
    more than ``sizing.budget_bytes`` of them (``held`` counts what it holds).

    With ``as_tensors`` (and no transform) each chunk is converted to ``Columns`` there too,
    the reordering to plan order folded into the one copy the conversion makes anyway; with
    ``documents`` (packed views) it is arranged by split there.
    Two reads run at once (two takes of clumped rows measured 1.5x one), but a transform
    runs on ``transform_threads`` threads (default one: user code need not be thread-safe).
    """

    def __init__(self, table: TableRef, columns: list[str] | None,
                 transform: TransformPolicy | None, *, as_tensors: bool = False,
                 prefetch: int = 2, transform_threads: int | None = None,
                 sizing: ReadSizing | None = None, documents: DocumentReads | None = None):
        self.table, self.columns, self.transform = table, columns, transform
        self.as_tensors, self.prefetch = as_tensors, prefetch
        self.documents = documents
        self.transform_threads = transform_threads or 1
        self.sizing = sizing
        self.held = Held()

    def _read(self, req: ChunkRequest) -> list[ChunkResult]:
        payload: Any
        started = time.perf_counter()
        batch, inverse = take_sorted(self.table, req.row_ids, self.columns)
        read = time.perf_counter()
        if self.documents is not None:
            payload = self.documents.arrange(batch, inverse, req)
        elif self.as_tensors and self.transform is None:
            payload = to_columns(batch, inverse)
        else:
            payload = batch if inverse is None else batch.take(pa.array(inverse))
            if self.transform is not None:
                payload, why = self.transform.columns(payload)
                note_objects(why)
        cost = ReadCost(batch.nbytes, read - started, time.perf_counter() - read)
        return span_results(req.spans, payload, cost)

    def iter_chunks(self, requests: Iterator[ChunkRequest]) -> Iterator[ChunkResult]:
        threads = self.transform_threads if self.transform is not None else 2
        sizing = self.sizing
        cost = None if sizing is None else (lambda r: sizing.nbytes(len(r.row_ids)))
        budget = None if sizing is None else sizing.budget_bytes
        for results in ahead(self._read, requests, self.prefetch, threads, cost=cost,
                             budget=budget, held=self.held):
            yield from results

