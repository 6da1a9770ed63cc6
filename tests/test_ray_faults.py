"""The Ray reader when its tasks fail: a worker that dies on every try ends the pass with an
error that says what to do (Ray Data alone retries it for ever), and progress stays exact."""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pytest

import lance_ray
from lance_ray.read.scale import DEFAULT_MAX_RETRIES, task_options

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
