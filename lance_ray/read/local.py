"""The in-process reader: the same reads as the Ray reader, on prefetching threads. Used in
DataLoader worker processes (which cannot host a Ray driver), without a cluster, and in tests."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow as pa

from ..plan.table import TableRef
from .convert import to_columns
from .items import note_objects
from .requests import ChunkRequest, ChunkResult, ReadCost, span_results
from .take import take_sorted
from .transform import TransformPolicy

T = TypeVar("T")


def ahead(fn: Callable[[Any], T], items: Iterable[Any], depth: int, threads: int = 1
          ) -> Iterator[T]:
    """``fn(item)`` for each item in order, computed up to ``depth`` items ahead on
    ``threads`` background threads (Lance, Arrow, numpy and torch release the GIL)."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix="lance_ray_read")
    try:
        pending: deque[Future[T]] = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) > depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        # An abandoned generator may be finalised by the garbage collector on one of the
        # pool's own threads, which cannot join itself.
        own = threading.current_thread() in getattr(pool, "_threads", ())
        pool.shutdown(wait=not own, cancel_futures=True)


class LocalReader:
    """Reads chunks in this process, ``prefetch`` chunks ahead on background threads.

    With ``as_tensors`` (and no transform) each chunk is converted to ``Columns`` there too,
    the reordering to plan order folded into the one copy the conversion makes anyway.
    Two reads run at once (two takes of clumped rows measured 1.5x one), but a transform
    runs on ``transform_threads`` threads (default one: user code need not be thread-safe).
    """

    def __init__(self, table: TableRef, columns: list[str] | None,
                 transform: TransformPolicy | None, *, as_tensors: bool = False,
                 prefetch: int = 2, transform_threads: int | None = None):
        self.table, self.columns, self.transform = table, columns, transform
        self.as_tensors, self.prefetch = as_tensors, prefetch
        self.transform_threads = transform_threads or 1

    def _read(self, req: ChunkRequest) -> list[ChunkResult]:
        payload: Any
        started = time.perf_counter()
        batch, inverse = take_sorted(self.table, req.row_ids, self.columns)
        read = time.perf_counter()
        if self.as_tensors and self.transform is None:
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
        for results in ahead(self._read, requests, self.prefetch, threads):
            yield from results

