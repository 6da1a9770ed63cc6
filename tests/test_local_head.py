"""The Ray reader's local head: its first reads are made in this process while the Ray Data
pipeline starts, and a started iterator hands over exactly what it would have. Also: the
pipeline's read tasks ship by reference."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import consecutive_requests

from lance_ray.read.ahead import Started
from lance_ray.read.ray_data import LOCAL_HEAD_BYTES, RayDataReader
from lance_ray.read.requests import ReadSizing


def _reader(transform=None, **kw) -> RayDataReader:
    return RayDataReader(None, None, transform, sizing=ReadSizing(1 << 16, row_bytes=1024),
                         **kw)


def test_the_head_is_the_first_requests_within_the_byte_budget():
    per = LOCAL_HEAD_BYTES // 1024  # rows of one budget
    assert _reader().local_head(consecutive_requests([per // 4] * 10)) == 4
    assert _reader().local_head(consecutive_requests([per + 1, 5])) == 0
    # At most half: the rest of a pass always goes through Ray Data, the reader asked for.
    assert _reader().local_head(consecutive_requests([3, 4, 5])) == 1
    assert _reader().local_head(consecutive_requests([3])) == 0


def test_no_head_when_ray_remote_args_say_where_the_work_runs():
    assert _reader(ray_remote_args={"num_cpus": 1}).local_head(consecutive_requests([3, 4])) == 0


def test_no_head_when_the_row_width_is_unknown():
    # A remote table's rows have no known width: the head's bytes could not be bounded.
    reader = RayDataReader(None, None, None, sizing=ReadSizing(1 << 16))
    assert reader.local_head(consecutive_requests([3, 4, 5, 6])) == 0


def test_a_started_iterator_yields_every_item_in_order_and_its_error():
    def items():
        yield from range(5)
        raise KeyError("boom")

    it = Started(items())
    assert [next(it) for _ in range(5)] == list(range(5))
    with pytest.raises(KeyError, match="boom"):
        next(it)


def test_a_started_iterator_computes_its_first_item_before_it_is_asked():
    began = threading.Event()

    def items():
        began.set()
        yield 1

    it = Started(items())
    assert began.wait(10)
    assert list(it) == [1]


def test_closing_a_started_iterator_waits_for_its_start_and_closes_it():
    closed = []

    def items():
        try:
            yield 1
            yield 2
        finally:
            closed.append(True)

    it = Started(items())
    it.close()  # never asked for an item
    assert closed == [True]
    with pytest.raises(StopIteration):
        next(it)


def test_read_tasks_pickle_without_cloudpickle(table_1k):
    """The standard pickle cannot pickle closures: a read task that passes it ships a
    module-level function by reference, not its code once per task."""
    import pickle

    import lance_ray
    from lance_ray.read.ray_tasks import datasource_cls

    pytest.importorskip("ray.data")
    table = lance_ray.StreamingDataset(table_1k, reader="local")._table
    source = datasource_cls()(table, ["id"], consecutive_requests([3, 5]))
    tasks = source.get_read_tasks(1)
    shipped = [pickle.loads(pickle.dumps(t._read_fn)).args[3] for t in tasks]
    assert [c.spans for c in shipped] == [((0, 3),), ((3, 8),)]
    assert all(np.array_equal(a.row_ids, b.row_ids) for a, b in zip(shipped, source._chunks))
