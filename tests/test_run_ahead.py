"""How far a Ray reader's pipeline runs ahead (``read.run_ahead``): the bound itself, as a
pure rule, and the pipelines the reader builds with it. The object store under a slow
consumer is measured in ``test_read_sizing``."""

from __future__ import annotations

from conftest import consecutive_requests
from hypothesis import given
from hypothesis import strategies as st

from lance_ray.read.ray_data import RayDataReader
from lance_ray.read.requests import ReadSizing
from lance_ray.read.run_ahead import BUDGET_KEY, TASK_KEY, RunAhead
from lance_ray.read.scale import capacity, consumer_outputs, run_ahead_budget

MB = 1 << 20


@given(budget=st.integers(0, 1 << 40), task=st.integers(0, 1 << 32),
       running=st.integers(0, 10_000), queued=st.integers(0, 1 << 40),
       measured=st.integers(0, 1 << 32))
def test_a_task_is_admitted_only_within_the_budget_or_when_the_pipeline_holds_nothing(
        budget, task, running, queued, measured):
    admitted = RunAhead(budget, task).admits(running, queued, measured)
    within = queued + (running + 1) * max(task, measured) <= budget
    assert admitted == ((running == 0 and queued == 0) or within)


def test_measured_outputs_larger_than_the_read_count_at_their_size():
    bound = RunAhead(budget=100 * MB, task_bytes=10 * MB)
    assert bound.admits(running=3, queued_bytes=0, measured_task_bytes=0)
    assert not bound.admits(running=3, queued_bytes=0, measured_task_bytes=30 * MB)


def test_the_pipeline_runs_without_ray_datas_reservation_within_its_bound(ray_session,
                                                                          table_1k):
    import ray

    import lance_ray

    table = lance_ray.StreamingDataset(table_1k, reader="local")._table
    sizing = ReadSizing(1 << 16, row_bytes=1000, budget_bytes=3 * MB)
    reader = RayDataReader(table, ["id"], None, sizing=sizing)
    ds = reader.dataset(consecutive_requests([500, 2000, 800]))
    context = ds.context
    assert context.op_resource_reservation_enabled is False
    assert context.execution_options.preserve_order
    assert context.get_config(TASK_KEY) == 2_000_000  # the largest read
    # Plain reads and transformed tasks share one rule (``scale.run_ahead_budget``): a few
    # reads per task slot, within the object store's share (the reader's default budget
    # does not cap it; a prefetch_bytes the user set would).
    cpus = int(ray.cluster_resources()["CPU"])
    assert capacity(None).slots == cpus
    assert context.get_config(BUDGET_KEY) == run_ahead_budget(
        2_000_000, capacity(None), None, consumer_outputs(reader.prefetch_batches))
    assert context.get_config(BUDGET_KEY) >= cpus * 2_000_000


def test_without_the_rows_width_ray_datas_reservation_stays(ray_session, table_1k):
    import lance_ray

    table = lance_ray.StreamingDataset(table_1k, reader="local")._table
    reader = RayDataReader(table, ["id"], None, sizing=ReadSizing(1 << 16))  # width unknown
    context = reader.dataset(consecutive_requests([100])).context
    assert context.op_resource_reservation_enabled is True
    assert context.get_config(BUDGET_KEY, None) is None
