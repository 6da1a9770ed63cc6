"""How the Ray reader sizes a transformed pass from the cluster (``read.scale``): task slots
from the nodes and ``ray_remote_args``, rows per task, the run-ahead budget, and the cutting
of requests into tasks (same rows, same order, same stream positions)."""

from __future__ import annotations

import numpy as np
from conftest import consecutive_requests
from hypothesis import given
from hypothesis import strategies as st

from lance_ray.read import scale
from lance_ray.read.requests import ChunkRequest
from lance_ray.read.run_ahead import RunAhead
from lance_ray.read.scale import (
    Capacity,
    consumer_outputs,
    rechunked,
    run_ahead_budget,
    slots_on,
    split_rows,
    task_demand,
    task_shape,
)

MB = 1 << 20


def _positions(reqs: list[ChunkRequest]) -> list[int]:
    return [p for r in reqs for lo, hi in r.spans for p in range(lo, hi)]


def _spread(sizes: list[int], gaps: list[int]) -> list[ChunkRequest]:
    """Requests of ``sizes`` rows whose stream positions skip ``gaps`` between them (a
    DataLoader worker's every k-th batch), several spans joined into some requests."""
    out, lo = [], 0
    for n, gap in zip(sizes, gaps + [0] * len(sizes)):
        out.append(ChunkRequest(((lo, lo + n),), np.arange(lo, lo + n, dtype=np.uint64) * 7))
        lo += n + gap
    return out


@given(st.lists(st.integers(1, 40), min_size=1, max_size=20),
       st.lists(st.integers(0, 3), max_size=20), st.integers(1, 90))
def test_rechunked_reads_hold_the_same_rows_and_positions_in_order(sizes, gaps, rows):
    reqs = _spread(sizes, gaps)
    out = rechunked(reqs, rows)
    assert np.array_equal(np.concatenate([r.row_ids for r in out]),
                          np.concatenate([r.row_ids for r in reqs]))
    assert _positions(out) == _positions(reqs)
    assert all(len(r.row_ids) == sum(hi - lo for lo, hi in r.spans) for r in out)
    assert [len(r.row_ids) for r in out[:-1]] == [rows] * (len(out) - 1)
    # Spans are maximal runs: no two neighbours within a read could have been one.
    assert all(a[1] < b[0] for r in out for a, b in zip(r.spans, r.spans[1:]))


@given(st.lists(st.integers(1, 40), min_size=1, max_size=20), st.integers(0, 900))
def test_split_rows_cuts_the_first_rows_off_in_order(sizes, rows):
    reqs = consecutive_requests(sizes)
    head, rest = split_rows(reqs, rows)
    assert sum(len(r.row_ids) for r in head) == min(rows, sum(sizes))
    assert _positions(head) + _positions(rest) == _positions(reqs)
    assert max(len(r.row_ids) for r in head + rest) <= max(sizes)


def test_slots_follow_the_nodes_and_what_a_task_asks_for():
    nodes = [{"CPU": 2.0}, {"CPU": 8.0, "cpu_only": 8.0}, {"CPU": 4.0, "cpu_only": 2.0}]
    assert slots_on(nodes, task_demand(None)) == 14
    assert slots_on(nodes, task_demand({"resources": {"cpu_only": 1}})) == 10
    assert slots_on(nodes, task_demand({"num_cpus": 2, "resources": {"cpu_only": 1}})) == 6
    assert slots_on(nodes, task_demand({"num_cpus": 0.5})) == 28


HELD = consumer_outputs(2)  # what the trainer holds with the default prefetch


def _shape(rows=100_000, slots=8, spr=0.004, out=12_288, store=1 << 40, cap=None):
    return task_shape(rows, Capacity(slots, store), seconds_per_row=spr, in_row_bytes=80,
                      out_row_bytes=out, read_bytes=64 * MB, most_rows=1024, budget_cap=cap,
                      consumer=HELD)


def test_a_pass_is_spread_over_every_slot_in_tasks_of_bounded_work():
    shape = _shape(rows=6000)
    assert shape.rows == 6000 // (8 * scale.WAVES)  # 1 s of work: within the bounds
    # One running and the rest waiting per slot, beside what the trainer holds.
    assert shape.budget == (scale.OUTPUTS_PER_SLOT * 8 + HELD) * shape.task_bytes
    # A long pass: tasks of at most MAX_TASK_SECONDS; a short one: at least MIN.
    assert _shape(rows=10**7).rows == int(scale.MAX_TASK_SECONDS / 0.004)
    assert _shape(rows=100).rows == int(scale.MIN_TASK_SECONDS / 0.004)
    # Cheap rows: at most one read's bytes per task, in or out.
    assert _shape(rows=10**8, spr=1e-7, out=1 * MB).rows == 64


