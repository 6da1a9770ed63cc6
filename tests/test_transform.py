"""Transforms that fail: under "keep_slot" or "fill" every rank stays in lockstep and
checkpoints stay exact; errors keep their type; and the view's counters are exact."""

from __future__ import annotations

import pyarrow as pa
import pytest
from conformance import Path, check_resumes_exactly

import lance_ray
from lance_ray.read.transform import Skipped, TransformPolicy


def ids_unless_bad(batch: pa.RecordBatch) -> list[int]:
    """Fails on any batch holding an id with id % 7 == 3 (deterministic)."""
    ids = batch.column("id").to_pylist()
    if any(i % 7 == 3 for i in ids):
        raise ValueError("bad row")
    return ids


def make(table, rank=0, world_size=2, on_error="keep_slot", **kw):
    return lance_ray.StreamingDataset(table, num_splits=8, rank=rank, world_size=world_size,
                                      transform=ids_unless_bad, on_transform_error=on_error,
                                      reader="local", read_batch_size=50, **kw)


def test_keep_slot_keeps_every_rank_at_the_same_number_of_steps(table_1k):
    per_rank = [list(make(table_1k, r).iter_batches(16, collate_fn=list)) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 1000 // 8 * 8 // 2 // 16 + 1
    got = sorted(i for batches in per_rank for b in batches for i in b)
    planned = sorted(r["id"] for r in lance_ray.StreamingDataset(table_1k, num_splits=8,
                                                                 reader="local"))
    assert got == [i for i in planned if i % 7 != 3]


def test_keep_slot_counts_are_exact_and_resume_is_exact(table_1k):
    path = Path("keep_slot iter_batches", lambda v: v.iter_batches(16, collate_fn=list), list,
                boundaries=3)
    run = check_resumes_exactly(lambda: make(table_1k), path, also=[10])
    ds = make(table_1k)
    it = ds.iter_batches(16, collate_fn=list)
    before = [i for _ in range(10) for i in next(it)]
    state = ds.state_dict()
    assert state == run.states[10] and before == [i for b in run.whole[:10] for i in b]
    # Rank 0 owns splits 0-3: 160 slots, skipped ones included (and, in lockstep, rank 1's
    # splits follow from them: failed rows keep their slots).
    assert sum(state["samples_consumed_per_split"][:4]) == 160
    assert state["lance_ray"]["lockstep"] is True
    assert ds.stats.rows == 160 and ds.stats.batches == 10
    assert ds.stats.rows_skipped == 160 - len(before)


def test_fill_delivers_the_fill_value_in_place_of_failed_samples(table_1k):
    rows = list(make(table_1k, on_error="fill", fill_value=-1))
    assert len(rows) == 1000 // 8 * 8 // 2
    assert all(r == -1 or r % 7 != 3 for r in rows) and -1 in rows


def test_raise_propagates_and_a_callable_can_refuse_to_skip(table_1k):
    with pytest.raises(ValueError, match="bad row"):
        list(make(table_1k, on_error="raise"))
    with pytest.raises(ValueError, match="bad row"):
        list(make(table_1k, on_error=lambda e: False))
    assert len(list(make(table_1k, on_error=lambda e: True))) < 500


def test_a_transform_breaking_the_one_item_per_row_contract_is_never_skipped():
    policy = TransformPolicy(lambda b: [1], "skip")
    batch = pa.RecordBatch.from_pydict({"id": [1, 2]})
    with pytest.raises(ValueError, match="one item per input row"):
        policy.resolve(policy(batch), lambda lo, hi: "")


def lazily(batch: pa.RecordBatch):
    """A generator transform: its rows' errors come while its output is iterated."""
    for i in batch.column("id").to_pylist():
        if i % 7 == 3:
            raise ValueError("bad row")
        yield i


class TwoArgError(Exception):
    """Does not survive pickle as it is: its __init__ takes other arguments than its args."""

    def __init__(self, row: int, why: str):
        super().__init__(f"row {row}: {why}")


def fails_two_args(batch: pa.RecordBatch) -> list[int]:
    ids = batch.column("id").to_pylist()
    for i in ids:
        if i % 7 == 3:
            raise TwoArgError(i, "corrupt")
    return ids


def only_two_arg_errors(error: Exception) -> bool:
    return isinstance(error, TwoArgError)


def test_a_generator_transform_skips_and_raises_as_a_list_returning_one(table_1k):
    """The reference lists the output inside its try: a generator's row errors are the
    transform's own (skipped per row), not a broken contract."""
    ds = lambda tf, err: lance_ray.StreamingDataset(  # noqa: E731
        table_1k, num_splits=8, transform=tf, on_transform_error=err, reader="local")
    expected = list(ds(ids_unless_bad, "skip"))
    assert list(ds(lazily, "skip")) == expected and len(expected) < 1000
    with pytest.raises(ValueError, match="bad row"):  # the transform's own error, as it was
        list(ds(lazily, "raise"))


def test_fill_gives_each_failed_row_its_own_copy(table_1k):
    rows = list(make(table_1k, on_error="fill", fill_value=[0]))
    filled = [r for r in rows if isinstance(r, list)]
    filled[0].append(1)  # the consumer changes one in place
    assert len(filled) > 1 and all(r == [0] for r in filled[1:])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_handler_sees_the_transforms_exception_type_across_workers(table_1k, num_workers):
    """An exception that pickle cannot rebuild as it is still reaches the handler as its
    own type (sent by its parts), so the handler skips what it means to skip."""
    def ds():
        return lance_ray.StreamingDataset(table_1k, num_splits=8, transform=fails_two_args,
                                          on_transform_error=only_two_arg_errors,
                                          reader="local")

    loader = lance_ray.StreamingDataLoader(ds(), batch_size=50, num_workers=num_workers)
    ids = [int(i) for b in loader for i in b]
    assert ids == list(ds()) and not any(i % 7 == 3 for i in ids)  # as read in-process


def test_keep_slot_works_through_ray_data_tasks(ray_session, table_1k):
    ds = lance_ray.StreamingDataset(table_1k, num_splits=8, transform=ids_unless_bad,
                                    on_transform_error="keep_slot", read_batch_size=100)
    rows = list(ds)
    assert rows and all(r % 7 != 3 for r in rows)
    assert ds.stats.rows_skipped == 1000 // 8 * 8 - len(rows)
    assert not any(isinstance(r, Skipped) for r in rows)


def test_on_transform_error_without_a_transform_is_refused(table_1k):
    with pytest.raises(ValueError, match="needs a transform"):
        lance_ray.StreamingDataset(table_1k, on_transform_error="skip", reader="local")
    with pytest.raises(ValueError, match="on_transform_error must be one of"):
        lance_ray.StreamingDataset(table_1k, transform=ids_unless_bad,
                                   on_transform_error="bogus", reader="local")


def test_view_stats_count_rows_bytes_and_batches_exactly(table_1k):
    ds = lance_ray.StreamingDataset(table_1k, num_splits=4, reader="local", columns=["id"])
    batches = list(ds.iter_batches(100))
    assert ds.stats.rows == 1000 and ds.stats.batches == len(batches) == 10
    assert ds.stats.bytes == 1000 * 8  # int64 ids
    assert ds.stats.rows_per_s > 0 and ds.stats.wait_s >= 0


class FailsOn:
    """A transform that fails on the batch holding ``bad`` (module level: Ray ships it)."""

    def __init__(self, bad: int):
        self.bad = bad

    def __call__(self, batch: pa.RecordBatch) -> list[int]:
        ids = batch.column("id").to_pylist()
        if self.bad in ids:
            raise ValueError("bad row")
        return ids


def test_an_error_the_caller_keeps_keeps_no_reads_running(ray_session, table_1k):
    """A caller that keeps the exception (``except ... as e``, a notebook's last error)
    keeps the traceback's frames: the reads they drew from are closed all the same."""
    import threading
    import time

    order = list(lance_ray.StreamingDataset(table_1k, num_splits=8, reader="local"))
    ds = lance_ray.StreamingDataset(table_1k, num_splits=8, transform=FailsOn(order[-50]["id"]),
                                    on_transform_error="raise", read_batch_size=50)
    kept = None
    try:
        for _ in ds.iter_batches(10, collate_fn=list):
            pass
    except ValueError as e:
        kept = e
    assert kept is not None and "bad row" in str(kept)
    deadline = time.monotonic() + 10
    while (readers := [t.name for t in threading.enumerate()
                       if t.name.startswith("lance_ray_read")]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert readers == []
