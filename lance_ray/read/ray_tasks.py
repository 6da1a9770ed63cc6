"""What runs in the Ray reader's tasks: the planned reads as a Ray Data ``Datasource`` (one
read task per request) and the transform stage, each block carrying its rows' stream
positions and its read's cost as internal columns (``ray_data`` turns them back into
``ChunkResult``s in the consumer).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from ..plan.table import TableRef
from .documents import DocumentReads
from .items import to_arrow
from .malloc import keep_freed_buffers
from .requests import ChunkRequest, ReadSizing
from .take import one_batch, take_in_order, take_sorted
from .transform import TransformPolicy, portable_items

SEQ_COLUMN = "__lance_ray_seq"
# A read's cost rides on its first row (zeros elsewhere), so any cut of a block sums right.
COST_COLUMNS = ("__lance_ray_bytes", "__lance_ray_fetch_s", "__lance_ray_transform_s")
INTERNAL_COLUMNS = (SEQ_COLUMN, *COST_COLUMNS)
INTERNAL_BYTES = 8 * len(INTERNAL_COLUMNS)  # per row: one int64 and three float64


def datasource_cls() -> type:
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class PlannedTakeDatasource(Datasource):
        """One read task per planned chunk; each task returns its rows in plan order."""

        def __init__(self, table: TableRef, columns: list[str] | None, chunks: list[ChunkRequest],
                     sizing: ReadSizing | None = None, documents: DocumentReads | None = None,
                     sorted_rows: int | None = None):
            self._table, self._columns, self._chunks = table, columns, chunks
            self._sizing, self._documents = sizing, documents
            self._sorted_rows = sorted_rows

        def _nbytes(self, rows: int) -> int | None:
            sizing = self._sizing
            return None if sizing is None or sizing.row_bytes is None else sizing.nbytes(rows)

        def estimate_inmemory_data_size(self) -> int | None:
            return self._nbytes(sum(len(c.row_ids) for c in self._chunks))

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                           data_context: Any = None) -> list[ReadTask]:
            # The plan, not Ray's parallelism hint, decides the tasks: one chunk each.
            return [self._task(c) for c in self._chunks]

        def _task(self, chunk: ChunkRequest) -> ReadTask:
            # A module-level function, pickled by reference: a closure was pickled by value
            # for every task (cloudpickle scanning the loaded modules each time), 20% of the
            # trainer's GIL-held samples on 64 KB rows.
            row_bytes = None if self._sizing is None else self._sizing.row_bytes
            read = functools.partial(read_block, self._table, self._columns, self._documents,
                                     chunk, self._sorted_rows, row_bytes)
            meta = BlockMetadata(num_rows=len(chunk.row_ids),
                                 size_bytes=self._nbytes(len(chunk.row_ids)),
                                 exec_stats=None, input_files=None)
            return ReadTask(read, meta)

    return PlannedTakeDatasource


def read_block(table: TableRef, columns: list[str] | None, documents: DocumentReads | None,
                chunk: ChunkRequest, sorted_rows: int | None = None,
                row_bytes: int | None = None) -> Iterator[pa.Table]:
    """A read task's body: the rows of ``chunk`` as one block, each with its stream position,
    and the read's cost. The rows are in plan order (arranged by split for packed reads),
    or, when the block holds at most ``sorted_rows`` bytes, in the order Lance read them:
    the consumer then puts them in plan order by their positions, in the one copy its
    conversion makes anyway. (Ray Data cuts a larger block into slices, and a slice of rows
    in Lance's order would hold scattered positions: such a block is put in plan order here,
    whatever the estimate of its size said.) ``row_bytes``, the rows' estimated width, lets
    a large read be taken in pieces."""
    keep_freed_buffers()
    started = time.perf_counter()
    seq = np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in chunk.spans])
    if documents is not None:
        got, inverse = take_sorted(table, chunk.row_ids, columns, row_bytes)
        rows = pa.Table.from_batches([documents.arrange(got, inverse, chunk)])
    elif sorted_rows is not None:
        rows, inverse = take_sorted(table, chunk.row_ids, columns, row_bytes)
        if inverse is None:
            pass
        elif rows.nbytes + INTERNAL_BYTES * rows.num_rows > sorted_rows:
            rows = rows.take(pa.array(inverse))  # plan row i is sorted row inverse[i]
        else:  # sorted row j is plan row argsort(inverse)[j]
            seq = seq[np.argsort(inverse)]
    else:
        rows = take_in_order(table, chunk.row_ids, columns, row_bytes)
    out = rows.append_column(SEQ_COLUMN, pa.array(seq))
    cost = (rows.nbytes, time.perf_counter() - started, 0.0)
    for name, value in zip(COST_COLUMNS, cost):
        out = out.append_column(name, first_row(value, rows.num_rows))
    yield out


class TransformStage:
    """The ``map_batches`` function: the user's transform, its items as Arrow columns (one
    stacked tensor per leaf, see ``items``), or one pickle per row when they have no
    tensor form."""

    def __init__(self, transform: TransformPolicy):
        self.transform = transform

    def __call__(self, table: pa.Table) -> pa.Table:
        keep_freed_buffers()
        batch = one_batch(table.drop_columns(list(INTERNAL_COLUMNS)))
        started = time.perf_counter()
        payload, why = self.transform.columns(batch)
        if isinstance(payload, list):
            # Failures travel as data (Ray would wrap a raised exception and lose its type).
            payload = portable_items(payload)
        out = to_arrow(payload, why)
        spent = first_row(time.perf_counter() - started, batch.num_rows).to_numpy()
        for name in INTERNAL_COLUMNS:
            col = table.column(name).to_numpy()
            out = out.append_column(name, pa.array(col + spent if name == COST_COLUMNS[2]
                                                   else col))
        return out


def first_row(value: float, rows: int) -> pa.Array:
    """``value`` on the first of ``rows`` rows, zeros after it."""
    out = np.zeros(rows, dtype=np.float64)
    if rows:
        out[0] = value
    return pa.array(out)
