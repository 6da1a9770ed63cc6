"""A transform's items as columns: one stacked array per leaf, so items travel as tensors.

A transform returns one item per row. When every item of a read has the same *layout*
(dicts with ``str`` keys, lists and tuples, down to leaves that are numpy arrays or torch
tensors of one dtype and shape, numpy scalars, Python ``int``/``float``/``bool``, ``str`` or
``bytes``), the read's items become :class:`ItemColumns`: each numeric leaf stacked on axis 0
into one ndarray, each ``str``/``bytes`` leaf a list. Between a Ray task and the consumer
they travel as plain Arrow columns (``to_arrow``/``from_arrow``: a fixed-size list of the
flattened leaf, the layout as JSON in the schema metadata), not one pickle per row.

On the consumer side a batch is a slice: :meth:`ItemColumns.collated` is exactly what
torch's ``default_collate`` gives for those items (same types, dtypes, shapes and values)
without touching them one by one, and :meth:`ItemColumns.items` rebuilds the items as the
transform returned them. Reads whose items have no such form (other types, layouts that
differ within the read, a failed row) stay a list of items, noted once per reason in the log.
"""

from __future__ import annotations

import json
import logging
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from . import buffers

logger = logging.getLogger(__name__)

LAYOUT_KEY = b"lance_ray.items"  # schema metadata: the JSON layout of columnar items
OBJECTS_KEY = b"lance_ray.objects"  # schema metadata: why the items travel as pickles
LEAF_PREFIX = "__lance_ray_leaf"
OBJECT_COLUMN = "__lance_ray_item"
MAX_LEAVES = 256  # more leaves per item than this: a list of items (no wide schemas)
# dtypes that torch's default_collate stacks to the same dtype (uint64 scalars it refuses).
DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                    "float16", "float32", "float64"})
SCALARS = {int: "int", float: "float", bool: "bool"}  # exact types: a bool is no int here
SCALAR_DTYPES = {"int": "int64", "float": "float64", "bool": "bool"}
Node = tuple[Any, ...]


class NoTensorForm(Exception):
    """The items of a read have no columnar form; the message says why."""


def _dtype(dtype: np.dtype, what: str) -> str:
    if dtype.name not in DTYPES or not dtype.isnative:
        raise NoTensorForm(f"{what} of dtype {dtype} has no tensor form here")
    return dtype.str


def _flatten(x: Any, leaves: list[Any]) -> Node:
    """The layout of ``x``, its leaves appended to ``leaves`` depth first."""
    kind = type(x)
    if kind in SCALARS:
        leaves.append(x)
        return (SCALARS[kind],)
    if kind is np.ndarray:
        leaves.append(x)
        return ("ndarray", _dtype(x.dtype, "an array"), x.shape)
    if kind is dict:
        if not all(type(k) is str for k in x):
            raise NoTensorForm("dict items with keys that are not str")
        return ("dict", tuple((k, _flatten(v, leaves)) for k, v in x.items()))
    if kind is list or kind is tuple:
        return (kind.__name__, tuple(_flatten(v, leaves) for v in x))
    if kind is str or kind is bytes:
        leaves.append(x)
        return (kind.__name__,)
    if isinstance(x, np.generic) and not isinstance(x, (str, bytes)):
        leaves.append(x)
        return ("npscalar", _dtype(x.dtype, "a numpy scalar"))
    import torch

    if kind is torch.Tensor:
        if x.requires_grad or x.device.type != "cpu" or x.layout != torch.strided:
            raise NoTensorForm("tensors that need grad, live off the CPU or are not strided")
        try:
            dtype = np.dtype(str(x.dtype).removeprefix("torch."))
        except TypeError as e:  # bfloat16, float8: no numpy dtype
            raise NoTensorForm(f"tensors of dtype {x.dtype}") from e
        leaves.append(x)
        return ("tensor", _dtype(dtype, "a tensor"), tuple(x.shape))
    raise NoTensorForm(f"items holding {kind.__module__}.{kind.__qualname__}")


