"""Arrow batches to torch tensors without per-row Python objects.

A read chunk is converted once (``to_columns``); the batches cut from it are tensor views,
so handing a batch to the trainer costs a few slices, not a conversion.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class Columns:
    """Rows as ``{column: tensor}`` for numeric columns and ``{column: list}`` for the rest.

    Slicing gives views of the same tensors, so a batch cut from a chunk shares its memory.
    """

    data: dict[str, Any]
    num_rows: int
    nbytes: int  # Arrow bytes of these rows (for the delivery statistics)

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, rows: slice) -> Columns:
        lo, hi, _ = rows.indices(self.num_rows)
        share = (hi - lo) / self.num_rows if self.num_rows else 0.0
        return Columns({k: v[lo:hi] for k, v in self.data.items()}, hi - lo,
                       round(self.nbytes * share))

    @staticmethod
    def concat(parts: list[Columns]) -> Columns:
        """The rows of ``parts`` in order, as one ``Columns``."""
        if len(parts) == 1:
            return parts[0]
        import torch

        data: dict[str, Any] = {}
        for name, first in parts[0].data.items():
            values = [p.data[name] for p in parts]
            data[name] = (torch.cat(values) if isinstance(first, torch.Tensor)
                          else [x for v in values for x in v])
        return Columns(data, sum(p.num_rows for p in parts), sum(p.nbytes for p in parts))


def to_columns(batch: pa.RecordBatch | pa.Table, order: np.ndarray | None = None) -> Columns:
    """Convert ``batch`` (rows reordered by ``order`` if given) to ``Columns``.

    Each numeric column is copied exactly once: the reordering gather when there is one,
    else a copy making Arrow's read-only (possibly shared-memory) buffer writable for torch.
    """
    import torch

    data: dict[str, Any] = {}
    for name, col in zip(batch.schema.names, batch.columns):
        arr = column_to_numpy(col)
        if arr is None:
            values = col if order is None else col.take(pa.array(order))
            data[name] = values.to_pylist()
        elif order is not None:
            data[name] = torch.from_numpy(arr[order])
        else:
            data[name] = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    return Columns(data, batch.num_rows, batch.nbytes)


def concat(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One record batch holding ``batches`` in order."""
    if len(batches) == 1:
        return batches[0]
    table = pa.Table.from_batches(batches).combine_chunks()
    return table.to_batches()[0]
