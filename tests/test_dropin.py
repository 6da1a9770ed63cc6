"""``lance_ray.StreamingDataset`` as a drop-in for ``lancedb.streaming.StreamingDataset``.

Invariant: code written for the reference behaves the same with ``from lance_ray import
StreamingDataset``: its arguments are accepted, one rank's checkpoint resumes every rank,
plain DataLoader workers share a rank's splits, failed rows drop out exactly as in the
reference, errors keep their type, its counters exist, one iterator runs at a time. The
reference itself (installed) is the oracle wherever the contract is shared. Real Lance
tables; Ray only where named.
"""

from __future__ import annotations

import logging
from typing import Any
from unittest import mock

import pyarrow as pa
import pytest
import torch
from conformance import Path, batch_ids, check_resumes_exactly
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lancedb import streaming as reference

import lance_ray
from lance_ray.state.format import parse_state
from lance_ray.topology import rank_splits, valid_world_sizes

SPLITS = 12
SEED = 42
ROWS = 120
PROPERTY = settings(deadline=None, max_examples=12,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@pytest.fixture(scope="module")
def table(table_factory):
    return table_factory(ROWS, 2)


class BadRowError(ValueError):
    """What the failing transform raises (module level: Ray and loader workers import it)."""


class FailOn:
    """A transform that fails on any batch holding one of ``bad`` (picklable)."""

    def __init__(self, bad):
        self.bad = frozenset(bad)

    def __call__(self, batch: pa.RecordBatch) -> list[dict[str, int]]:
        ids = batch.column("id").to_pylist()
        if self.bad.intersection(ids):
            raise BadRowError(f"bad ids {sorted(self.bad.intersection(ids))}")
        return [{"id": i} for i in ids]


class CollateFailsOn:
    """A collate_fn that fails on any batch holding id ``bad`` (picklable: workers use it)."""

    def __init__(self, bad: int):
        self.bad = bad

    def __call__(self, rows):
        from torch.utils.data import default_collate

        if any(r["id"] == self.bad for r in rows):
            raise KeyError(f"bad id {self.bad}")
        return default_collate(rows)


def ours(table, **kw) -> lance_ray.StreamingDataset:
    kw = {"num_splits": SPLITS, "shuffle_seed": SEED, "reader": "local", **kw}
    return lance_ray.StreamingDataset(table, **kw)


def theirs(table, **kw) -> Any:
    kw = {"num_splits": SPLITS, "shuffle_seed": SEED, "columns": ["id"], **kw}
    return reference.StreamingDataset(table, **kw)


def ids(rows) -> list[int]:
    return [r["id"] for r in rows]


def global_steps(datasets, per_rank: int, even: bool = True) -> list[frozenset[int]]:
    """Drain ranks in lockstep, ``per_rank`` samples each per global step (``even``: and
    check that they run out together)."""
    its = [iter(d) for d in datasets]
    steps = []
    while True:
        parts = [[r["id"] for _, r in zip(range(per_rank), it)] for it in its]
        if not any(parts):
            return steps
        assert not even or len({len(p) for p in parts}) == 1, "ranks ran out apart"
        steps.append(frozenset(i for p in parts for i in p))


def run_steps(datasets, per_rank: int, steps: int) -> list[frozenset[int]]:
    its = [iter(d) for d in datasets]
    out = [frozenset(next(it)["id"] for it in its for _ in range(per_rank))
           for _ in range(steps)]
    for it in its:
        it.close()
    return out


# ----------------------------------------------------------------------- 1. one rank's state


@pytest.mark.parametrize("before,after", [(2, 2), (1, 4), (2, 1), (4, 2), (3, 6), (6, 3),
                                          (12, 1), (2, 3)])
@pytest.mark.parametrize("global_batch", [SPLITS, 3 * SPLITS // 2, 2 * SPLITS])
def test_one_ranks_own_state_resumes_every_rank_of_any_world_size_exactly(
        table, before, after, global_batch):
    if global_batch % before or global_batch % after:
        pytest.skip("the global batch must split evenly over the ranks")
    full = global_steps([ours(table, rank=r, world_size=before) for r in range(before)],
                        global_batch // before)
    done = 3
    first = [ours(table, rank=r, world_size=before) for r in range(before)]
    head = run_steps(first, global_batch // before, done)
    state = first[-1].state_dict()  # any one rank's own state, loaded on every new rank
    assert parse_state(state).loadable_anywhere  # lockstep (or, on one rank, complete)
    resumed = [ours(table, rank=r, world_size=after) for r in range(after)]
    for ds in resumed:
        ds.load_state_dict(state)
    # A mid-cycle state (global batch not a multiple of the splits) leaves the new ranks
    # with unequal shares, as in the reference: only the union is then pinned.
    rest = global_steps(resumed, global_batch // after, even=global_batch % SPLITS == 0)
    assert head == full[:done]
    if global_batch % SPLITS == 0:  # then the steps are the same sets on every world size
        assert rest == full[done:]
    seen = [i for step in head + rest for i in step]
    assert sorted(seen) == list(range(ROWS))


def test_every_rank_reports_the_same_reference_state_at_a_global_step(table):
    ranks = [ours(table, rank=r, world_size=4) for r in range(4)]
    refs = [theirs(table, rank=r, world_size=4) for r in range(4)]
    run_steps(ranks, 3, 4)
    run_steps(refs, 3, 4)
    top = {k: v for k, v in ranks[0].state_dict().items() if k != "lance_ray"}
    for ds in ranks[1:]:
        assert {k: v for k, v in ds.state_dict().items() if k != "lance_ray"} == top
    assert top == refs[0].state_dict()


def test_one_ranks_state_loads_in_the_reference_on_every_rank(table):
    first = [ours(table, rank=r, world_size=2) for r in range(2)]
    head = run_steps(first, 6, 4)
    state = first[0].state_dict()
    resumed = [theirs(table, rank=r, world_size=4) for r in range(4)]
    for ds in resumed:
        ds.load_state_dict(state)
    rest = global_steps(resumed, 3)
    assert sorted(i for s in head + rest for i in s) == list(range(ROWS))


# ----------------------------------------------------------------------- 2./3. workers


class Worker:
    """What ``worker_info_override`` takes: torch's WorkerInfo's two fields."""

    def __init__(self, id: int, num_workers: int):
        self.id, self.num_workers = id, num_workers


@pytest.mark.parametrize("world_size,workers", [(1, 2), (1, 3), (1, 4), (2, 2), (2, 3)])
def test_simulated_workers_read_what_the_reference_gives_each_worker(table, world_size,
                                                                     workers):
    seen = []
    for rank in range(world_size):
        for w in range(workers):
            kw = {"rank": rank, "world_size": world_size,
                  "worker_info_override": Worker(w, workers)}
            got = ids(ours(table, **kw))
            assert got == ids(theirs(table, **kw))
            seen += got
    assert sorted(seen) == list(range(ROWS))  # disjoint shares, every sample once


def test_a_simulated_workers_state_resumes_every_worker_and_other_worker_counts(table):
    first = [ours(table, worker_info_override=Worker(w, 2)) for w in range(2)]
    head = run_steps(first, 6, 4)
    state = first[0].state_dict()
    for workers in (1, 2, 3):
        resumed = [ours(table, worker_info_override=Worker(w, workers))
                   for w in range(workers)]
        for ds in resumed:
            ds.load_state_dict(state)
        rest = global_steps(resumed, SPLITS // workers)
        assert sorted(i for s in head + rest for i in s) == list(range(ROWS))


def test_worker_override_inside_a_real_worker_warns_and_not_in_the_main_process(table,
                                                                                caplog):
    ds = ours(table, worker_info_override=Worker(0, 2))
    with caplog.at_level(logging.WARNING, logger="lance_ray"):
        list(ds)
    assert not caplog.records
    with mock.patch("lance_ray.view.compat.get_worker_info", return_value=Worker(0, 4)), \
            caplog.at_level(logging.WARNING, logger="lance_ray"):
        list(ours(table, worker_info_override=Worker(0, 2)))
    assert "worker_info_override" in caplog.text


def test_a_plain_dataloader_shares_the_splits_and_refuses_to_checkpoint(table):
    ds = ours(table, world_size=2, rank=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=6, num_workers=2,
                                         multiprocessing_context="forkserver")
    got = [i for b in loader for i in b["id"].tolist()]
    assert sorted(got) == sorted(ids(ours(table, world_size=2, rank=1)))  # each sample once
    with pytest.raises(RuntimeError, match="StreamingDataLoader"):
        ds.state_dict()
    ds.load_state_dict(ours(table, world_size=2, rank=1).state_dict())  # a known position
    assert ds.state_dict()["samples_consumed_per_split"] == [0] * SPLITS


def test_uneven_worker_shares_are_refused_naming_the_fix(table):
    for make in (ours, theirs):  # the reference's words, then (ours) the fix
        with pytest.raises(ValueError, match=r"rank splits \(12\) must be divisible by "
                                             r"num_workers \(5\)"):
            list(make(table, worker_info_override=Worker(0, 5)))
    with pytest.raises(ValueError, match="use a num_workers that divides 12"):
        list(ours(table, worker_info_override=Worker(0, 5)))


def test_reference_arguments_are_accepted_and_mapped(table):
    ds = ours(table, io_queue_depth=3, transform=FailOn(()), transform_parallelism=2,
              transform_queue_depth=4, connection_factory=lambda name: table)
    assert ds._reads.prefetch == 3
    assert ds._reads.reader(False, False).transform_threads == 2
    assert ds._reads.reader(False, False).prefetch == 3
    assert ids(ds) == ids(theirs(table))
    with pytest.raises(ValueError, match="name the same setting"):
        ours(table, io_queue_depth=3, prefetch_batches=2)
    for name in ("io_queue_depth", "transform_parallelism", "transform_queue_depth"):
        with pytest.raises(ValueError, match=f"{name} must be greater than 0"):
            ours(table, **{name: 0})
    with pytest.raises(TypeError, match="connection_factory"):
        ours(table, connection_factory="db")


# ----------------------------------------------------------------------- 4. counters


def test_counters_are_zero_before_and_exact_after_an_epoch(table):
    ds = ours(table, columns=["id"])
    assert (ds.bytes_loaded, ds.fetch_time, ds.transform_time, ds.unscanned_rows,
            ds.raw_queue_depth, ds.prefetch_queue_depth, ds.consumed_rows,
            ds.rows_skipped) == (0, 0.0, 0.0, 0, 0, 0, 0, 0)
    it = iter(ds)
    next(it)
    assert ds.prefetch_queue_depth > 0 and ds.consumed_rows == 1
    rest = list(it)
    assert len(rest) == ROWS - 1 and ds.consumed_rows == ROWS
    assert ds.bytes_loaded == ROWS * 8  # int64 ids, read once each
    assert ds.fetch_time > 0 and ds.transform_time > 0
    assert (ds.unscanned_rows, ds.raw_queue_depth, ds.prefetch_queue_depth) == (0, 0, 0)


def discard(batch: pa.RecordBatch) -> list[None]:
    return [None] * batch.num_rows


def slow_ids(batch: pa.RecordBatch) -> list[int]:
    import time

    time.sleep(0.01)
    return batch.column("id").to_pylist()


def test_bytes_are_counted_before_the_transform_and_transform_time_apart(table):
    ds = ours(table, columns=["id"], transform=discard)
    list(ds)
    assert ds.bytes_loaded == ROWS * 8
    slow = ours(table, transform=slow_ids, read_batch_size=16)
    list(slow)
    assert slow.transform_time > slow.fetch_time


def test_counters_with_loader_workers_equal_the_in_process_counts(table):
    counts = []
    for workers in (0, 2):
        ds = ours(table, columns=["id"])
        batches = list(lance_ray.StreamingDataLoader(ds, batch_size=10, num_workers=workers))
        assert len(batches) == ROWS // 10
        counts.append((ds.bytes_loaded, ds.consumed_rows, ds.rows_skipped))
    assert counts[0] == counts[1] == (ROWS * 8, ROWS, 0)


# ----------------------------------------------------------------------- 5./6. failures


@st.composite
def failures(draw):
    world_size = draw(st.sampled_from(valid_world_sizes(SPLITS)))
    bad = draw(st.sets(st.integers(0, ROWS - 1), max_size=15))
    return {"world_size": world_size, "rank": draw(st.integers(0, world_size - 1)),
            "shuffle": draw(st.booleans()), "transform": FailOn(bad),
            "on_transform_error": draw(st.sampled_from(["skip", "warn"]))}


@PROPERTY
@given(kw=failures(), read=st.integers(1, 40), data=st.data())
def test_dropped_rows_give_the_reference_sequence_state_and_resume(table, kw, read, data):
    expected = ids(theirs(table, **kw))
    stop = data.draw(st.integers(0, len(expected)))
    path = Path("dropped rows, __iter__", iter, lambda row: [row["id"]], boundaries=2)
    run = check_resumes_exactly(lambda: ours(table, read_batch_size=read, **kw), path,
                                also=[stop])
    assert [i for unit in run.whole for i in unit] == expected
    ref = theirs(table, **kw)
    ids(r for _, r in zip(range(stop), ref))
    state, ref_state = run.states[stop], ref.state_dict()
    owned = rank_splits(kw["rank"], kw["world_size"], SPLITS)
    for key in ("samples_consumed_per_split", "positions_consumed_per_split"):
        assert [state[key][k] for k in owned] == [ref_state[key][k] for k in owned]


def test_dropped_rows_in_batches_and_loader_workers_give_the_reference_sequence(table):
    kw = {"transform": FailOn({5, 17, 46, 0, 1}), "on_transform_error": "skip"}
    expected = ids(theirs(table, **kw))
    batches = list(ours(table, read_batch_size=16, **kw).iter_batches(8))
    assert [i for b in batches for i in b["id"].tolist()] == expected
    assert all(len(b["id"]) == 8 for b in batches[:-1])
    views: list[lance_ray.StreamingDataset] = []

    def make() -> lance_ray.StreamingDataset:
        views.append(ours(table, read_batch_size=16, **kw))
        return views[-1]

    path = Path("dropped rows, loader 2 workers",
                lambda v: iter(lance_ray.StreamingDataLoader(v, batch_size=8, num_workers=2)),
                batch_ids, boundaries=2)
    run = check_resumes_exactly(make, path, also=[3])
    assert [i for b in run.whole for i in b] == expected and views[0].rows_skipped > 0


def test_a_split_with_no_surviving_row_ends_the_epoch_at_once(table):
    split0 = ids(ours(table, shuffle=False))[::SPLITS]
    ds = ours(table, shuffle=False, transform=FailOn(split0), on_transform_error="skip")
    assert list(ds) == [] and ds.rows_skipped == len(split0)
    some = ours(table, transform=FailOn({3, 4}), on_transform_error="skip", read_batch_size=8)
    it = iter(some)
    next(it)
    assert some.unscanned_rows >= 0 and some.raw_queue_depth >= 0
    assert some.prefetch_queue_depth > 0
    assert len(list(it)) + 1 == some.consumed_rows and some.unscanned_rows == 0


def test_warn_logs_the_skip_and_the_error_type(table, caplog):
    with caplog.at_level(logging.WARNING, logger="lance_ray"):
        got = ids(ours(table, transform=FailOn({3}), on_transform_error="warn"))
    assert len(got) < ROWS and "Skipped" in caplog.text and "BadRowError" in caplog.text


def test_a_callable_handler_runs_in_the_consumer_and_can_refuse(ray_session, table):
    handled: list[Exception] = []

    def handler(error: Exception) -> bool:
        handled.append(error)
        return isinstance(error, BadRowError)

    kw = {"transform": FailOn({7, 8}), "on_transform_error": handler}
    got = ids(ours(table, reader="ray", **kw))
    assert got == ids(theirs(table, **kw))
    assert handled and all(isinstance(e, BadRowError) for e in handled)  # seen right here
    with pytest.raises(BadRowError, match="bad ids"):
        list(ours(table, reader="ray", transform=FailOn({7}),
                  on_transform_error=lambda e: False))


@pytest.mark.parametrize("reader", ["local", "ray"])
def test_transform_errors_keep_their_type_message_and_origin(request, table, reader):
    if reader == "ray":
        request.getfixturevalue("ray_session")
    with pytest.raises(BadRowError, match=r"bad ids \[7\]") as raised:
        list(ours(table, reader=reader, transform=FailOn({7})))
    assert any("(split, position)" in note for note in raised.value.__notes__)
    with pytest.raises(ValueError, match="one output row per input row"):
        list(ours(table, reader=reader, transform=lambda b: [1], on_transform_error="skip"))


# ----------------------------------------------------------------------- 7. iterators


def test_one_active_iterator_per_dataset(table):
    ds = ours(table)
    first = iter(ds)
    next(first)
    with pytest.raises(RuntimeError, match="concurrent iteration"):
        next(iter(ds))
    assert len(list(first)) == ROWS - 1
    assert len(list(ds)) == ROWS  # the first one ended: the next epoch may start
    loader = lance_ray.StreamingDataLoader(ds, batch_size=10)
    running = iter(loader)
    next(running)
    with pytest.raises(RuntimeError, match="concurrent iteration"):
        next(iter(ds))
    running.close()
    next(iter(ds))


@settings(max_examples=200, deadline=None)
@given(states=st.lists(st.tuples(st.lists(st.integers(0, 9), min_size=4, max_size=4),
                                 st.lists(st.integers(0, 3), min_size=4, max_size=4)),
                       min_size=1, max_size=4))
def test_reference_format_states_merge_as_in_the_reference(states):
    made = [{"shuffle_seed": 1, "num_splits": 4, "epoch": 0,
             "samples_consumed_per_split": s,
             "positions_consumed_per_split": [a + b for a, b in zip(s, extra)]}
            for s, extra in states]
    expected = reference.StreamingDataset.merge_state_dicts(made)
    assert lance_ray.merge_state_dicts(made) == expected


# ----------------------------------------------------------------------- 9. the spec's details


def test_dropped_rows_resume_elastically_from_merged_rank_states(table):
    kw = {"shuffle": False, "transform": FailOn({0, 24, 18}), "on_transform_error": "skip"}
    expected = ids(ours(table, **kw))
    assert expected == ids(theirs(table, **kw))
    ranks = [ours(table, rank=r, world_size=2, **kw) for r in range(2)]
    head = run_steps(ranks, 6, 3)
    merged = lance_ray.merge_state_dicts([ds.state_dict() for ds in ranks])
    ref_ranks = [theirs(table, rank=r, world_size=2, **kw) for r in range(2)]
    run_steps(ref_ranks, 6, 3)
    ref_merged = reference.StreamingDataset.merge_state_dicts(
        [ds.state_dict() for ds in ref_ranks])
    for key in ("samples_consumed_per_split", "positions_consumed_per_split"):
        assert merged[key] == ref_merged[key]
    again = ours(table, **kw)
    again.load_state_dict(merged)
    assert [frozenset(expected[s * SPLITS:(s + 1) * SPLITS]) for s in range(3)] == head
    assert ids(again) == expected[3 * SPLITS:]


def test_small_contract_points_of_the_reference(table):
    with pytest.raises(ValueError, match="at least 1 row per split"):
        ours(table, filter="id < 0")
    drawn = ours(table, shuffle_seed=None)
    seed = drawn.state_dict()["shuffle_seed"]
    assert isinstance(seed, int) and ids(drawn) == ids(ours(table, shuffle_seed=seed))
    with pytest.raises(ValueError, match="at least one"):
        lance_ray.StreamingDataset.merge_state_dicts([])
    assert ours(table, world_size=2, num_splits=None).num_splits == 2


@pytest.mark.parametrize("done", [0, ROWS // SPLITS])
def test_one_ranks_state_at_the_epochs_start_or_end_resumes_all_or_nothing(table, done):
    first = [ours(table, rank=r, world_size=2) for r in range(2)]
    run_steps(first, SPLITS // 2, done)
    state = first[1].state_dict()
    resumed = [ours(table, rank=r, world_size=4) for r in range(4)]
    for ds in resumed:
        ds.load_state_dict(state)
    left = sorted(i for step in global_steps(resumed, SPLITS // 4) for i in step)
    assert left == (list(range(ROWS)) if done == 0 else [])


def test_numpy_scalars_are_taken_wherever_python_numbers_are(table):
    """Configs computed with numpy pass numpy scalars, which the reference takes: the same
    sequence and states as Python numbers, states that stay plain JSON, and a state whose
    counters are numpy ints loads in both libraries."""
    import json

    import numpy as np

    kw = {"num_splits": np.int64(4), "shuffle": np.bool_(True), "shuffle_seed": np.int64(7),
          "epoch": np.int64(1), "rank": np.int32(1), "world_size": np.uint8(2),
          "read_batch_size": np.int64(8)}
    plain = {k: v.item() for k, v in kw.items()}
    ds = ours(table, **kw)
    assert [batch_ids(b) for b in ds.iter_batches(np.int64(5))] == [
        batch_ids(b) for b in ours(table, **plain).iter_batches(5)]
    ref = reference.StreamingDataset(table, **kw)
    head = [next(it) for it in [iter(ref)] for _ in range(6)]
    state = ref.state_dict()
    numpy_state = {**state, **{k: [np.int64(x) for x in state[k]] for k in (
        "samples_consumed_per_split", "positions_consumed_per_split")}}
    resumed = ours(table, **kw)
    resumed.load_state_dict(numpy_state)
    json.dumps(resumed.state_dict())  # plain JSON
    rest = [i for b in resumed.iter_batches(5) for i in batch_ids(b)]
    whole = [i for b in ours(table, **plain).iter_batches(5) for i in batch_ids(b)]
    assert [r["id"] for r in head] + rest == whole
    ds.set_epoch(np.int64(2))
    assert json.loads(json.dumps(ds.state_dict()))["epoch"] == 2


def test_a_column_named_twice_is_read_once_as_in_the_reference(table):
    columns = ["id", "id"]
    ref = [r for r in theirs(table, columns=columns)]
    got = list(ours(table, columns=columns))
    assert got == ref and set(got[0]) == {"id"}


def test_default_collate_gives_the_reference_loaders_batches(tmp_path):
    """Without a collate_fn a batch keeps Arrow's dtypes and shapes (docs/migrating.md);
    with torch's default_collate it is the reference DataLoader's batch exactly."""
    import lancedb
    from torch.utils.data import DataLoader, default_collate

    table = lancedb.connect(str(tmp_path)).create_table("t", pa.table({
        "id": pa.array(range(8), pa.int32()), "f": pa.array([0.5] * 8, pa.float32()),
        "v": pa.array([[1, 2, 3]] * 8, pa.list_(pa.int32(), 3))}))

    def described(x):
        if isinstance(x, torch.Tensor):
            return x.dtype, tuple(x.shape), x.tolist()
        if isinstance(x, dict):
            return {k: described(v) for k, v in x.items()}
        return [described(v) for v in x] if isinstance(x, list) else x

    kw = {"num_splits": 2, "shuffle_seed": 5}
    theirs_ = [described(b) for b in DataLoader(reference.StreamingDataset(table, **kw),
                                                batch_size=4)]
    loader = lance_ray.StreamingDataLoader(
        lance_ray.StreamingDataset(table, reader="local", **kw), batch_size=4,
        collate_fn=default_collate)
    assert [described(b) for b in loader] == theirs_
    plain = next(iter(lance_ray.StreamingDataLoader(
        lance_ray.StreamingDataset(table, reader="local", **kw), batch_size=4)))
    assert plain["id"].dtype == torch.int32 and plain["v"].shape == (4, 3)


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_a_collate_fn_that_raises_ends_the_iteration_at_its_batch_with_any_workers(
        table, num_workers):
    """The batches before the failing one arrive (workers send batches in groups: a group's
    failure must not take its earlier batches with it), the state is that of the last one,
    and resuming from it delivers the rest, the failed batch's samples first."""
    order = [i for b in ours(table).iter_batches(10) for i in batch_ids(b)]
    bad = order[55]
    ds = ours(table)
    loader = lance_ray.StreamingDataLoader(ds, batch_size=10, num_workers=num_workers,
                                           collate_fn=CollateFailsOn(bad))
    got: list[int] = []
    with pytest.raises(KeyError, match=f"bad id {bad}") as raised:
        for b in loader:
            got += b["id"].tolist()
    assert got == order[:50]
    # without workers, the error is the collate_fn's own (no worker to name)
    assert ("DataLoader worker" in str(raised.value)) == (num_workers > 0)
    resumed = ours(table)
    resumed.load_state_dict(loader.state_dict())
    assert [i for b in resumed.iter_batches(10) for i in batch_ids(b)] == order[50:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_dataset_reaches_the_dataset_as_in_the_reference(table, num_workers):
    """``loader.dataset`` answers for the dataset (the reference loader's adapter forwards
    to it): its state, ``set_epoch`` for epoch hooks, its arguments; workers still start."""
    from lancedb.streaming import StreamingDataLoader as RefLoader
    from lancedb.streaming import StreamingDataset as Ref

    ref = RefLoader(Ref(table, num_splits=SPLITS, shuffle_seed=SEED), batch_size=8)
    loader = lance_ray.StreamingDataLoader(ours(table), 8, num_workers=num_workers)
    for ldr in (ref, loader):
        it = iter(ldr)
        for _ in range(3):
            next(it)
        del it
    assert loader.dataset.state_dict()["samples_consumed_per_split"] == \
        ref.dataset.state_dict()["samples_consumed_per_split"] == \
        loader.state_dict()["samples_consumed_per_split"]
    assert (loader.dataset.num_splits, callable(loader.dataset.set_epoch)) == (SPLITS, True)
    with pytest.raises(AttributeError, match="no attribute 'nothing_of_that_name'"):
        loader.dataset.nothing_of_that_name  # noqa: B018


def _described(x: Any) -> Any:
    """A value's types, dtypes, shapes and values, to compare loaders' outputs exactly."""
    if isinstance(x, torch.Tensor):
        return "tensor", x.dtype, tuple(x.shape), x.tolist()
    if isinstance(x, dict):
        return {k: _described(v) for k, v in x.items()}
    return [_described(v) for v in x] if isinstance(x, list) else (type(x).__name__, x)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("packed", [False, True])
def test_an_unbatched_loader_gives_the_reference_loaders_samples_and_states(
        table, token_table, num_workers, packed):
    """``batch_size=None`` (torch's unbatched mode): each sample through ``collate_fn``
    (default ``default_convert``), one committed sample per ``next()``; a resume goes on."""
    from lancedb.streaming import StreamingDataLoader as RefLoader

    if packed:
        tokens, _ = token_table
        kw = {"num_splits": 4, "columns": ["tokens"], "pack_sequences": 8, "eos_id": 0,
              "pad_id": 1, "blocks_per_epoch": 40}
        make_ours = lambda: lance_ray.StreamingDataset(tokens, reader="local", **kw)  # noqa: E731
        make_theirs = lambda: reference.StreamingDataset(tokens, **kw)  # noqa: E731
    else:
        make_ours = lambda: ours(table, columns=["id"])  # noqa: E731
        make_theirs = lambda: theirs(table)  # noqa: E731
    ref_ds, ds = make_theirs(), make_ours()
    ref_it = iter(RefLoader(ref_ds, batch_size=None))
    it = iter(lance_ray.StreamingDataLoader(ds, None, num_workers=num_workers))
    head = [_described(next(it)) for _ in range(8)]  # a packed state: after whole steps
    assert head == [_described(next(ref_it)) for _ in range(8)]
    assert ds.state_dict()["samples_consumed_per_split"] == \
        ref_ds.state_dict()["samples_consumed_per_split"]
    resumed = make_ours()
    resumed.load_state_dict(ds.state_dict())
    rest = [_described(x) for x in lance_ray.StreamingDataLoader(
        resumed, batch_size=None, collate_fn=lambda item: item)]
    assert head + rest == [_described(torch.utils.data.default_convert(x))
                           for x in make_ours()]


def test_loader_arguments_may_be_given_in_dataloaders_positional_order(table):
    from torch.utils.data import default_collate

    loader = lance_ray.StreamingDataLoader(ours(table), 8, None, None, None, 0,
                                           default_collate)
    assert [batch_ids(b) for b in loader] == [batch_ids(b) for b in
                                              ours(table).iter_batches(8)]
    with pytest.raises(TypeError, match="multiple values for argument 'num_workers'"):
        lance_ray.StreamingDataLoader(ours(table), 8, None, None, None, 0, num_workers=1)