def _leaf_kinds(node: Node) -> list[Node]:
    if node[0] == "dict":
        return [leaf for _, child in node[1] for leaf in _leaf_kinds(child)]
    if node[0] in ("list", "tuple"):
        return [leaf for child in node[1] for leaf in _leaf_kinds(child)]
    return [node]


def _stack(kind: Node, values: list[Any]) -> np.ndarray | list[Any]:
    tag = kind[0]
    if tag in ("str", "bytes"):
        return values
    if tag == "ndarray":
        return np.stack(values)
    if tag == "tensor":
        import torch

        return torch.stack(values).numpy()
    if tag == "npscalar":
        return np.array(values, dtype=np.dtype(kind[1]))
    try:
        return np.array(values, dtype=SCALAR_DTYPES[tag])
    except OverflowError as e:  # default_collate cannot stack them either
        raise NoTensorForm("ints outside int64") from e


@dataclass
class ItemColumns:
    """The items of a read (or a slice of one), one column per leaf of their layout."""

    layout: Node
    columns: list[np.ndarray | list[Any]]
    num_rows: int

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, rows: slice) -> ItemColumns:
        lo, hi, _ = rows.indices(self.num_rows)
        return ItemColumns(self.layout, [c[lo:hi] for c in self.columns], hi - lo)

    @property
    def nbytes(self) -> int:
        """The bytes of the columns as Arrow holds them: an array's buffer; a string or
        bytes value's data and its 8-byte offset (encoded images, captions)."""
        return sum(c.nbytes if isinstance(c, np.ndarray)
                   else sum(len(v.encode() if isinstance(v, str) else v) + 8 for v in c)
                   for c in self.columns)

    def collated(self) -> Any:
        """What ``default_collate(self.items())`` returns, built from the columns."""
        import torch

        def leaf(kind: Node, col: Any, parent: str) -> Any:
            if kind[0] in ("str", "bytes"):  # default_collate returns the batch it was given:
                return tuple(col) if parent in ("list", "tuple") else list(col)  # transposed
            return torch.from_numpy(col)

        return self._walk(leaf, lambda node, children: children if node[0] != "tuple"
                          else list(children))

    def items(self) -> list[Any]:
        """The items, as the transform returned them (arrays are views of the columns)."""
        import torch

        def leaf(kind: Node, col: Any, parent: str) -> list[Any]:
            tag = kind[0]
            if tag == "ndarray":
                return [col[i, ...] for i in range(self.num_rows)]
            if tag == "tensor":
                whole = torch.from_numpy(col)
                return [whole[i] for i in range(self.num_rows)]
            if tag == "npscalar":
                return [col[i] for i in range(self.num_rows)]
            return col.tolist() if isinstance(col, np.ndarray) else list(col)

        def join(node: Node, children: Any) -> list[Any]:
            if node[0] == "dict":
                keys = [k for k, _ in node[1]]
                return [dict(zip(keys, row)) for row in zip(*children.values())] if keys \
                    else [{} for _ in range(self.num_rows)]
            rows = [list(r) for r in zip(*children)] if children else [
                [] for _ in range(self.num_rows)]
            return rows if node[0] == "list" else [tuple(r) for r in rows]

        return self._walk(leaf, join)

    def _walk(self, leaf: Any, join: Any) -> Any:
        cols = iter(self.columns)

        def walk(node: Node, parent: str) -> Any:
            if node[0] == "dict":
                return join(node, {k: walk(child, "dict") for k, child in node[1]})
            if node[0] in ("list", "tuple"):
                return join(node, [walk(child, node[0]) for child in node[1]])
            return leaf(node, next(cols), parent)

        return walk(self.layout, "")

    @staticmethod
    def concat(parts: list[ItemColumns]) -> ItemColumns | None:
        """The rows of ``parts`` in order, or None when their layouts differ."""
        if len(parts) == 1:
            return parts[0]
        if any(p.layout != parts[0].layout for p in parts):
            return None
        cols: list[np.ndarray | list[Any]] = []
        for j, first in enumerate(parts[0].columns):
            cols.append(buffers.concatenate([p.columns[j] for p in parts])  # type: ignore[misc]
                        if isinstance(first, np.ndarray)
                        else [x for p in parts for x in p.columns[j]])
        return ItemColumns(parts[0].layout, cols, sum(p.num_rows for p in parts))


