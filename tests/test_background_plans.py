"""The next epoch's plan is built in the background, and what is handed over is exact.

``BackgroundPlans`` on its own (one build per key, a failure raised and then retried); a
standalone view (local and Ray-task plans) and the coordinator on a real Ray cluster: the
plan handed over at ``set_epoch`` came from the background build and equals the one built on
demand. Also: a coordinator in ``plan="index"`` mode delivers every row once.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import numpy as np
import pytest

import lance_ray
from lance_ray.driver.handle import Coordinator
from lance_ray.plan import sources
from lance_ray.plan.background import BackgroundPlans
from lance_ray.plan.sources import build_part

NUM_SPLITS = 4


def test_a_prefetched_key_is_built_once_and_get_waits_for_that_build():
    release, calls = threading.Event(), []

    def build(key: int) -> int:
        calls.append(key)
        release.wait(10)
        return key * 10

    plans: BackgroundPlans[int, int] = BackgroundPlans(build)
    plans.prefetch(1)
    plans.prefetch(1)
    assert plans.ready(1) is None
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(plans.get(1)))
    waiter.start()
    release.set()
    waiter.join(10)
    assert got == [10] and calls == [1]
    assert (plans.builds, plans.background_hits) == (1, 1)
    assert plans.ready(1) == 10


def test_a_failed_background_build_is_raised_once_then_rebuilt():
    attempts = []

    def build(key: int) -> int:
        attempts.append(key)
        if len(attempts) == 1:
            raise OSError("storage hiccup")
        return key

    plans: BackgroundPlans[int, int] = BackgroundPlans(build)
    plans.prefetch(3)
    assert plans.wait(3, timeout=10)
    with pytest.raises(OSError, match="storage hiccup"):
        plans.get(3)
    assert plans.get(3) == 3 and attempts == [3, 3]


def test_background_builds_of_a_process_run_one_at_a_time():
    """Several views' next plans (a mixture's sources) build one after another, so that
    together they take one core from the reads, not all of them."""
    running, most, lock = [0], [0], threading.Lock()

    def build(key: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return key

    sources = [BackgroundPlans(build) for _ in range(3)]
    for k, plans in enumerate(sources):
        plans.prefetch(k)
    assert [plans.get(k) for k, plans in enumerate(sources)] == [0, 1, 2]
    assert most[0] == 1


def test_only_the_newest_keys_are_kept():
    plans: BackgroundPlans[int, int] = BackgroundPlans(lambda k: k, keep=2)
    for k in range(4):
        plans.get(k)
    assert [plans.ready(k) for k in range(4)] == [None, None, 2, 3]


def assert_same_part(plan_a, plan_b) -> None:
    assert plan_a.identity() == plan_b.identity() and plan_a.fingerprint == plan_b.fingerprint
    assert plan_a.first_split == plan_b.first_split and plan_a.spec == plan_b.spec
    assert np.array_equal(plan_a.row_ids, plan_b.row_ids)


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the background plan never became ready"
        time.sleep(0.05)


def view_hands_over_the_background_plan(table, reader: str) -> None:
    ds = lance_ray.StreamingDataset(table, num_splits=NUM_SPLITS, rank=1, world_size=2,
                                    reader=reader)
    source = ds._plans
    next_key = (ds._spec.for_epoch(1), (2, 3))
    # Not before the first batch is handed over: its reads have the cores to themselves.
    assert not source.plans.wait(next_key, timeout=0) and source.plans.builds == 1
    next(iter(ds.iter_batches(10)))
    assert source.plans.wait(next_key, timeout=60), "epoch 1 was not built in the background"
    ds.set_epoch(1)
    assert source.plans.background_hits == 1
    on_demand = build_part(ds._table, source.rows_after_filter, ds._spec, [2, 3])
    assert_same_part(ds.plan, on_demand)


def test_a_local_view_plans_ahead_after_its_first_batch_a_plan_equal_to_one_built_now(
        table_1k):
    view_hands_over_the_background_plan(table_1k, "local")


def test_a_ray_view_plans_ahead_after_its_first_batch_a_plan_equal_to_one_built_now(
        ray_session, table_1k, monkeypatch):
    monkeypatch.setattr(sources, "REMOTE_PLAN_MIN_ROWS", 0)  # 1k rows: build in a Ray task
    view_hands_over_the_background_plan(table_1k, "ray")


def test_a_ray_view_builds_a_small_plan_in_its_own_process(ray_session, table_1k,
                                                          monkeypatch):
    """A Ray task for a plan of under ``REMOTE_PLAN_MIN_ROWS`` rows would cost more than the
    plan; the plan is the same either way."""
    pids: list[int] = []

    def build_here(*args):
        pids.append(os.getpid())
        return build_part(*args)

    monkeypatch.setattr(sources, "build_part", build_here)
    ds = lance_ray.StreamingDataset(table_1k, num_splits=NUM_SPLITS, rank=1, world_size=2,
                                    reader="ray")
    assert isinstance(ds._plans, sources.RayTaskPlans) and set(pids) == {os.getpid()}
    assert_same_part(ds.plan, build_part(ds._table, 1000, ds._spec, [2, 3]))


@pytest.fixture
def coordinator(ray_session, table_1k, tmp_path):
    made = []

    def create(name: str, **kw) -> Coordinator:
        made.append(Coordinator.create(table_1k, name, storage_path=str(tmp_path),
                                       world_size=2, num_splits=NUM_SPLITS, **kw))
        return made[-1]

    yield create
    for c in made:
        with contextlib.suppress(Exception):
            c.kill()


def test_the_coordinator_builds_the_next_epoch_in_the_background(coordinator):
    coord = coordinator("background_plans")
    view = coord.view(0, 2, reader="local")
    wait_for(lambda: coord.status()["plans_ready"] == [0, 1])
    coord.set_epoch(1)
    view.set_epoch(1)
    on_demand = build_part(view._table, 1000, view._spec, [0, 1])
    assert_same_part(view.plan, on_demand)


def test_a_coordinator_in_index_mode_delivers_every_row_once(coordinator, table_1k):
    coord = coordinator("index_mode", plan="index", shuffle_clump_size=8)
    views = [coord.view(r, 2, reader="local") for r in range(2)]
    assert all(v.plan.row_ids is None and v.identity.plan == "index" for v in views)
    seen = [int(i) for v in views for b in v.iter_batches(16) for i in b["id"].tolist()]
    assert sorted(seen) == list(range(1000))
    assert coord.state_dict()["lance_ray"]["plan"] == "index"
