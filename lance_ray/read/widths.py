"""How many bytes one row of the columns read takes in memory, from the table's metadata.

Fixed-width columns (numbers, fixed-size lists of them) have their Arrow width; variable
ones (binary, strings, lists) their bytes on disk per row, from Lance's per-field data
statistics, plus their offsets. Bytes on disk under-count compressible values, which only
makes reads larger than the target by the compression ratio; images, audio and encoded
samples are stored as they are. Only metadata is read (the manifest), never a row, so every
process computes the same estimate for a pinned version.
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa

from ..plan.remote import RemoteTableRef
from ..plan.table import TableRef

logger = logging.getLogger(__name__)


def fixed_width(t: pa.DataType) -> int | None:
    """Arrow bytes per value of ``t`` (validity bits ignored), None if variable."""
    if pa.types.is_fixed_size_list(t):
        inner = fixed_width(t.value_type)
        return None if inner is None else inner * t.list_size
    if pa.types.is_struct(t):
        parts = [fixed_width(t.field(i).type) for i in range(t.num_fields)]
        return None if None in parts else sum(p for p in parts if p is not None)
    if pa.types.is_boolean(t):
        return 1
    try:
        return max(1, t.bit_width // 8)
    except ValueError:  # binary, strings, lists, ...: no fixed width
        return None


def _field_ids(field: Any) -> list[int]:
    """Lance field ids of ``field`` and every field nested in it."""
    return [field.id(), *(i for child in field.children() for i in _field_ids(child))]


def row_bytes(table: TableRef, columns: list[str] | None) -> int | None:
    """Estimated in-memory bytes of one row of ``columns`` (all when None) at the pinned
    version; None for a remote table (no Lance metadata: reads are sized in rows)."""
    if isinstance(table, RemoteTableRef):
        return None
    ds = table.open_lance()
    names = list(columns) if columns is not None else list(ds.schema.names)
    rows = sum(f.physical_rows for f in ds.get_fragments())
    on_disk: dict[int, int] | None = None
    total = 0
    for name in names:
        width = fixed_width(ds.schema.field(name).type)
        if width is None:
            if on_disk is None:
                on_disk = {f.id: f.bytes_on_disk for f in ds.stats.data_stats().fields}
            ids = _field_ids(ds.lance_schema.field(name))
            width = 8 + sum(on_disk.get(i, 0) for i in ids) // max(rows, 1)  # + an offset
        total += width
    return max(total, 1)
