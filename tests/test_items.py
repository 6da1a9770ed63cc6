"""Columnar transform items (pure, no table): what a batch of columns gives is exactly what
torch's default_collate gives for the items, and the items rebuild as they were."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

from lance_ray.read.items import (
    ItemColumns,
    NoTensorForm,
    _flatten,
    as_columns,
    columnar,
    from_arrow,
    to_arrow,
)

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "float16",
          "float32", "float64"]


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """Same types, dtypes, shapes and values, all the way down."""
    assert type(got) is type(want), (path, type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(got, want), path
    elif isinstance(want, (np.ndarray, np.generic)):
        assert got.dtype == want.dtype and np.shape(got) == np.shape(want), path
        assert np.array_equal(got, want), path
    else:
        assert got == want, path


def leaf_maker(draw: Any) -> Any:
    """A function i -> the leaf value of item i, all of one kind, dtype and shape."""
    kind = draw(st.sampled_from(["ndarray", "tensor", "npscalar", "int", "float", "bool",
                                 "str", "bytes"]))
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    seed = draw(st.integers(0, 2**16))

    def value(i: int) -> Any:
        rng = np.random.default_rng(seed + i)
        arr = np.asarray(rng.random(shape) * 100).astype(dtype)
        if kind == "ndarray":
            return arr
        if kind == "tensor":
            return torch.from_numpy(arr.copy())
        if kind == "npscalar":
            return dtype.type(rng.random() * 100)
        if kind == "int":
            return int(rng.integers(-2**40, 2**40))
        if kind == "float":
            return float(rng.random())
        if kind == "bool":
            return bool(rng.integers(2))
        text = "".join(chr(c) for c in rng.integers(32, 0x2FF, int(rng.integers(0, 6))))
        return text if kind == "str" else text.encode()

    return value


@st.composite
def item_makers(draw: Any, depth: int = 0) -> Any:
    """A function i -> item i; every item has the same layout."""
    shape = draw(st.sampled_from(["leaf", "leaf", "dict", "list", "tuple"] if depth < 2
                                 else ["leaf"]))
    if shape == "leaf":
        return leaf_maker(draw)
    children = draw(st.lists(item_makers(depth + 1), max_size=3))
    if shape == "dict":
        keys = draw(st.lists(st.text(min_size=1, max_size=4), min_size=len(children),
                             max_size=len(children), unique=True))
        return lambda i: {k: c(i) for k, c in zip(keys, children)}
    kind = list if shape == "list" else tuple
    return lambda i: kind(c(i) for c in children)


@settings(max_examples=300, deadline=None)
@given(item_makers(), st.integers(1, 9), st.data())
def test_columns_collate_and_rebuild_exactly_like_the_items(make, n, data):
    items = [make(i) for i in range(n)]
    cols = columnar(items)
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    assert_same(cols.items(), items)
    try:
        want = default_collate(items[lo:hi])
    except (TypeError, RuntimeError):
        return  # e.g. a list of ragged children: the reader keeps such items as a list
    assert_same(cols[lo:hi].collated(), want)
    wire = from_arrow(to_arrow(cols).slice(lo, hi - lo))
    assert isinstance(wire, ItemColumns)
    assert_same(wire.collated(), want)
    assert_same(wire.items(), items[lo:hi])
    # A block may reach the trainer in several chunks: each is copied straight into the
    # items' arrays, which are writable (torch) and hold none of the block's memory.
    whole = to_arrow(cols)
    cut = data.draw(st.integers(0, n))
    chunked = from_arrow(pa.concat_tables([whole.slice(0, cut), whole.slice(cut)])
                         .slice(lo, hi - lo))
    assert isinstance(chunked, ItemColumns)
    assert_same(chunked.items(), items[lo:hi])
    for col in chunked.columns:
        if isinstance(col, np.ndarray):
            owner = col if col.base is None else col.base
            assert col.flags.writeable and owner.flags.owndata
    joined = ItemColumns.concat([cols[:lo], cols[lo:]])
    assert joined is not None
    assert_same(joined.items(), items)


@settings(max_examples=300, deadline=None)
@given(item_makers(), item_makers(), st.integers(2, 6), st.data())
def test_one_item_of_another_layout_keeps_the_read_a_list(make, other, n, data):
    items = [make(i) for i in range(n)]
    odd = data.draw(st.integers(1, n - 1))
    items[odd] = other(odd)
    try:
        differs = _flatten(items[odd], []) != _flatten(items[0], [])
    except NoTensorForm:
        differs = True
    if differs:
        with pytest.raises(NoTensorForm):
            columnar(items)
    else:
        assert_same(columnar(items).items(), items)


@pytest.mark.parametrize("items, why", [
    ([{"a": 1}, {"b": 1}], "differ"),
    ([np.zeros(2), np.zeros(3)], "differ"),
    ([np.zeros(2, np.float32), np.zeros(2, np.float64)], "differ"),
    ([object(), object()], "object"),
    ([None, None], "NoneType"),
    ([{1: 2}], "not str"),
    ([np.array(["a"])], "dtype"),
    ([np.zeros(2, np.uint64)], "dtype"),
    ([torch.zeros(2, dtype=torch.bfloat16)], "bfloat16"),
    ([torch.zeros(2, requires_grad=True)], "grad"),
    ([2**70], "int64"),
])
def test_items_without_one_tensor_layout_stay_a_list(items, why):
    with pytest.raises(NoTensorForm, match=why):
        columnar(items)
    got, why = as_columns(items, failed=False)
    assert got is items and why


def test_a_read_with_failed_rows_stays_a_list_for_the_error_policy():
    items = [np.zeros(2), np.zeros(2)]
    assert as_columns(items, failed=True) == (items, "")
    assert isinstance(as_columns(items, failed=False)[0], ItemColumns)


def test_objects_cross_arrow_as_pickles_and_come_back_equal():
    class Box:
        def __init__(self, v: int):
            self.v = v

    items = [Box(i) for i in range(5)]
    table = to_arrow(items, "items holding Box")
    back = from_arrow(table.slice(1, 3))
    assert [b.v for b in back] == [1, 2, 3]


def test_arrow_leaves_are_zero_copy_and_decoded_arrays_writable():
    images = [np.full((4, 4, 3), i, np.uint8) for i in range(6)]
    cols = columnar(images)
    table = to_arrow(cols)
    flat = table.column(0).chunk(0).flatten()
    assert flat.buffers()[1].address == cols.columns[0].ctypes.data  # no copy on the way out
    back = from_arrow(table)
    assert isinstance(back, ItemColumns) and back.columns[0].flags.writeable
    batch = back.collated()
    assert batch.shape == (6, 4, 4, 3) and batch.dtype == torch.uint8
    assert isinstance(table.schema.field(0).type, pa.FixedSizeListType)


def test_the_bytes_of_string_and_bytes_leaves_count():
    columns = columnar([{"id": i, "blob": bytes(1000), "text": "é" * 10} for i in range(4)])
    assert columns.nbytes == 4 * 8 + 4 * (1000 + 8) + 4 * (20 + 8)