def columnar(items: list[Any]) -> ItemColumns:
    """``items`` (one read's, all of one layout) as columns; raises :class:`NoTensorForm`."""
    if not items:
        raise NoTensorForm("no items")
    first: list[Any] = []
    layout = _flatten(items[0], first)
    if len(first) > MAX_LEAVES:
        raise NoTensorForm(f"items with more than {MAX_LEAVES} leaves")
    per_leaf: list[list[Any]] = []
    _gather(layout, items, per_leaf)
    kinds = _leaf_kinds(layout)
    return ItemColumns(layout, [_stack(k, v) for k, v in zip(kinds, per_leaf)], len(items))


DIFFER = "items whose structure, dtypes or shapes differ within a read"
_EXACT = {tag: kind for kind, tag in SCALARS.items()} | {"str": str, "bytes": bytes}


def _gather(node: Node, values: list[Any], out: list[list[Any]]) -> None:
    """Append to ``out``, depth first, each leaf's values over ``values`` (the items, or
    their parts at ``node``), checking that every one has the first item's layout ``node``.

    Checked one level at a time over all items rather than item by item: for small items
    (a tokenizer's), flattening them one by one cost a large share of what the transform
    itself took to make them.
    """
    tag = node[0]
    if tag == "dict":
        keys = [k for k, _ in node[1]]
        if not all(type(v) is dict and list(v) == keys for v in values):
            raise NoTensorForm(DIFFER)
        for k, child in node[1]:
            _gather(child, [v[k] for v in values], out)
        return
    if tag in ("list", "tuple"):
        kind, n = (list if tag == "list" else tuple), len(node[1])
        if not all(type(v) is kind and len(v) == n for v in values):
            raise NoTensorForm(DIFFER)
        for i, child in enumerate(node[1]):
            _gather(child, [v[i] for v in values], out)
        return
    if not _same_leaves(node, values):
        raise NoTensorForm(DIFFER)
    out.append(values)


def _same_leaves(node: Node, values: list[Any]) -> bool:
    """Whether every value is a leaf of layout ``node``."""
    tag = node[0]
    if tag in _EXACT:
        kind = _EXACT[tag]
        return all(type(v) is kind for v in values)
    if tag == "ndarray":
        dtype, shape = np.dtype(node[1]), node[2]
        return all(type(v) is np.ndarray and v.dtype == dtype and v.shape == shape
                   for v in values)
    if tag == "npscalar":
        dtype = np.dtype(node[1])
        return all(isinstance(v, np.generic) and v.dtype == dtype for v in values)
    try:  # tensors: their device, grad and layout matter too
        return all(_flatten(v, []) == node for v in values)
    except NoTensorForm:
        return False


_noted: set[str] = set()


def as_columns(items: list[Any], *, failed: bool) -> tuple[ItemColumns | list[Any], str]:
    """``items`` as :class:`ItemColumns` when they have the form, else the list itself and
    why not ("" when nothing needs saying).

    ``failed``: some rows failed (their markers are resolved on the consumer's side, so the
    read stays a list; the error policy reports those).
    """
    if failed or not items:
        return items, ""
    try:
        return columnar(items), ""
    except NoTensorForm as e:
        return items, str(e)


def note_objects(reason: str) -> None:
    """Log, once per reason and process, that items travel as Python objects."""
    if reason and reason not in _noted:
        _noted.add(reason)
        logger.info("lance_ray: transform items travel as Python objects (%s); items of "
                    "one layout of arrays, tensors, numbers, str or bytes travel as tensors",
                    reason)


def as_items(payload: ItemColumns | list[Any] | pa.RecordBatch) -> list[Any]:
    """The items of a read, whichever form it has (an Arrow batch's are its rows, dicts)."""
    if isinstance(payload, ItemColumns):
        return payload.items()
    return payload.to_pylist() if isinstance(payload, pa.RecordBatch) else payload


