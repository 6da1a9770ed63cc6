"""The Ray reader when its tasks fail: a worker that dies on every try ends the pass with an
error that says what to do (Ray Data alone retries it for ever), and progress stays exact."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import pyarrow as pa
import pytest

import lance_ray
from lance_ray.read.scale import DEFAULT_MAX_RETRIES, NodeWatch, nodes_short, task_options

KW = dict(num_splits=4, shuffle=True, shuffle_seed=5, columns=["id"])


class CrashOn:
    """A transform whose process dies on row ``bad`` (as a native decoder's crash on a
    corrupt record would), except in the trainer's process (the reader's in-process head)."""

    def __init__(self, bad: int, trainer: int):
        self.bad, self.trainer = bad, trainer

    def __call__(self, batch: pa.RecordBatch) -> list[int]:
        ids = batch.column("id").to_pylist()
        if self.bad in ids and os.getpid() != self.trainer:
            os._exit(1)
        return ids


def ids(batches: Any) -> list[int]:
    return [int(i) for b in batches for i in b]


def test_retries_are_bounded_by_default_and_can_be_set():
    assert task_options({}) == ({}, {"max_retries": DEFAULT_MAX_RETRIES})
    named, retries = task_options({"num_cpus": 2, "max_retries": -1,
                                   "retry_exceptions": (ValueError,)})
    assert named == {"num_cpus": 2}
    assert retries == {"max_retries": -1, "retry_exceptions": [ValueError]}


def test_a_worker_that_dies_on_every_try_ends_the_pass_and_progress_resumes(ray_session,
                                                                           table_factory):
    import ray

    table = table_factory(600, 3)
    want = ids(lance_ray.StreamingDataset(table, reader="local", transform=lambda b: b.column(
        "id").to_pylist(), **KW).iter_batches(20))
    bad = want[-1]  # read by a Ray task, never by the in-process head
    ds = lance_ray.StreamingDataset(table, reader="ray", transform=CrashOn(bad, os.getpid()),
                                    ray_remote_args={"max_retries": 0}, **KW)
    got: list[int] = []
    with pytest.raises(ray.exceptions.WorkerCrashedError) as e:
        for batch in ds.iter_batches(20):
            got += [int(i) for i in batch]
    assert "ray_remote_args={'max_retries': N}" in "".join(e.value.__notes__)
    assert got == want[:len(got)] and bad not in got
    state = ds.state_dict()
    rest = lance_ray.StreamingDataset(table, reader="ray", transform=CrashOn(-1, os.getpid()),
                                      **KW)
    rest.load_state_dict(state)
    assert got + ids(rest.iter_batches(20)) == want


def test_a_pass_that_no_node_can_run_any_more_says_so(caplog):
    short: list[str | None] = [None]

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name.startswith("lance_ray")]

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 10
        while len(lines()) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    with caplog.at_level(logging.WARNING, logger="lance_ray"):
        watch = NodeWatch(lambda: short[0], every_s=0.02)
        try:
            time.sleep(0.2)  # blocks are late, but a node can run the tasks: nothing to say
            assert lines() == []
            short[0] = "no node of the Ray cluster can run a read task asking for {...}"
            wait_for(1)
            time.sleep(0.2)  # said once, not every check
            assert len(lines()) == 1 and "the pass is waiting: no node" in lines()[0]
            short[0] = None
            wait_for(2)
            assert "joined" in lines()[1]
        finally:
            watch.close()


def test_the_cluster_check_names_the_request_no_node_has(ray_session):
    assert nodes_short({}) is None
    said = nodes_short({"resources": {"no_such_node": 1}})
    assert said is not None and "'no_such_node': 1.0" in said
