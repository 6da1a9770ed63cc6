"""Oracle tests: ``lance_ray.StreamingDataset`` against ``lancedb.streaming.StreamingDataset``.

Invariant: the same plan arguments give every rank the same sample sequence in both
libraries, whatever the reader, its chunk size or a transform, and a mid-epoch state taken
in either library resumes to the same remaining sequence in the other.
"""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

import pyarrow as pa
import pytest
import torch
from conftest import open_table
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lancedb import streaming as reference

import lance_ray
from lance_ray import valid_world_sizes
from lance_ray.read import ray_data, scale

# (rows, fragments) of the tables the properties draw from; table_factory caches them.
TABLES = ((37, 1), (250, 2), (1000, 3))
FILTERS = (None, "id % 3 != 0", "x < 100")

PROPERTY = settings(
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
INTEROP = settings(PROPERTY, max_examples=15)



def ids_of(batch: pa.RecordBatch) -> list[int]:
    """A transform for both libraries (module level, so Ray can pickle it)."""
    return batch.column("id").to_pylist()


@pytest.fixture(scope="module")
def ray_transforms(ray_session):
    """Ship this module's functions to Ray workers by value, whatever their sys.path."""
    from ray import cloudpickle

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    yield
    cloudpickle.unregister_pickle_by_value(module)


def row_ids(rows: Any) -> list[int]:
    """The ``id`` of every item: dict rows, or the ints ``ids_of`` makes."""
    return [r if isinstance(r, int) else r["id"] for r in rows]


@st.composite
def plan_args(draw: st.DrawFn) -> tuple[tuple[int, int], dict[str, Any]]:
    """A table and the plan/topology arguments both libraries accept."""
    table = draw(st.sampled_from(TABLES))
    num_splits = draw(st.one_of(st.integers(1, 12), st.sampled_from([16, 24, 30, 36, 40])))
    world_size = draw(st.sampled_from(valid_world_sizes(num_splits)))
    kw = {
        "num_splits": num_splits,
        "world_size": world_size,
        "rank": draw(st.integers(0, world_size - 1)),
        "shuffle": draw(st.booleans()),
        "shuffle_seed": draw(st.integers(0, 2**32 - 1)),
        "epoch": draw(st.integers(0, 3)),
        "shuffle_clump_size": draw(st.one_of(st.none(), st.integers(1, 64))),
        "filter": draw(st.sampled_from(FILTERS)),
    }
    return table, kw


def reference_ids(table, kw: dict[str, Any]) -> list[int]:
    return row_ids(reference.StreamingDataset(table, **kw))


# ----------------------------------------------------------------------- same sequence


@PROPERTY
@given(args=plan_args(), read_batch_size=st.integers(1, 300))
def test_same_arguments_give_the_reference_per_rank_sequence(table_factory, args,
                                                            read_batch_size):
    shape, kw = args
    table = open_table(table_factory, shape, kw)
    ours = lance_ray.StreamingDataset(table, reader="local", read_batch_size=read_batch_size,
                                      **kw)
    got = row_ids(ours)
    assert got == reference_ids(table, kw)
    assert len(got) == len(ours)


RAY_CONFIGS = [
    pytest.param((1000, 3), {"num_splits": 4, "world_size": 2, "rank": 1, "shuffle_seed": 7,
                             "epoch": 1}, None, 64, id="shuffled-rank1of2-dicts"),
    pytest.param((250, 2), {"num_splits": 3, "shuffle": False, "filter": "id % 3 != 0"},
                 ids_of, 40, id="sequential-filter-transform"),
    pytest.param((1000, 3), {"num_splits": 6, "world_size": 3, "rank": 2, "shuffle_seed": 11,
                             "epoch": 2, "shuffle_clump_size": 16, "filter": "x < 100"},
                 ids_of, 33, id="clumped-filter-rank2of3-transform"),
]


@pytest.mark.parametrize(("shape", "kw", "transform", "read_batch_size"), RAY_CONFIGS)
def test_ray_data_reader_gives_the_reference_per_rank_sequence(
        ray_transforms, table_factory, shape, kw, transform, read_batch_size):
    table = table_factory(*shape)
    expected = row_ids(reference.StreamingDataset(table, transform=transform, **kw))
    ours = lance_ray.StreamingDataset(table, reader="ray", transform=transform,
                                      read_batch_size=read_batch_size, **kw)
    assert row_ids(ours) == expected


def test_ray_reader_running_read_tasks_side_by_side_keeps_the_reference_sequence(
        ray_transforms, table_factory, monkeypatch):
    """Forty small transformed reads: the pipeline runs them side by side (``run_ahead``
    replaces Ray Data's reservation, which ran them one at a time), and their blocks must
    still arrive in request order (this fails with ``preserve_order`` off)."""
    # Tasks of ~25 rows (the pass spread over many waves, no minimum work per task).
    monkeypatch.setattr(scale, "MIN_TASK_SECONDS", 0.0)
    monkeypatch.setattr(scale, "WAVES", 20)
    table = table_factory(1000, 3)
    kw = {"num_splits": 6, "shuffle_seed": 5, "epoch": 1}
    expected = row_ids(reference.StreamingDataset(table, transform=ids_of, **kw))
    ours = lance_ray.StreamingDataset(table, reader="ray", transform=ids_of,
                                      read_batch_size=25, **kw)
    assert row_ids(ours) == expected


def test_ray_reader_joins_cheap_transformed_reads_into_fewer_tasks_in_the_same_order(
        ray_transforms, table_factory, monkeypatch):
    tasks: list[tuple[int, int]] = []
    plan_tasks = ray_data.rechunked

    def counted(reqs, rows):
        out = plan_tasks(reqs, rows)
        tasks.append((len(reqs), len(out)))
        return out

    monkeypatch.setattr(ray_data, "rechunked", counted)
    table = table_factory(1000, 3)
    kw = {"num_splits": 6, "shuffle_seed": 8}
    expected = row_ids(reference.StreamingDataset(table, transform=ids_of, **kw))
    ours = lance_ray.StreamingDataset(table, reader="ray", transform=ids_of,
                                      read_batch_size=25, **kw)
    assert row_ids(ours) == expected
    (reads, joined), = tasks
    assert joined < reads


def test_ray_data_reader_batches_hold_the_reference_sequence(ray_transforms, table_factory):
    table = table_factory(250, 2)
    kw = {"num_splits": 5, "shuffle_seed": 3, "filter": "x < 100"}
    expected = reference_ids(table, kw)
    ours = lance_ray.StreamingDataset(table, reader="ray", transform=ids_of,
                                      read_batch_size=30, **kw)
    got = [i for batch in ours.iter_batches(17) for i in batch.tolist()]
    assert got == expected


def test_ray_reader_tensor_batches_and_remote_plan_hold_the_reference_sequence(
        ray_transforms, table_factory, monkeypatch):
    """The default path: plan built in a Ray task (as for a large table), reads converted to
    tensors, batches cut across reads of growing size."""
    from lance_ray.plan import sources
    from lance_ray.plan.sources import RayTaskPlans

    monkeypatch.setattr(sources, "REMOTE_PLAN_MIN_ROWS", 0)
    table = table_factory(20000, 3)  # 10000 samples per rank: reads of 4096 then 5904 rows
    kw = {"num_splits": 4, "world_size": 2, "rank": 1, "shuffle_seed": 5,
          "shuffle_clump_size": 7}
    expected = reference_ids(table, kw)
    ours = lance_ray.StreamingDataset(table, reader="ray", **kw)
    assert isinstance(ours._plans, RayTaskPlans)
    local = lance_ray.StreamingDataset(table, reader="local", **kw)
    assert ours.identity == local.identity
    batches = list(ours.iter_batches(37))
    assert all(b["id"].dtype == torch.int64 and b["v"].dim() == 2 for b in batches)
    assert [i for b in batches for i in b["id"].tolist()] == expected


# ----------------------------------------------------------------------- checkpoint interop


@INTEROP
@given(args=plan_args(), cut=st.floats(0, 1), read_batch_size=st.integers(1, 300))
def test_mid_epoch_state_of_lance_ray_resumes_the_same_remainder_in_the_reference(
        table_factory, args, cut, read_batch_size):
    shape, kw = args
    table = open_table(table_factory, shape, kw)
    ours = lance_ray.StreamingDataset(table, reader="local", read_batch_size=read_batch_size,
                                      **kw)
    k = int(cut * len(ours))
    it = iter(ours)
    head = row_ids(itertools.islice(it, k))
    state = json.loads(json.dumps(ours.state_dict()))
    our_rest = row_ids(it)

    theirs = reference.StreamingDataset(table, **kw)
    theirs.load_state_dict(state)
    their_rest = row_ids(theirs)

    assert their_rest == our_rest
    assert head + our_rest == reference_ids(table, kw)


@INTEROP
@given(args=plan_args(), cut=st.floats(0, 1, exclude_max=True),
       read_batch_size=st.integers(1, 300))
def test_mid_epoch_state_of_the_reference_resumes_the_same_remainder_in_lance_ray(
        table_factory, args, cut, read_batch_size):
    shape, kw = args
    table = open_table(table_factory, shape, kw)
    theirs = reference.StreamingDataset(table, **kw)
    full = reference_ids(table, kw)
    k = int(cut * len(full))  # strictly mid-epoch: an exhausted state starts the next epoch
    it = iter(theirs)
    head = row_ids(itertools.islice(it, k))
    state = json.loads(json.dumps(theirs.state_dict()))
    their_rest = row_ids(it)

    ours = lance_ray.StreamingDataset(table, reader="local", read_batch_size=read_batch_size,
                                      **kw)
    ours.load_state_dict(state)
    assert ours.samples_remaining == len(their_rest)
    assert row_ids(ours) == their_rest
    assert head + their_rest == full
