"""Arrow -> tensors for the batch path (pure, no table)."""

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lance_ray.read.convert import Columns, to_columns


def _batch(n: int = 6) -> pa.RecordBatch:
    ids = np.arange(n, dtype=np.int64)
    return pa.RecordBatch.from_pydict({
        "id": ids,
        "x": pa.array(ids.astype(np.float32) / 2),
        "v": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 3).astype(np.float32)), 3),
        "name": pa.array([f"r{i}" for i in ids]),
        "maybe": pa.array([None if i % 2 else float(i) for i in ids]),
        "flag": pa.array([bool(i % 3) for i in ids]),
    })


@pytest.mark.parametrize("order", [None, [5, 0, 3, 1, 4, 2]])
def test_columns_hold_the_rows_in_the_given_order(order):
    batch = _batch()
    cols = to_columns(batch, None if order is None else np.array(order))
    want = list(range(6)) if order is None else order
    assert cols.num_rows == 6 and cols.nbytes == batch.nbytes
    assert cols.data["id"].dtype == torch.int64 and cols.data["id"].tolist() == want
    assert cols.data["x"].tolist() == [i / 2 for i in want]
    assert cols.data["v"].shape == (6, 3) and cols.data["v"][:, 0].tolist() == want
    assert cols.data["flag"].dtype == torch.bool
    assert cols.data["name"] == [f"r{i}" for i in want]  # no tensor form: a list
    assert cols.data["maybe"] == [None if i % 2 else float(i) for i in want]


@settings(deadline=None, max_examples=100)
@given(st.integers(0, 40), st.lists(st.integers(0, 40), max_size=4), st.booleans(),
       st.randoms(use_true_random=False))
def test_a_chunked_read_converts_to_the_rows_of_its_combined_batch(n, cuts, shuffle, rnd):
    # A read arrives as one chunk per fragment; the conversion copies straight from the
    # chunks, and must give exactly what converting the combined batch gives.
    batch = _batch(n)
    bounds = sorted({0, n, *(min(c, n) for c in cuts)})
    table = pa.Table.from_batches([batch.slice(a, b - a) for a, b in zip(bounds, bounds[1:])],
                                  schema=batch.schema)
    order = np.array(rnd.sample(range(n), n), dtype=np.int64) if shuffle else None
    got, want = to_columns(table, order), to_columns(batch, order)
    assert got.num_rows == want.num_rows == n
    for name, value in want.data.items():
        if isinstance(value, torch.Tensor):
            assert got.data[name].dtype == value.dtype and torch.equal(got.data[name], value)
            got.data[name].reshape(-1)[:1] = 0  # writable, never Arrow's memory
        else:
            assert got.data[name] == value


def test_tensors_are_writable_copies_never_arrow_memory():
    batch = _batch()
    cols = to_columns(batch)
    cols.data["v"][0, 0] = 99.0  # Arrow buffers are read-only (shared memory under Ray)
    assert batch.column("v").flatten()[0].as_py() == 0.0


def test_slices_share_the_chunk_and_concat_restores_it():
    cols = to_columns(_batch(10))
    parts = [cols[0:3], cols[3:3], cols[3:10]]
    assert [len(p) for p in parts] == [3, 0, 7]
    assert parts[0].data["v"].data_ptr() == cols.data["v"].data_ptr()  # a view, not a copy
    joined = Columns.concat(parts)
    assert joined.num_rows == 10 and joined.nbytes == pytest.approx(cols.nbytes, abs=2)
    for name, value in cols.data.items():
        got = joined.data[name]
        assert (got == value).all() if isinstance(value, torch.Tensor) else got == value


@pytest.mark.parametrize(("dtype", "grad"), [
    (torch.int64, False), (torch.float32, False), (torch.bool, False), (torch.uint8, False),
    (torch.bfloat16, False), (torch.float32, True), (torch.bfloat16, True)])
def test_concat_of_tensor_parts_equals_torch_cat_for_any_dtype(dtype, grad):
    # Parts are joined by numpy (no torch threads); what numpy cannot view (bfloat16, a
    # transform's tensor that needs grad) goes through torch.cat, with the same result.
    parts = [torch.arange(n * 2).reshape(n, 2).to(dtype).requires_grad_(grad) for n in (3, 0, 4)]
    got = Columns.concat([Columns({"t": p}, len(p), 0) for p in parts]).data["t"]
    want = torch.cat(parts)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_strings_and_nulls_keep_their_rows_through_reads_and_loader_workers(tmp_path):
    import lancedb
    from lancedb import streaming as reference

    import lance_ray

    ids = np.arange(3000, dtype=np.int64)
    table = lancedb.connect(str(tmp_path)).create_table("t", pa.table({
        "id": ids, "name": [f"r{i}" for i in ids],
        "maybe": [None if i % 7 == 0 else float(i) for i in ids]}))
    kw = {"num_splits": 4, "shuffle_seed": 3, "world_size": 2, "rank": 1}
    expected = [r["id"] for r in reference.StreamingDataset(table, **kw)]
    for workers in (0, 2):
        ds = lance_ray.StreamingDataset(table, reader="local", **kw)
        got = []
        for b in lance_ray.StreamingDataLoader(ds, batch_size=100, num_workers=workers):
            batch_ids = b["id"].tolist()
            assert b["name"] == [f"r{i}" for i in batch_ids]
            assert b["maybe"] == [None if i % 7 == 0 else float(i) for i in batch_ids]
            got += batch_ids
        assert got == expected


@pytest.mark.parametrize("column", [
    pa.array([None, 1.5, 2.5], pa.float32()),
    pa.array([None, 1, 2], pa.int64()),
    pa.array([[1, None], [2, 3], [4, 5]], pa.list_(pa.int32(), 2)),  # a null element
])
def test_a_batch_joining_reads_with_and_without_nulls_is_lists_and_says_so(column, caplog):
    """A numeric column is a tensor in a read without nulls and Python values in one with
    (never NaN-filled floats): a batch spanning both holds the rows' values, once warned."""
    import lance_ray.read.convert as convert

    convert._told_nulls.discard("x")
    clean = pa.RecordBatch.from_pydict({"x": column.slice(1)})
    with_null = pa.RecordBatch.from_pydict({"x": column.slice(0, 1)})
    with caplog.at_level("WARNING", logger="lance_ray"):
        parts = [to_columns(clean), to_columns(with_null), to_columns(clean)]
        to_columns(with_null)
    assert isinstance(parts[0].data["x"], torch.Tensor)
    joined = Columns.concat(parts).batch()["x"]
    assert joined == column.slice(1).to_pylist() + column.slice(0, 1).to_pylist() \
        + column.slice(1).to_pylist()
    assert caplog.text.count("column 'x' holds nulls") == 1
