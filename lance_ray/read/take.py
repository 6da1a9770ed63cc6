"""Sorted takes at the pinned version: one Lance take per read, rows put back in plan order."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..plan.table import TableRef


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

