"""Reading planned rows: one take per chunk, sorted by row address, returned in plan order.

Two readers share the same read function and the same output (an ordered stream of
``Chunk`` results):

* ``RayDataReader`` (the default): an order-preserving Ray Data pipeline. A custom
  ``Datasource`` turns each chunk into one read task; the user's transform runs as a
  ``map_batches`` stage in Ray tasks; the streaming executor gives prefetch and
  backpressure, and read tasks can run on any node of the cluster.
* ``LocalReader``: the same work in-process with one prefetching thread, used inside
  DataLoader worker processes (which cannot host a Ray driver) and for fast unit tests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .table import TableRef
from .transform import TransformPolicy

logger = logging.getLogger(__name__)

SEQ_COLUMN = "__lance_ray_seq"
ITEM_COLUMN = "__lance_ray_item"



@dataclass(frozen=True)
class ChunkRequest:
    """Rows ``seq .. seq+len(row_ids)-1`` of a rank's remaining sequence."""

    seq: int
    row_ids: np.ndarray


@dataclass
class ChunkResult:
    """The rows of one request, in request order: Arrow data or transformed items."""

    seq: int
    data: pa.RecordBatch | None
    items: list[Any] | None

    def __len__(self) -> int:
        return len(self.items) if self.items is not None else self.data.num_rows  # type: ignore[union-attr]


def take_in_order(
    table: TableRef, row_ids: np.ndarray, columns: list[str] | None
) -> pa.RecordBatch:
    """Read ``row_ids`` at the pinned version and return them in the given order.

    Sorting first makes one take touch each fragment once with ascending offsets (the
    coalesced access Lance reads fastest); the inverse permutation restores plan order.
    """
    ids = np.asarray(row_ids, dtype=np.uint64)
    order = np.argsort(ids, kind="stable")
    got = table.open_lance()._take_rows(ids[order].tolist(), columns=columns)
    if got.num_rows != len(ids):
        raise RuntimeError(
            f"Lance returned {got.num_rows} rows for {len(ids)} planned row ids at version "
            f"{table.version}; the pinned version no longer holds the planned rows"
        )
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    out = got.take(pa.array(inverse))
    return out.combine_chunks().to_batches()[0] if out.num_rows else pa.RecordBatch.from_pylist(
        [], schema=out.schema
    )


class LocalReader:
    """Reads chunks in this process, one chunk ahead on a background thread."""

    def __init__(self, table: TableRef, columns: list[str] | None,
                 transform: TransformPolicy | None):
        self.table, self.columns, self.transform = table, columns, transform

    def _read(self, req: ChunkRequest) -> ChunkResult:
        batch = take_in_order(self.table, req.row_ids, self.columns)
        if self.transform is None:
            return ChunkResult(req.seq, batch, None)
        return ChunkResult(req.seq, None, self.transform(batch))

    def iter_chunks(self, requests: Iterator[ChunkRequest]) -> Iterator[ChunkResult]:
        with ThreadPoolExecutor(1, thread_name_prefix="lance_ray_read") as pool:
            pending = None
            for req in requests:
                nxt = pool.submit(self._read, req)
                if pending is not None:
                    yield pending.result()
                pending = nxt
            if pending is not None:
                yield pending.result()


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
                batch = take_in_order(table, chunk.row_ids, columns)
                seq = pa.array(np.arange(chunk.seq, chunk.seq + batch.num_rows, dtype=np.int64))
                yield pa.Table.from_batches([batch]).append_column(SEQ_COLUMN, seq)

            meta = BlockMetadata(num_rows=len(chunk.row_ids), size_bytes=None,
                                 exec_stats=None, input_files=None)
            return ReadTask(read, meta)

    return PlannedTakeDatasource


class _TransformStage:
    """The ``map_batches`` function: user transform, items kept as an object column."""

    def __init__(self, transform: TransformPolicy):
        self.transform = transform

    def __call__(self, table: pa.Table) -> dict[str, np.ndarray]:
        seq = table.column(SEQ_COLUMN).to_numpy()
        data = table.drop_columns([SEQ_COLUMN]).combine_chunks()
        batch = data.to_batches()[0] if data.num_rows else pa.RecordBatch.from_pylist(
            [], schema=data.schema)
        items = np.empty(batch.num_rows, dtype=object)
        items[:] = self.transform(batch)
        return {ITEM_COLUMN: items, SEQ_COLUMN: seq}


class RayDataReader:
    """Reads chunks through an order-preserving Ray Data streaming pipeline."""

    def __init__(self, table: TableRef, columns: list[str] | None,
                 transform: TransformPolicy | None, *, prefetch_batches: int = 2,
                 ray_remote_args: dict[str, Any] | None = None):
        self.table, self.columns, self.transform = table, columns, transform
        self.prefetch_batches = prefetch_batches
        self.ray_remote_args = dict(ray_remote_args or {})

    def dataset(self, requests: list[ChunkRequest]) -> Any:
        """The lazy Ray ``Dataset`` that yields ``requests`` in order."""
        import ray.data

        source = _datasource_cls()(self.table, self.columns, requests)
        ds = ray.data.read_datasource(source, override_num_blocks=max(1, len(requests)),
                                      **self.ray_remote_args)
        if self.transform is not None:
            ds = ds.map_batches(_TransformStage(self.transform), batch_format="pyarrow",
                                batch_size=None, zero_copy_batch=True)
        # Order is the product: never let Ray reorder blocks for throughput.
        ds.context.execution_options.preserve_order = True
        return ds

    def iter_chunks(self, requests: Iterator[ChunkRequest]) -> Iterator[ChunkResult]:
        reqs = list(requests)
        if not reqs:
            return
        ds = self.dataset(reqs)
        for block in ds.iter_batches(batch_size=None, batch_format="pyarrow",
                                     prefetch_batches=self.prefetch_batches):
            seq = block.column(SEQ_COLUMN)
            start = seq[0].as_py() if len(seq) else 0
            if self.transform is not None:
                items = block.column(ITEM_COLUMN).to_pylist()
                yield ChunkResult(start, None, items)
            else:
                data = block.drop_columns([SEQ_COLUMN]).combine_chunks()
                batch = data.to_batches()[0] if data.num_rows else None
                if batch is not None:
                    yield ChunkResult(start, batch, None)


def chunk_requests(row_ids: np.ndarray, start_seq: int, chunk_rows: int) -> Iterator[ChunkRequest]:
    """Cut a run of planned row ids into read chunks of ``chunk_rows``."""
    for lo in range(0, len(row_ids), chunk_rows):
        yield ChunkRequest(start_seq + lo, row_ids[lo : lo + chunk_rows])