def _leaf_array(kind: Node, col: np.ndarray | list[Any], n: int) -> pa.Array:
    if kind[0] in ("str", "bytes"):
        return pa.array(col, pa.large_string() if kind[0] == "str" else pa.large_binary())
    arr = np.ascontiguousarray(col)
    if arr.dtype == np.bool_:  # one byte per value, as numpy has it (Arrow packs bits)
        arr = arr.view(np.uint8)
    width = int(np.prod(arr.shape[1:], dtype=np.int64))
    if width == 0:
        return pa.nulls(n)
    flat = pa.array(arr.reshape(-1))
    return flat if arr.ndim == 1 else pa.FixedSizeListArray.from_arrays(flat, width)


def to_arrow(payload: ItemColumns | list[Any], reason: str = "") -> pa.Table:
    """One read's items as an Arrow table for Ray's object store: the columns (zero-copy
    from the stacked arrays), or one pickle per row for items without the form."""
    if isinstance(payload, ItemColumns):
        kinds = _leaf_kinds(payload.layout)
        arrays = [_leaf_array(k, c, payload.num_rows) for k, c in zip(kinds, payload.columns)]
        table = pa.table({f"{LEAF_PREFIX}{j}": a for j, a in enumerate(arrays)}) if arrays \
            else pa.table({f"{LEAF_PREFIX}rows": pa.nulls(payload.num_rows)})
        return table.replace_schema_metadata({LAYOUT_KEY: json.dumps(payload.layout)})
    from ray import cloudpickle  # what Ray pickles objects with; this runs in a Ray task

    rows = pa.array([cloudpickle.dumps(x, protocol=5) for x in payload], pa.large_binary())
    return pa.table({OBJECT_COLUMN: rows}).replace_schema_metadata(
        {OBJECTS_KEY: reason.encode()})


def _thaw(x: Any) -> Any:
    return tuple(_thaw(v) for v in x) if isinstance(x, list) else x


def _leaf_column(kind: Node, col: pa.ChunkedArray, n: int) -> np.ndarray | list[Any]:
    tag = kind[0]
    if tag in ("str", "bytes"):
        return col.to_pylist()
    dtype = np.dtype(SCALAR_DTYPES[tag] if tag in SCALAR_DTYPES else kind[1])
    shape = tuple(kind[2]) if tag in ("ndarray", "tensor") else ()
    if pa.types.is_null(col.type):
        return np.zeros((n, *shape), dtype=dtype)
    # One copy, straight from the block's chunks into a new array: writable for torch, and
    # no view pinning the block in Ray's object store. (Joining the chunks first was a
    # second copy: ChunkedArray.combine_chunks copies even a single chunk.)
    out = buffers.empty(n * int(np.prod(shape, dtype=np.int64)), dtype)
    at = 0
    for chunk in col.chunks:
        flat = chunk.flatten() if pa.types.is_fixed_size_list(chunk.type) else chunk
        values = flat.to_numpy(zero_copy_only=False)
        values = values.view(np.bool_) if dtype == np.bool_ else values
        out[at:at + len(values)] = values
        at += len(values)
    if at != len(out):
        raise ValueError(f"a transform's column holds {at} values where {len(out)} were due "
                         f"for {n} items of shape {shape}")
    return out.reshape((n, *shape))


def from_arrow(table: pa.Table) -> ItemColumns | list[Any]:
    """The items of a table made by :func:`to_arrow` (or a cut of one)."""
    meta = table.schema.metadata or {}
    n = table.num_rows
    if LAYOUT_KEY not in meta:
        note_objects(meta.get(OBJECTS_KEY, b"").decode())
        return [pickle.loads(b) for b in table.column(OBJECT_COLUMN).to_pylist()]
    layout = _thaw(json.loads(meta[LAYOUT_KEY]))
    kinds = _leaf_kinds(layout)
    cols = [_leaf_column(k, table.column(f"{LEAF_PREFIX}{j}"), n) for j, k in enumerate(kinds)]
    return ItemColumns(layout, cols, n)
