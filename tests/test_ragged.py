"""List and binary columns in the batch path: (values, offsets, valid) tensors, never one
Python object per row; per-sample iteration keeps the reference's Python values."""

from __future__ import annotations

from typing import Any

import lancedb
import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lance_ray
from lance_ray.read.convert import Columns, Ragged, ragged, to_columns

LIST_TYPES = {
    "list<int64>": (pa.list_(pa.int64()), st.integers(-2**62, 2**62)),
    "list<int32>": (pa.list_(pa.int32()), st.integers(-2**31, 2**31 - 1)),
    "large_list<float32>": (pa.large_list(pa.float32()),
                            st.floats(width=32, allow_nan=False)),
    "list<bool>": (pa.list_(pa.bool_()), st.booleans()),
    "list<uint8>": (pa.list_(pa.uint8()), st.integers(0, 255)),
}


@st.composite
def ragged_columns(draw: Any) -> tuple[pa.Array, list[Any]]:
    kind = draw(st.sampled_from([*LIST_TYPES, "binary", "large_binary"]))
    n = draw(st.integers(0, 30))
    if kind in LIST_TYPES:
        typ, values = LIST_TYPES[kind]
        rows = draw(st.lists(st.none() | st.lists(values, max_size=6), min_size=n, max_size=n))
    else:
        typ = pa.binary() if kind == "binary" else pa.large_binary()
        rows = draw(st.lists(st.none() | st.binary(max_size=8), min_size=n, max_size=n))
    arr = pa.array(rows, typ)
    lo = draw(st.integers(0, n))
    hi = draw(st.integers(lo, n))
    return arr.slice(lo, hi - lo), rows[lo:hi]


def decode(r: Ragged, binary: bool) -> list[Any]:
    values, offsets = r.values.tolist(), r.offsets.tolist()
    rows = [values[offsets[i]:offsets[i + 1]] if r.valid[i] else None for i in range(len(r))]
    return [bytes(x) if binary and x is not None else x for x in rows]


@settings(max_examples=300, deadline=None)
@given(ragged_columns(), st.data())
def test_ragged_columns_hold_every_row_nulls_and_empties_in_the_given_order(col, data):
    arr, rows = col
    n = len(rows)
    order = data.draw(st.none() | st.permutations(range(n)).map(
        lambda p: np.array(p, dtype=np.int64)))
    got = ragged(arr, order)
    assert got is not None
    want = rows if order is None else [rows[i] for i in order]
    binary = pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)
    assert got.offsets.dtype == torch.int64 and got.offsets[0] == 0
    assert len(got.offsets) == n + 1 and got.valid.dtype == torch.bool
    assert decode(got, binary) == want
    if binary:
        assert got.values.dtype == torch.uint8
    cut = data.draw(st.integers(0, n))
    parts = [got[:cut], got[cut:]]
    assert [decode(p, binary) for p in parts] == [want[:cut], want[cut:]]
    assert all(p.offsets[0] == 0 for p in parts)
    assert decode(Ragged.concat(parts), binary) == want
    got.values.add_(0) if got.values.dtype != torch.bool else None  # writable: no warning
    # A read arrives in chunks (one per fragment), converted straight from them.
    bounds = sorted({0, n, *data.draw(st.lists(st.integers(0, n), max_size=3))})
    chunked = pa.chunked_array([arr.slice(a, b - a) for a, b in zip(bounds, bounds[1:])],
                               arr.type)
    from_chunks = ragged(chunked, order)
    assert from_chunks is not None and decode(from_chunks, binary) == want
    assert torch.equal(from_chunks.offsets, got.offsets)
    assert torch.equal(from_chunks.valid, got.valid)


def test_list_elements_with_nulls_and_nested_lists_stay_python_lists():
    batch = pa.RecordBatch.from_pydict({
        "holes": pa.array([[1, None], [2]], pa.list_(pa.int64())),
        "nested": pa.array([[[1]], [[2, 3]]], pa.list_(pa.list_(pa.int64()))),
        "text": ["a", "b"],
    })
    cols = to_columns(batch)
    assert cols.batch() == {"holes": [[1, None], [2]], "nested": [[[1]], [[2, 3]]],
                            "text": ["a", "b"]}


def test_a_read_with_ragged_and_list_forms_of_a_column_joins_as_lists():
    ok = to_columns(pa.RecordBatch.from_pydict({"t": pa.array([[1], [2, 3]])}))
    holes = to_columns(pa.RecordBatch.from_pydict({"t": pa.array([[None], None])}))
    assert Columns.concat([ok, holes]).batch()["t"] == [[1], [2, 3], [None], None]


@pytest.fixture(scope="module")
def token_table(tmp_path_factory):
    rng = np.random.default_rng(0)
    n = 600
    lengths = rng.integers(0, 9, n)
    tokens = [None if i % 11 == 3 else rng.integers(0, 1000, k).tolist()
              for i, k in enumerate(lengths)]
    blobs = [None if i % 13 == 5 else rng.bytes(int(k)) for i, k in enumerate(lengths)]
    data = pa.table({"id": np.arange(n), "tokens": pa.array(tokens, pa.list_(pa.int32())),
                     "blob": pa.array(blobs, pa.binary())})
    root = tmp_path_factory.mktemp("tokens")
    return lancedb.connect(str(root)).create_table("tok", data), tokens, blobs


@pytest.mark.parametrize("reader", ["local", "ray"])
def test_batches_of_list_and_binary_columns_are_ragged_tensors_in_the_reference_order(
        request, token_table, reader):
    from lancedb.streaming import StreamingDataset as Reference

    if reader == "ray":
        request.getfixturevalue("ray_session")
    table, tokens, blobs = token_table
    kw = {"num_splits": 4, "shuffle_seed": 5}
    ref = list(Reference(table, **kw))
    ds = lance_ray.StreamingDataset(table, reader=reader, **kw)
    got_ids, got_tokens, got_blobs = [], [], []
    for b in ds.iter_batches(64):
        assert set(b["tokens"]) == {"values", "offsets", "valid"}
        assert b["tokens"]["values"].dtype == torch.int32
        got_ids += b["id"].tolist()
        got_tokens += decode(Ragged(**b["tokens"]), binary=False)
        got_blobs += decode(Ragged(**b["blob"]), binary=True)
    assert got_ids == [r["id"] for r in ref]
    assert got_tokens == [r["tokens"] for r in ref]
    assert got_blobs == [r["blob"] for r in ref]
    # One sample at a time: the reference's Python values.
    assert list(lance_ray.StreamingDataset(table, reader=reader, **kw)) == ref


def test_loader_workers_deliver_ragged_batches_in_order(token_table):
    from lancedb.streaming import StreamingDataset as Reference

    table, _, _ = token_table
    kw = {"num_splits": 4, "shuffle_seed": 5}
    ref = list(Reference(table, **kw))
    loader = lance_ray.StreamingDataLoader(lance_ray.StreamingDataset(table, reader="local",
                                                                      **kw),
                                           batch_size=50, num_workers=2)
    got = [t for b in loader for t in decode(Ragged(**b["tokens"]), binary=False)]
    assert got == [r["tokens"] for r in ref]
