"""The in-process reader: the same reads as the Ray reader, on prefetching threads. Used in
DataLoader worker processes (which cannot host a Ray driver), without a cluster, and in tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from ..plan.table import TableRef
from .ahead import Held, ahead
from .concurrency import take_streams, usable_cores
from .convert import to_columns
from .documents import DocumentReads
from .items import note_objects
from .malloc import keep_freed_buffers
from .requests import ChunkRequest, ChunkResult, ReadCost, ReadSizing, span_results
from .take import one_batch, take_sorted
from .transform import TransformPolicy


class LocalReader:
    """Reads chunks in this process, ``prefetch`` chunks ahead on background threads, and no
    more than ``sizing.budget_bytes`` of them (``held`` counts what it holds).

    With ``as_tensors`` (and no transform) each chunk is converted to ``Columns`` there too,
    the reordering to plan order folded into the one copy the conversion makes anyway; with
    ``documents`` (packed views) it is arranged by split there.
    Reads run on as many threads as :func:`~lance_ray.read.concurrency.take_streams` gives
    for this process's share of the cores (``processes`` readers share them, e.g.
    DataLoader workers) and the byte budget, and are prefetched at least that deep; a
    transform runs on ``transform_threads`` threads (default one: user code need not be
    thread-safe).
    """

    def __init__(self, table: TableRef, columns: list[str] | None,
                 transform: TransformPolicy | None, *, as_tensors: bool = False,
                 prefetch: int = 2, transform_threads: int | None = None,
                 sizing: ReadSizing | None = None, documents: DocumentReads | None = None,
                 processes: int = 1):
        self.table, self.columns, self.transform = table, columns, transform
        self.as_tensors, self.prefetch = as_tensors, prefetch
        self.documents = documents
        self.transform_threads = transform_threads or 1
        self.sizing = sizing
        self.processes = processes
        self.held = Held()

    def _read(self, req: ChunkRequest) -> list[ChunkResult]:
        payload: Any
        started = time.perf_counter()
        row_bytes = None if self.sizing is None else self.sizing.row_bytes
        rows, inverse = take_sorted(self.table, req.row_ids, self.columns, row_bytes)
        read = time.perf_counter()
        if self.documents is not None:
            payload = self.documents.arrange(rows, inverse, req)
        elif self.as_tensors and self.transform is None:
            payload = to_columns(rows, inverse)
        else:
            payload = one_batch(rows if inverse is None else rows.take(pa.array(inverse)))
            if self.transform is not None:
                payload, why = self.transform.columns(payload)
                note_objects(why)
        cost = ReadCost(rows.nbytes, read - started, time.perf_counter() - read)
        return span_results(req.spans, payload, cost)

    def iter_chunks(self, requests: Iterator[ChunkRequest]) -> Iterator[ChunkResult]:
        keep_freed_buffers()
        sizing = self.sizing
        cost = None if sizing is None else (lambda r: sizing.nbytes(len(r.row_ids)))
        budget = None if sizing is None else sizing.budget_bytes
        threads, depth = self.transform_threads, self.prefetch
        if self.transform is None:
            read_bytes = None if sizing is None else sizing.nbytes(sizing.steady_rows)
            threads = take_streams(max(1, usable_cores() // self.processes), read_bytes, budget)
            depth = max(depth, threads)  # the byte budget still bounds what is held
        for results in ahead(self._read, requests, depth, threads, cost=cost,
                             budget=budget, held=self.held):
            yield from results

