"""Runs with no shared disk: the table and the coordinator's ledger on a real S3-compatible
server (moto on 127.0.0.1), read and written from the two-node Ray cluster."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from conftest import coordinators, write_table
from lancedb import streaming as reference
from test_coordinator import NUM_SPLITS, local_views, step_views, uninterrupted, wait_sealed

import lance_ray
from lance_ray import storage
from lance_ray.coordinator.client import DEFAULT_NAMESPACE
from lance_ray.driver.handle import Coordinator
from lance_ray.proof.verify import compare_steps, coverage
from lance_ray.testing.local_s3 import Forwarder


@pytest.fixture(scope="module")
def s3_table(s3_server):
    from conftest import S3_BUCKET

    return write_table(f"s3://{S3_BUCKET}/tables/db", 600, fragments=3)


@pytest.mark.parametrize("reader", ["local", "ray"])
def test_a_table_on_s3_reads_the_reference_sequence_on_both_readers(ray_session, s3_table,
                                                                    reader):
    kw = {"num_splits": 6, "world_size": 2, "shuffle_seed": 7, "shuffle_clump_size": 5}
    for rank in range(2):
        ours = lance_ray.StreamingDataset(s3_table, rank=rank, reader=reader, **kw)
        theirs = reference.StreamingDataset(s3_table, rank=rank, **kw)
        assert [r["id"] for r in ours] == [r["id"] for r in theirs]


@pytest.fixture
def s3_coords(ray_session, s3_table, s3):
    with coordinators(s3_table, f"{s3}/store", world_size=2, num_splits=NUM_SPLITS) as make:
        yield make


def test_the_ledger_on_s3_survives_a_killed_actor_and_a_new_job_exactly_once(s3_coords,
                                                                            s3_table, s3):
    coord = s3_coords("s3_restart")
    ledger = f"{s3}/store/s3_restart/coordinator.json"
    views = local_views(coord, 2)
    before = step_views(views, 8)
    wait_sealed(coord, 8)
    deadline = time.monotonic() + 10  # written within PERSIST_EVERY_S of the seal
    while (storage.read_json(ledger)["ledger"]["sealed"] or {}).get("step") != 8:
        assert time.monotonic() < deadline, "the sealed step never reached S3"
        time.sleep(0.05)
    ray.kill(coord.handle, no_restart=False)  # Ray restarts it; it reloads the ledger
    middle = step_views(views, 6)
    wait_sealed(coord, 14)
    coord.kill()  # gone for good: a new job (any node) re-creates it from S3
    again = s3_coords("s3_restart")
    assert again.status()["sealed_step"] == 14
    after = step_views(local_views(again, 2))
    full = uninterrupted(s3_table)
    done = before + middle + after
    report = compare_steps(coverage([i for s in full for i in s], [],
                                    [i for s in done for i in s]), full, done)
    assert report.exactly_once and report.steps_identical, report


def test_a_store_stopped_mid_epoch_delays_the_run_but_loses_and_repeats_nothing(
        s3_coords, s3_table, s3_server):
    coord = s3_coords("s3_freeze")
    views = local_views(coord, 2)
    before = step_views(views, 5)
    wait_sealed(coord, 5)
    s3_server.freeze()  # SIGSTOP: requests hang until the server continues
    thaw = threading.Timer(4.0, s3_server.thaw)
    thaw.start()
    try:
        after = step_views(views)
    finally:
        thaw.join()
        s3_server.thaw()
    last = len(before) + len(after)
    wait_sealed(coord, last, timeout=60)
    full = uninterrupted(s3_table)
    done = before + after
    report = compare_steps(coverage([i for s in full for i in s], [],
                                    [i for s in done for i in s]), full, done)
    assert report.exactly_once and report.steps_identical, report
    assert coord.state_dict()["lance_ray"]["global_step"] == last


def test_an_unknown_scheme_for_the_ledger_is_refused_before_the_actor_starts(ray_session,
                                                                            s3_table):
    with pytest.raises(ValueError, match="unsupported storage scheme 'hdfs'"):
        Coordinator.create(s3_table, "bad_scheme", storage_path="hdfs://nn/runs",
                           world_size=2, num_splits=NUM_SPLITS, lease_version=False)
    with pytest.raises(ValueError):  # no actor was created under that name
        ray.get_actor("bad_scheme", namespace=DEFAULT_NAMESPACE)


def ledger_through(port: int):
    """Storage options that send the ledger through a door at ``port`` (credentials and
    region still come from the environment)."""
    def options() -> dict[str, str]:
        return {"aws_endpoint": f"http://127.0.0.1:{port}"}
    return options


def test_a_ledger_write_that_outlasts_its_bound_fails_the_run_with_a_clear_error(
        ray_session, table_1k, s3, s3_server):
    door = Forwarder(s3_server.port)
    kw = {"storage_path": f"{s3}/store", "world_size": 1, "num_splits": NUM_SPLITS,
          "storage_options": ledger_through(door.port),
          "storage_retry": storage.RetryPolicy(timeout_s=1.0)}
    coord = Coordinator.create(table_1k, "bounded", **kw)
    try:
        (view,) = local_views(coord, 1)
        step_views([view], 4)
        wait_sealed(coord, 4)
        door.down()
        with pytest.raises(Exception, match=r"could not write s3://.*coordinator\.json"):
            for _ in range(40):  # the error surfaces at a later report, never skipped
                next(view)
                time.sleep(0.5)
        door.up()
        coord.kill()
        again = Coordinator.create(table_1k, "bounded", **kw)  # the store is back
        sealed = again.status()["sealed_step"]
        assert 4 <= sealed < 40  # the last persisted seal: intact, never ahead of the run
        again.kill()
    finally:
        door.down()
