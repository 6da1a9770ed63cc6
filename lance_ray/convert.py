"""Arrow batches to torch tensors without per-row Python objects."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa


def column_to_numpy(col: pa.Array) -> np.ndarray | None:
    """A numpy view (zero-copy where Arrow allows) of a numeric column, else None.

    Fixed-size lists of numbers become 2-D arrays; anything else (strings, nulls, ragged
    lists) has no tensor form and returns None.
    """
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if col.null_count:
        return None
    t = col.type
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return col.to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(t) and (
        pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)
    ):
        values = col.flatten().to_numpy(zero_copy_only=False)
        return values.reshape(len(col), t.list_size)
    return None


def batch_to_torch(batch: pa.RecordBatch) -> dict[str, Any]:
    """``{column: tensor}`` for numeric columns, ``{column: list}`` for the rest."""
    import torch

    out: dict[str, Any] = {}
    for name, col in zip(batch.schema.names, batch.columns):
        arr = column_to_numpy(col)
        if arr is None:
            out[name] = col.to_pylist()
        else:
            # torch needs a writable buffer; Arrow's zero-copy views are read-only.
            out[name] = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    return out


def concat(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One record batch holding ``batches`` in order."""
    if len(batches) == 1:
        return batches[0]
    table = pa.Table.from_batches(batches).combine_chunks()
    return table.to_batches()[0]
