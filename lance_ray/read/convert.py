"""Arrow batches to torch tensors without per-row Python objects.

A read chunk is converted once (``to_columns``); the batches cut from it are tensor views,
so handing a batch to the trainer costs a few slices, not a conversion. Numeric and
fixed-size list columns become tensors, list and binary columns :class:`Ragged` (values and
offsets), anything else (strings, nulls) lists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from . import buffers

logger = logging.getLogger(__name__)
_told_nulls: set[str] = set()  # numeric columns whose nulls were logged, once per process

T = TypeVar("T")


def _has_tensor_form(t: pa.DataType) -> bool:
    """Numbers, or fixed-size lists of numbers: columns that are tensors without nulls."""
    if pa.types.is_fixed_size_list(t):
        t = t.value_type
        return pa.types.is_integer(t) or pa.types.is_floating(t)
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def column_to_numpy(col: pa.Array) -> np.ndarray | None:
    """A numpy view (zero-copy where Arrow allows) of a numeric column, else None.

    Fixed-size lists of numbers become 2-D arrays; anything else (strings, nulls, ragged
    lists) has no tensor form and returns None.
    """
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    t = col.type
    if col.null_count or not _has_tensor_form(t):
        return None
    if pa.types.is_fixed_size_list(t):
        flat = col.flatten()
        if flat.null_count:  # a null element: numpy would make the ints floats with NaN
            return None
        return flat.to_numpy(zero_copy_only=False).reshape(len(col), t.list_size)
    return col.to_numpy(zero_copy_only=False)


@dataclass
class Ragged:
    """The rows of a list or binary column: every row's elements in one ``values`` tensor
    (bytes as ``uint8``), row ``i`` being ``values[offsets[i]:offsets[i + 1]]``.

    ``offsets`` is int64 with one entry more than there are rows and starts at 0; ``valid``
    is False for a null row (which is empty). What a batch holds is ``as_dict()``.
    """

    values: Any  # torch.Tensor
    offsets: Any  # torch.Tensor, int64
    valid: Any  # torch.Tensor, bool

    def __len__(self) -> int:
        return len(self.valid)

    def __getitem__(self, rows: slice) -> Ragged:
        lo, hi, _ = rows.indices(len(self))
        start, stop = int(self.offsets[lo]), int(self.offsets[max(lo, hi)])
        return Ragged(self.values[start:stop], self.offsets[lo : max(lo, hi) + 1] - start,
                      self.valid[lo:hi])

    def as_dict(self) -> dict[str, Any]:
        return {"values": self.values, "offsets": self.offsets, "valid": self.valid}

    @staticmethod
    def concat(parts: list[Ragged]) -> Ragged:
        import torch

        shifts = torch.tensor([0] + [int(p.offsets[-1]) for p in parts[:-1]]).cumsum(0)
        offsets = [parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, shifts)]
        return Ragged(cat_tensors([p.values for p in parts]), cat_tensors(offsets),
                      cat_tensors([p.valid for p in parts]))


def cat_tensors(tensors: list[Any]) -> Any:
    """``torch.cat`` of CPU tensors, copied by numpy on the calling thread.

    torch copies large tensors on its OpenMP threads, and those threads then spin between
    batches, taking the cores the reads need (on wide rows, where every batch joins two reads,
    a large share of the epoch's CPU). Tensors numpy cannot view (bfloat16,
    or ones that need grad, from a transform) still go through ``torch.cat``.
    """
    import torch

    try:
        arrays = [t.numpy() for t in tensors]
    except (TypeError, RuntimeError):
        return torch.cat(tensors)
    return torch.from_numpy(buffers.concatenate(arrays))


def chunks_of(col: pa.Array | pa.ChunkedArray) -> list[Any]:
    """A column's chunks (a read brings one per fragment); a column of no chunks as itself."""
    return col.chunks if isinstance(col, pa.ChunkedArray) and col.num_chunks else [col]


