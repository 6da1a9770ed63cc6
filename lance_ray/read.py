"""Reading planned rows: one take per chunk, sorted by row address, returned in plan order.

Two readers share the same read function and the same output (an ordered stream of
``Chunk`` results):

* ``RayDataReader`` (the default): an order-preserving Ray Data pipeline. A custom
  ``Datasource`` turns each chunk into one read task; the user's transform runs as a
  ``map_batches`` stage in Ray tasks; the streaming executor gives prefetch and
  backpressure, and read tasks can run on any node of the cluster.
* ``LocalReader``: the same work in-process on prefetching threads, used inside
  DataLoader worker processes (which cannot host a Ray driver) and for fast unit tests.

Reads grow from ``FIRST_READ_ROWS`` to the view's read size, and for the tensor batch path
each read is converted to ``convert.Columns`` once, off the consumer's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from .convert import to_columns
from .stats import NO_COST, ReadCost
from .table import TableRef
from .transform import TransformPolicy, portable_items

logger = logging.getLogger(__name__)

SEQ_COLUMN = "__lance_ray_seq"
ITEM_COLUMN = "__lance_ray_item"
# A read's cost rides on its first row (zeros elsewhere), so any cut of a block sums right.
COST_COLUMNS = ("__lance_ray_bytes", "__lance_ray_fetch_s", "__lance_ray_transform_s")
INTERNAL_COLUMNS = (SEQ_COLUMN, *COST_COLUMNS)
T = TypeVar("T")
FIRST_READ_ROWS = 4096


@dataclass(frozen=True)
class ChunkRequest:
    """The rows of samples ``spans`` (``(lo, hi)`` ranges of a rank's remaining sequence,
    ascending), read with one take. Several spans when a DataLoader worker packs the
    batches it makes (every k-th one) into one read."""

    spans: tuple[tuple[int, int], ...]
    row_ids: np.ndarray


@dataclass
class ChunkResult:
    """The rows of one request, in request order: a ``pyarrow.RecordBatch``, ``Columns``
    (tensors) or a list of transformed items."""

    seq: int
    payload: Any
    cost: ReadCost = NO_COST

    def __len__(self) -> int:
        return len(self.payload)


def take_sorted(
    table: TableRef, row_ids: np.ndarray, columns: list[str] | None
) -> tuple[pa.RecordBatch, np.ndarray | None]:
    """Read ``row_ids`` at the pinned version in ascending address order.

    Returns the rows and the permutation that puts them back in the given order (None when
    they already are). Sorting makes one take touch each fragment once with ascending
    offsets, the coalesced access Lance reads fastest.
    """
    ids = np.asarray(row_ids, dtype=np.uint64)
    order = None if bool(np.all(ids[1:] > ids[:-1])) else np.argsort(ids, kind="stable")
    wanted = ids if order is None else ids[order]
    got = table.take_rows(wanted, columns)
    if got.num_rows != len(ids):
        raise RuntimeError(
            f"Lance returned {got.num_rows} rows for {len(ids)} planned row ids at version "
            f"{table.version}; the pinned version no longer holds the planned rows"
        )
    batch = got.combine_chunks().to_batches()[0] if got.num_rows else pa.RecordBatch.from_pylist(
        [], schema=got.schema)
    if order is None:
        return batch, None
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return batch, inverse


def take_in_order(
    table: TableRef, row_ids: np.ndarray, columns: list[str] | None
) -> pa.RecordBatch:
    """Read ``row_ids`` at the pinned version and return them in the given order."""
    batch, inverse = take_sorted(table, row_ids, columns)
    return batch if inverse is None else batch.take(pa.array(inverse))


def span_results(spans: Sequence[tuple[int, int]], payload: Any, cost: ReadCost = NO_COST
                 ) -> list[ChunkResult]:
    """One result per span, cut from the rows read for all of them (in span order); the
    read's cost is booked with the first."""
    if len(spans) == 1:
        return [ChunkResult(spans[0][0], payload, cost)]
    out: list[ChunkResult] = []
    offset = 0
    for lo, hi in spans:
        out.append(ChunkResult(lo, payload[offset : offset + hi - lo], NO_COST if out else cost))
        offset += hi - lo
    return out


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
                payload = self.transform(payload)
        cost = ReadCost(batch.nbytes, read - started, time.perf_counter() - read)
        return span_results(req.spans, payload, cost)

    def iter_chunks(self, requests: Iterator[ChunkRequest]) -> Iterator[ChunkResult]:
        threads = self.transform_threads if self.transform is not None else 2
        for results in ahead(self._read, requests, self.prefetch, threads):
            yield from results


def _datasource_cls() -> type:
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class PlannedTakeDatasource(Datasource):
        """One read task per planned chunk; each task returns its rows in plan order."""

        def __init__(self, table: TableRef, columns: list[str] | None, chunks: list[ChunkRequest]):
            self._table, self._columns, self._chunks = table, columns, chunks

        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                           data_context: Any = None) -> list[ReadTask]:
            # The plan, not Ray's parallelism hint, decides the tasks: one chunk each.
            return [self._task(c) for c in self._chunks]

        def _task(self, chunk: ChunkRequest) -> ReadTask:
            table, columns = self._table, self._columns

            def read() -> Iterator[pa.Table]:
                started = time.perf_counter()
                batch = take_in_order(table, chunk.row_ids, columns)
                seq = pa.array(np.concatenate([np.arange(lo, hi, dtype=np.int64)
                                               for lo, hi in chunk.spans]))
                out = pa.Table.from_batches([batch]).append_column(SEQ_COLUMN, seq)
                cost = (batch.nbytes, time.perf_counter() - started, 0.0)
                for name, value in zip(COST_COLUMNS, cost):
                    out = out.append_column(name, _first_row(value, batch.num_rows))
                yield out

            meta = BlockMetadata(num_rows=len(chunk.row_ids), size_bytes=None,
                                 exec_stats=None, input_files=None)
            return ReadTask(read, meta)

    return PlannedTakeDatasource


