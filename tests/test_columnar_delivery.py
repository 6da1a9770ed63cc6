"""Transform items through the real readers: stacked where the transform runs, delivered as
exactly the batches default_collate gives for the reference's items, in its order."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from lancedb.streaming import StreamingDataset as Reference
from test_items import assert_same
from torch.utils.data import default_collate

import lance_ray
from lance_ray.read import ray_data, ray_tasks
from lance_ray.read.items import ItemColumns

KW = {"num_splits": 4, "shuffle_seed": 1}


def to_arrays(batch):
    ids = batch.column("id").to_numpy()
    v = batch.column("v").flatten().to_numpy().reshape(len(ids), -1)
    return [{"v": v[i] * 2, "id": int(ids[i]), "tag": f"r{ids[i]}",
             "pair": (np.int16(ids[i]), float(ids[i]) / 3)} for i in range(len(ids))]


class Box:
    def __init__(self, i: int):
        self.i = i

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Box) and other.i == self.i


def to_boxes(batch):
    return [Box(i) for i in batch.column("id").to_pylist()]


def odd_fails(batch):
    ids = batch.column("id").to_numpy()
    if ids.size and ids[ids % 97 == 1].size:
        if len(ids) == 1:
            raise ValueError(f"bad row {ids[0]}")
        raise ValueError("retry me row by row")
    return [np.full(3, i, np.float32) for i in ids]


@pytest.fixture(scope="module")
def table(table_factory):
    return table_factory(1500, 3)


def expected_batches(items, size):
    return [default_collate(items[i:i + size]) for i in range(0, len(items), size)]


@pytest.mark.parametrize("reader, workers", [("local", None), ("ray", None), ("local", 2)])
def test_transform_batches_are_default_collate_of_the_reference_items(
        request, table, monkeypatch, reader, workers):
    if reader == "ray":
        request.getfixturevalue("ray_session")
    seen = []
    decode = ray_data.from_arrow
    monkeypatch.setattr(ray_data, "from_arrow", lambda t: seen.append(decode(t)) or seen[-1])
    items = list(Reference(table, transform=to_arrays, **KW))
    ds = lance_ray.StreamingDataset(table, transform=to_arrays, reader=reader, **KW)
    batches = (ds.iter_batches(128) if workers is None
               else lance_ray.StreamingDataLoader(ds, batch_size=128, num_workers=workers))
    got = list(batches)
    want = expected_batches(items, 128)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w)
    if reader == "ray":  # the items crossed the object store as columns, not pickles
        assert seen and all(isinstance(p, ItemColumns) for p in seen)
    # One sample at a time: the reference's items, types and all.
    assert_same(list(lance_ray.StreamingDataset(table, transform=to_arrays, reader=reader,
                                                **KW)), items)


@pytest.mark.parametrize("reader", ["local", "ray"])
def test_items_without_a_tensor_form_arrive_whole_and_are_noted_once(
        request, table, caplog, reader):
    if reader == "ray":
        request.getfixturevalue("ray_session")
    from lance_ray.read import items as items_module

    items_module._noted.clear()
    caplog.set_level(logging.INFO, logger="lance_ray.read.items")
    ds = lance_ray.StreamingDataset(table, transform=to_boxes, reader=reader,
                                    read_batch_size=256, **KW)
    got = [b for batch in ds.iter_batches(100, collate_fn=list) for b in batch]
    assert got == list(Reference(table, transform=to_boxes, **KW))
    notes = [r for r in caplog.records if "travel as Python objects" in r.getMessage()]
    assert len(notes) == 1 and "Box" in notes[0].getMessage()


@pytest.mark.parametrize("on_error", ["keep_slot", "fill"])
@pytest.mark.parametrize("reader", ["local", "ray"])
def test_reads_with_failed_rows_keep_the_policy_next_to_columnar_reads(
        request, table, reader, on_error):
    if reader == "ray":
        request.getfixturevalue("ray_session")
    fill = np.full(3, -1, np.float32)
    ds = lance_ray.StreamingDataset(table, transform=odd_fails, on_transform_error=on_error,
                                    fill_value=fill, reader=reader, read_batch_size=256, **KW)
    ids = [r["id"] for r in Reference(table, **KW)]
    items = [np.full(3, i, np.float32) if i % 97 != 1 else fill for i in ids]
    if on_error == "keep_slot":
        want = [default_collate([x for x, i in zip(items[lo:lo + 100], ids[lo:lo + 100])
                                 if i % 97 != 1]) for lo in range(0, len(ids), 100)]
    else:
        want = expected_batches(items, 100)
    got = list(ds.iter_batches(100))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w)


def test_ray_reads_ship_lances_order_and_the_consumer_gathers_plan_order(tmp_path, ray_session):
    """Plain tensor reads skip the reorder in the read task (a copy of every byte); each row
    carries its stream position and the conversion's one copy puts the rows in plan order:
    the batches equal the local reader's for numeric, ragged and list columns."""
    import lancedb
    import pyarrow as pa
    import torch

    from lance_ray.read.requests import ChunkRequest

    ids = np.arange(300, dtype=np.int64)
    table = lancedb.connect(str(tmp_path)).create_table("t", pa.table({
        "id": ids, "blob": pa.array([bytes([i % 251]) * (i % 7) for i in ids.tolist()]),
        "text": pa.array([f"r{i}" for i in ids.tolist()])}))
    kw = {"num_splits": 3, "shuffle_seed": 5}

    local = list(lance_ray.StreamingDataset(table, reader="local", **kw).iter_batches(64))
    ds = lance_ray.StreamingDataset(table, reader="ray", **kw)
    for got, want in zip(ds.iter_batches(64), local, strict=True):
        assert got.keys() == want.keys()
        for name, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[name], value), name
            elif isinstance(value, dict):  # ragged: values and offsets
                assert all(torch.equal(got[name][k], value[k]) for k in value), name
            else:
                assert got[name] == value, name

    # The task's block: rows in ascending address order, each with its plan position.
    ref = ds._table  # the pinned TableRef the read tasks get
    plan_ids = np.array([7, 250, 3, 120, 9], dtype=np.uint64)
    request = ChunkRequest(((10, 15),), plan_ids)
    block = next(ray_tasks.read_block(ref, ["id"], None, request, 1 << 20))
    seq = block.column(ray_tasks.SEQ_COLUMN).to_numpy()
    assert block.column("id").to_pylist() == [3, 7, 9, 120, 250]
    assert seq.tolist() == [12, 10, 14, 13, 11]
    # A block over the size Ray Data may slice comes in plan order (slices stay in order).
    block = next(ray_tasks.read_block(ref, ["id"], None, request, 16))
    assert block.column("id").to_pylist() == [7, 250, 3, 120, 9]
    assert block.column(ray_tasks.SEQ_COLUMN).to_pylist() == [10, 11, 12, 13, 14]