def per_chunk(col: pa.Array | pa.ChunkedArray, convert: Callable[[Any], T | None]
              ) -> list[T] | None:
    """``convert`` of each of the column's chunks; None if any chunk has no such form."""
    out = []
    for chunk in chunks_of(col):
        part = convert(chunk)
        if part is None:
            return None
        out.append(part)
    return out


def ragged(col: pa.Array | pa.ChunkedArray, order: np.ndarray | None = None) -> Ragged | None:
    """A list column of numbers (or of fixed-size lists of numbers) or a binary column as
    :class:`Ragged` (rows reordered by ``order`` if given), else None.

    One copy, straight from the read's chunks: the gather that puts the rows in order,
    making them writable for torch. A list column whose elements hold nulls has no such form
    (None).
    """
    import torch

    parts = per_chunk(col, _ragged_chunk)
    if parts is None:
        return None
    values = [p.values for p in parts]
    # Starts count from the first chunk's values, the chunks' values laid end to end.
    bases = np.cumsum([0, *(len(v) for v in values)])
    starts = np.concatenate([p.starts + base for p, base in zip(parts, bases.tolist())])
    lengths = np.concatenate([p.lengths for p in parts])
    valid = np.concatenate([p.valid for p in parts])
    if order is not None:
        starts, lengths, valid = starts[order], lengths[order], valid[order]
    offsets = np.zeros(len(valid) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if order is None and valid.all():  # each chunk's rows are one run of its values
        out = buffers.concatenate([p.values[p.starts[0] : p.starts[-1] + p.lengths[-1]]
                                   for p in parts if len(p.starts)] or [values[0][:0]])
    else:
        out = gather_rows(values, starts, lengths, offsets)
    return Ragged(torch.from_numpy(out), torch.from_numpy(offsets), torch.from_numpy(valid))


@dataclass(frozen=True)
class _RaggedChunk:
    """One chunk of a ragged column: its element values, and each row's start and length in
    them and validity (a null row is empty)."""

    values: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    valid: np.ndarray


def _ragged_chunk(col: pa.Array | pa.ChunkedArray) -> _RaggedChunk | None:
    """One chunk's :class:`_RaggedChunk`; None when the column has no :class:`Ragged`
    form."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()  # a column of no chunks
    t, n = col.type, len(col)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        child = col.values
        if child.null_count:
            return None
        values = column_to_numpy(child)
        if values is None:
            return None
        off = col.offsets.to_numpy()
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        _, off_buf, data = col.buffers()
        width = np.int64 if pa.types.is_large_binary(t) else np.int32
        off = (np.frombuffer(off_buf, width)[col.offset : col.offset + n + 1]
               if off_buf is not None else np.zeros(1, width))
        values = np.frombuffer(data, np.uint8) if data is not None else np.empty(0, np.uint8)
    else:
        return None
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    starts, lengths = off[:-1].astype(np.int64), np.diff(off).astype(np.int64)
    if col.null_count:
        lengths[~valid] = 0  # a null row is empty, whatever its slot holds
    return _RaggedChunk(values, starts, lengths, valid)


# Rows at least this long (in elements) are gathered one slice (memcpy) per row: an index of
# every element costs 8 bytes and a lookup per element (on wide rows, many times longer and
# several times the read's size in memory).
SLICED_ROW_ELEMENTS = 256


def gather_rows(values: list[np.ndarray], starts: np.ndarray, lengths: np.ndarray,
                offsets: np.ndarray) -> np.ndarray:
    """Row ``i``'s ``lengths[i]`` elements from ``starts[i]`` of the ``values`` arrays laid
    end to end, for every row, concatenated (``offsets``: the rows' places in the output)."""
    total = int(offsets[-1])
    if not len(lengths) or total < SLICED_ROW_ELEMENTS * len(lengths):
        flat = values[0] if len(values) == 1 else np.concatenate(values)
        return buffers.take(flat, np.repeat(starts - offsets[:-1], lengths) + np.arange(total))
    bases = np.cumsum([0, *(len(v) for v in values)])
    which = np.minimum(np.searchsorted(bases, starts, side="right") - 1, len(values) - 1)
    out = buffers.empty((total, *values[0].shape[1:]), values[0].dtype)
    for k, start, at, length in zip(which.tolist(), (starts - bases[which]).tolist(),
                                    offsets[:-1].tolist(), lengths.tolist()):
        out[at : at + length] = values[k][start : start + length]
    return out


@dataclass
class Columns:
    """Rows as ``{column: tensor}`` for numeric columns, :class:`Ragged` for list and binary
    columns and ``{column: list}`` for the rest.

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
        for name in parts[0].data:
            values = [p.data[name] for p in parts]
            if all(isinstance(v, torch.Tensor) for v in values):
                data[name] = cat_tensors(values)
            elif all(isinstance(v, Ragged) for v in values):
                data[name] = Ragged.concat(values)
            else:  # lists: a column that held nulls in some of the reads
                data[name] = [x for v in values for x in _rows(v)]
        return Columns(data, sum(p.num_rows for p in parts), sum(p.nbytes for p in parts))

    def batch(self) -> dict[str, Any]:
        """What the trainer receives: ``{column: tensor | {"values", "offsets", "valid"} |
        list}``."""
        return {k: v.as_dict() if isinstance(v, Ragged) else v for k, v in self.data.items()}


def _rows(v: Any) -> list[Any]:
    """A column's rows as Python values (what ``to_pylist`` gives)."""
    if isinstance(v, list):
        return v
    if not isinstance(v, Ragged):  # a tensor
        return v.tolist()
    values, offsets = v.values.tolist(), v.offsets.tolist()
    return [values[offsets[i] : offsets[i + 1]] if v.valid[i] else None for i in range(len(v))]


def to_columns(batch: pa.RecordBatch | pa.Table, order: np.ndarray | None = None) -> Columns:
    """Convert ``batch`` (rows reordered by ``order`` if given) to ``Columns``.

    Each numeric column is copied exactly once, straight from the read's chunks: the
    reordering gather when there is one, else a copy making Arrow's read-only (possibly
    shared-memory) buffer writable for torch.
    """
    import torch

    data: dict[str, Any] = {}
    for name, col in zip(batch.schema.names, batch.columns):
        arr = numeric_rows(col, order)
        if arr is not None:
            data[name] = torch.from_numpy(arr)
            continue
        rows = ragged(col, order)
        if rows is not None:
            data[name] = rows
            continue
        if _has_tensor_form(col.type) and name not in _told_nulls:  # so, nulls
            _told_nulls.add(name)
            logger.warning(
                "column %r holds nulls: a batch with rows of a read that holds one gets it "
                "as a Python list (None for a null), other batches as a tensor; fill the "
                "nulls (or filter them out) for a tensor in every batch", name)
        values = col if order is None else col.take(pa.array(order))
        data[name] = values.to_pylist()
    return Columns(data, batch.num_rows, batch.nbytes)


def numeric_rows(col: pa.Array | pa.ChunkedArray, order: np.ndarray | None
                 ) -> np.ndarray | None:
    """A numeric column's rows (reordered by ``order``) as one new writable array, copied
    straight from its chunks; None when it has no tensor form."""
    arrays = per_chunk(col, column_to_numpy)
    if arrays is None:
        return None
    if len(arrays) == 1:
        arr = arrays[0]
        if order is not None:
            return buffers.take(arr, order)
        if arr.flags.writeable:
            return arr
        out = buffers.empty(arr.shape, arr.dtype)
        np.copyto(out, arr)
        return out
    if order is None:
        return buffers.concatenate(arrays)
    # Each chunk's rows go straight to their places: no combined copy in between.
    places = np.empty_like(order)
    places[order] = np.arange(len(order))
    out = buffers.empty((len(order), *arrays[0].shape[1:]), arrays[0].dtype)
    lo = 0
    for arr in arrays:
        out[places[lo : lo + len(arr)]] = arr
        lo += len(arr)
    return out


def concat(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One record batch holding ``batches`` in order."""
    if len(batches) == 1:
        return batches[0]
    table = pa.Table.from_batches(batches).combine_chunks()
    return table.to_batches()[0]