class _TransformStage:
    """The ``map_batches`` function: user transform, items kept as an object column."""

    def __init__(self, transform: TransformPolicy):
        self.transform = transform

    def __call__(self, table: pa.Table) -> dict[str, np.ndarray]:
        data = table.drop_columns(list(INTERNAL_COLUMNS)).combine_chunks()
        batch = data.to_batches()[0] if data.num_rows else pa.RecordBatch.from_pylist(
            [], schema=data.schema)
        started = time.perf_counter()
        items = np.empty(batch.num_rows, dtype=object)
        # Failures travel as data (Ray would wrap a raised exception and lose its type).
        items[:] = portable_items(self.transform(batch))
        out = {ITEM_COLUMN: items, **{c: table.column(c).to_numpy() for c in INTERNAL_COLUMNS}}
        out[COST_COLUMNS[2]] = out[COST_COLUMNS[2]] + _first_row(
            time.perf_counter() - started, batch.num_rows).to_numpy()
        return out


class RayDataReader:
    """Reads chunks through an order-preserving Ray Data streaming pipeline.

    With ``as_tensors`` (and no transform) each arriving block is converted to ``Columns``
    on a background thread, so the consumer only slices.
    """

    def __init__(self, table: TableRef, columns: list[str] | None,
                 transform: TransformPolicy | None, *, as_tensors: bool = False,
                 prefetch_batches: int = 2, ray_remote_args: dict[str, Any] | None = None,
                 transform_tasks: int | None = None):
        self.table, self.columns, self.transform = table, columns, transform
        self.as_tensors = as_tensors
        self.prefetch_batches = prefetch_batches
        self.ray_remote_args = dict(ray_remote_args or {})
        self.transform_tasks = transform_tasks

    def dataset(self, requests: list[ChunkRequest]) -> Any:
        """The lazy Ray ``Dataset`` that yields ``requests`` in order."""
        import ray.data

        source = _datasource_cls()(self.table, self.columns, requests)
        ds = ray.data.read_datasource(source, override_num_blocks=max(1, len(requests)),
                                      **self.ray_remote_args)
        if self.transform is not None:
            from ray.data import TaskPoolStrategy

            ds = ds.map_batches(_TransformStage(self.transform), batch_format="pyarrow",
                                batch_size=None, zero_copy_batch=True,
                                compute=TaskPoolStrategy(size=self.transform_tasks))
        # Order is the product: never let Ray reorder blocks for throughput.
        ds.context.execution_options.preserve_order = True
        return ds

    def _chunk(self, block: pa.Table) -> list[ChunkResult]:
        seq = block.column(SEQ_COLUMN).to_numpy()
        cuts = np.flatnonzero(np.diff(seq) != 1) + 1
        spans = [(int(seq[a]), int(seq[b - 1]) + 1)
                 for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(seq)])]
        nbytes, fetch_s, transform_s = (block.column(c).to_numpy().sum() for c in COST_COLUMNS)
        started = time.perf_counter()
        payload: Any
        if self.transform is not None:
            payload = block.column(ITEM_COLUMN).to_pylist()
        else:
            data = block.drop_columns(list(INTERNAL_COLUMNS))
            payload = to_columns(data) if self.as_tensors else data.combine_chunks(
                ).to_batches()[0]
        convert_s = time.perf_counter() - started if self.transform is None else 0.0
        return span_results(spans, payload, ReadCost(int(nbytes), float(fetch_s),
                                                     float(transform_s) + convert_s))

    def iter_chunks(self, requests: Iterator[ChunkRequest]) -> Iterator[ChunkResult]:
        reqs = list(requests)
        if not reqs:
            return
        blocks = self.dataset(reqs).iter_batches(batch_size=None, batch_format="pyarrow",
                                                 prefetch_batches=self.prefetch_batches)
        for results in ahead(self._chunk, (b for b in blocks if b.num_rows),
                             self.prefetch_batches):
            yield from results


def _first_row(value: float, rows: int) -> pa.Array:
    """``value`` on the first of ``rows`` rows, zeros after it."""
    out = np.zeros(rows, dtype=np.float64)
    if rows:
        out[0] = value
    return pa.array(out)


def read_sizes(chunk_rows: int) -> Iterator[int]:
    """Rows of successive reads: from ``FIRST_READ_ROWS`` doubling to ``chunk_rows``. The
    first batch waits only for a small read; the steady state gets large reads, which Lance
    serves much faster per row (a take has a fixed cost, and denser row ids share pages)
    and Ray Data schedules with less overhead per row."""
    size = min(chunk_rows, FIRST_READ_ROWS)
    while True:
        yield size
        size = min(2 * size, chunk_rows)
