"""Sorted reads at the pinned version: one Lance read per request, rows put back in plan order.

A Lance table is read with one scan restricted to the wanted row addresses (pylance's
``row_addr_allowlist``), which reads each run of consecutive rows (a shuffle clump) as one
range instead of row by row: faster than a sorted ``_take_rows`` of the same ids on clumped
reads, and no slower on scattered ones (docs/performance.md). Remote tables
and tables with stable row ids (whose ``_rowid`` is not an address) are read with a take.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..plan.table import TableRef
from .allowlist import allowlist

ADDRESS = "_rowaddr"
# A read of more bytes than this is made in pieces of this size: Lance decodes a read into
# buffers its size, and buffers much larger than this are mapped fresh for every read,
# their pages zeroed by the kernel each time (see ``malloc``); a chunked table costs the
# consumer nothing, its conversion copies from the chunks anyway.
TAKE_BYTES = 16 << 20


def _fragments(ds: Any, ids: np.ndarray) -> list[Any]:
    """The fragments holding the (sorted) addresses ``ids``, in ascending order."""
    found = (ds.get_fragment(int(f)) for f in np.unique(ids >> np.uint64(32)))
    return [f for f in found if f is not None]


def read_sorted(table: TableRef, ids: np.ndarray, columns: list[str] | None,
                row_bytes: int | None = None) -> pa.Table:
    """The rows of the ascending row ids ``ids``, in that order; read in pieces of
    ``TAKE_BYTES`` when the rows' width ``row_bytes`` is known."""
    if type(table) is not TableRef or not len(ids):
        return table.take_rows(ids, columns)
    ds = table.open_lance()
    if ds.has_stable_row_ids:
        return table.take_rows(ids, columns)
    step = len(ids) if not row_bytes else max(1, TAKE_BYTES // row_bytes)
    if step < len(ids):
        return pa.concat_tables([_read_range(table, ds, ids[lo:lo + step], columns)
                                 for lo in range(0, len(ids), step)])
    return _read_range(table, ds, ids, columns)


def _read_range(table: TableRef, ds: Any, ids: np.ndarray, columns: list[str] | None
                ) -> pa.Table:
    # One chunk per fragment (Lance's default is one per 8,192 rows): fewer pieces for the
    # one copy that converts the read.
    got = ds.scanner(columns=columns, fragments=_fragments(ds, ids), scan_in_order=True,
                     with_row_address=True, batch_size=max(len(ids), 1),
                     row_addr_allowlist=allowlist(ids)).to_table()
    # The addresses come back with the rows: the order is checked, never assumed.
    if got.num_rows == len(ids) and not np.array_equal(
            got.column(ADDRESS).to_numpy(), ids):
        raise RuntimeError(f"a range read of version {table.version} returned rows out of "
                           "address order; refusing to change the planned order")
    return got.drop_columns([ADDRESS])


def take_sorted(
    table: TableRef, row_ids: np.ndarray, columns: list[str] | None,
    row_bytes: int | None = None,
) -> tuple[pa.Table, np.ndarray | None]:
    """Read ``row_ids`` at the pinned version in ascending address order.

    Returns the rows (one chunk per fragment read: the conversion to tensors copies them
    once, straight from the chunks) and the permutation that puts them back in the given
    order (None when they already are). Sorting makes one read touch each fragment once with
    ascending offsets, the coalesced access Lance reads fastest. ``row_bytes`` (the rows'
    estimated width) lets a large read be made in pieces.
    """
    ids = np.asarray(row_ids, dtype=np.uint64)
    order = None if bool(np.all(ids[1:] > ids[:-1])) else np.argsort(ids, kind="stable")
    wanted = ids if order is None else ids[order]
    got = read_sorted(table, wanted, columns, row_bytes)
    if got.num_rows != len(ids):
        raise RuntimeError(
            f"Lance returned {got.num_rows} rows for {len(ids)} planned row ids at version "
            f"{table.version}; the pinned version no longer holds the planned rows"
        )
    if order is None:
        return got, None
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return got, inverse


def one_batch(rows: pa.Table) -> pa.RecordBatch:
    """``rows`` as one record batch (what a transform or a ``collate_fn`` is given)."""
    if not rows.num_rows:
        return pa.RecordBatch.from_pylist([], schema=rows.schema)
    return rows.combine_chunks().to_batches()[0]


def take_in_order(
    table: TableRef, row_ids: np.ndarray, columns: list[str] | None,
    row_bytes: int | None = None,
) -> pa.Table:
    """Read ``row_ids`` at the pinned version and return them in the given order."""
    rows, inverse = take_sorted(table, row_ids, columns, row_bytes)
    return rows if inverse is None else rows.take(pa.array(inverse))