@given(task=st.integers(1, 1 << 28), slots=st.integers(1, 1024),
       store=st.integers(0, 1 << 42), cap=st.one_of(st.none(), st.integers(0, 1 << 40)),
       prefetch=st.integers(1, 16))
def test_the_run_ahead_keeps_every_slot_busy_within_the_memory_and_always_admits_one_task(
        task, slots, store, cap, prefetch):
    held = consumer_outputs(prefetch)
    budget = run_ahead_budget(task, Capacity(slots, store), cap, held)
    memory = store if cap is None else min(store, cap)
    assert budget >= task  # never stalls on its own bound
    assert budget <= max(task, memory)  # prefetch_bytes and the store cap it
    if memory >= (scale.OUTPUTS_PER_SLOT * slots + held) * task:
        # Ray Data counts the blocks the trainer holds against the pipeline: with those
        # held and an output waiting per slot, every slot still gets a task. (Left out,
        # they took all but one task's room on two slots.)
        assert budget == (scale.OUTPUTS_PER_SLOT * slots + held) * task
        assert RunAhead(budget, task).admits(running=slots - 1,
                                             queued_bytes=(held + slots) * task,
                                             measured_task_bytes=task)


def test_memory_shrinks_tasks_and_says_so_only_when_one_task_per_slot_does_not_fit():
    roomy = _shape(rows=10**7, out=50_000, cap=None)
    assert roomy.short is None
    # prefetch_bytes caps the memory: tasks shrink so two per slot fit, and one line says
    # that one task's output per CPU did not.
    capped = _shape(rows=10**7, out=50_000, cap=128 * MB)
    assert capped.budget <= 128 * MB
    assert capped.rows == 128 * MB // ((2 * 8 + HELD) * 50_000)
    assert capped.short is not None and "prefetch_bytes" in capped.short
    assert "8 x" in capped.short
    # A store too small for even one row per slot still runs, one task at a time.
    tiny = _shape(out=50_000, store=10_000)
    assert tiny.rows == 1 and tiny.short is not None


def test_without_a_measured_cost_or_output_size_tasks_only_cut_reads():
    shape = task_shape(10**6, Capacity(4, 1 << 40), seconds_per_row=None, in_row_bytes=80,
                       out_row_bytes=None, read_bytes=64 * MB, most_rows=1024,
                       budget_cap=None, consumer=HELD)
    assert shape.rows == 1024
    # Ray Data's measured outputs are counted against the memory.
    assert shape.budget == 1 << 40
    assert task_shape(600, Capacity(4, 1 << 40), seconds_per_row=None, in_row_bytes=80,
                      out_row_bytes=None, read_bytes=64 * MB, most_rows=1024,
                      budget_cap=None, consumer=HELD).rows == 50


def test_a_request_no_node_can_meet_fails_naming_it_instead_of_hanging(ray_session, table_1k,
                                                                        monkeypatch, caplog):
    """Ray holds a task no node can run for ever (an autoscaler might add a node): the
    reader says so at once, waits LANCE_RAY_NODE_WAIT_S for one, then fails naming it."""
    import pytest

    import lance_ray

    monkeypatch.setenv("LANCE_RAY_NODE_WAIT_S", "1")
    ds = lance_ray.StreamingDataset(table_1k, num_splits=4, reader="ray",
                                    ray_remote_args={"resources": {"no_such_node": 1}})
    with caplog.at_level("WARNING", logger="lance_ray"), \
            pytest.raises(ValueError, match=r"no node .*'no_such_node': 1\.0.*none joined in 1 s"):
        next(ds.iter_batches(8))
    assert "waiting up to 1 s" in caplog.text


def test_ray_remote_args_the_read_tasks_cannot_take_are_refused_when_the_view_is_made(
        ray_session, table_1k):
    import pytest

    import lance_ray

    for args, match in [({"bogus_arg": 3}, r"cannot hold \['bogus_arg'\]"),
                        ({"scheduling_strategy": "SPREAD"}, "cannot hold.*label_selector"),
                        ({"num_cpus": -1}, "num_cpus cannot be negative")]:
        with pytest.raises(ValueError, match=match):
            lance_ray.StreamingDataset(table_1k, num_splits=4, reader="ray",
                                       ray_remote_args=args)
