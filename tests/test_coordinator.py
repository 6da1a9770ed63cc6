"""The coordinator on a real two-node Ray cluster: one plan, sealed progress, restarts, resize."""

from __future__ import annotations

import time

import pytest
import ray
from conftest import coordinators, wait_sealed

import lance_ray
from lance_ray.driver.handle import Coordinator
from lance_ray.proof.verify import compare_steps, coverage
from lance_ray.state.ledger import StaleReport
from lance_ray.state.reporting import ReportPolicy
from lance_ray.testing.ranks import Rank  # a rank actor: a view in its own process

NUM_SPLITS = 8
GLOBAL_BATCH = 16


def uninterrupted(table) -> list[list[int]]:
    ds = lance_ray.StreamingDataset(table, num_splits=NUM_SPLITS, reader="local")
    return [b["id"].tolist() for b in ds.iter_batches(GLOBAL_BATCH)]


def step_views(views, steps: int | None = None) -> list[list[int]]:
    """Step in-process views (iterators) or view actors in lockstep."""
    out = []
    while steps is None or len(out) < steps:
        if isinstance(views[0], ray.actor.ActorHandle):
            parts = ray.get([v.next.remote() for v in views])
        else:
            parts = [next(v, None) for v in views]
            parts = [None if p is None else p["id"].tolist() for p in parts]
        if all(p is None for p in parts):
            break
        out.append([i for p in parts for i in p])
    return out


def local_views(coord: Coordinator, world_size: int):
    return [coord.view(r, world_size, reader="local", read_batch_size=64)
            .iter_batches(GLOBAL_BATCH // world_size) for r in range(world_size)]


@pytest.fixture
def coord_factory(ray_session, table_1k, tmp_path):
    with coordinators(table_1k, str(tmp_path / "store"), world_size=2,
                      num_splits=NUM_SPLITS) as make:
        yield make


def test_views_on_two_nodes_seal_the_same_state_as_merging_their_own(coord_factory, ray_cluster):
    coord = coord_factory("two_nodes")
    views = [Rank.options(resources={res: 0.01}).remote(r, 2, GLOBAL_BATCH // 2,
                                                         coordinator="two_nodes",
                                                         reader="local", read_batch_size=128)
             for r, res in enumerate(("at_head", "at_w1"))]
    assert len(set(ray.get([v.node.remote() for v in views]))) == 2
    step_views(views, 10)
    wait_sealed(coord, 10)
    merged = lance_ray.merge_state_dicts(ray.get([v.state.remote() for v in views]))
    sealed = coord.state_dict()
    for key in ("samples_consumed_per_split", "positions_consumed_per_split"):
        assert sealed[key] == merged[key]
    assert sealed["lance_ray"]["global_step"] == merged["lance_ray"]["global_step"] == 10
    for v in views:
        ray.kill(v)


def test_a_view_holds_only_its_own_part_of_the_plan(coord_factory, table_1k):
    coord = coord_factory("memory", world_size=4)
    full = lance_ray.StreamingDataset(table_1k, num_splits=NUM_SPLITS, reader="local")
    view = coord.view(1, 4, reader="local")
    assert view.plan.row_ids.nbytes * 4 == full.plan.row_ids.nbytes
    assert view.plan.row_ids.shape[0] == NUM_SPLITS // 4


@pytest.mark.parametrize("reader", ["local", "ray"])
def test_a_standalone_view_holds_only_its_own_part_of_the_plan(table_1k, reader):
    full = lance_ray.StreamingDataset(table_1k, num_splits=NUM_SPLITS, reader="local")
    view = lance_ray.StreamingDataset(table_1k, num_splits=NUM_SPLITS, rank=1, world_size=4,
                                      reader=reader)
    held = view.plan.row_ids if view.plan.row_ids.base is None else view.plan.row_ids.base
    assert held.nbytes * 4 == full.plan.row_ids.nbytes
    assert (view.plan.row_ids == full.plan.row_ids[2:4]).all()


def test_killed_coordinator_restarts_and_the_epoch_continues_exactly(coord_factory, table_1k):
    coord = coord_factory("restart")
    views = local_views(coord, 2)
    before = step_views(views, 12)
    wait_sealed(coord, 12)
    ray.kill(coord.handle, no_restart=False)
    after = step_views(views)
    epoch = [i for s in uninterrupted(table_1k) for i in s]
    report = coverage(epoch, [i for s in before for i in s], [i for s in after for i in s])
    assert report.exactly_once, report
    last = len(before) + len(after)
    wait_sealed(coord, last)
    assert coord.state_dict()["samples_consumed_per_split"] == [len(epoch) // NUM_SPLITS] * 8


def test_a_restarted_trainer_picks_up_from_the_sealed_step(coord_factory, table_1k):
    coord = coord_factory("pickup")
    before = step_views(local_views(coord, 2), 9)
    wait_sealed(coord, 9)
    coord.kill()  # gone for good: a new job re-creates it from storage
    again = coord_factory("pickup")
    assert again.status()["sealed_step"] == 9
    after = step_views(local_views(again, 2))
    full = uninterrupted(table_1k)
    report = compare_steps(coverage([i for s in full for i in s], [i for s in before for i in s],
                                    [i for s in after for i in s]), full, before + after)
    assert report.exactly_once and report.steps_identical, report


def test_resize_2_to_4_to_1_is_exactly_once_with_identical_global_steps(coord_factory, table_1k):
    coord = coord_factory("resize", report_policy=ReportPolicy(every_batches=1))
    two = local_views(coord, 2)
    steps = step_views(two, 7)
    wait_sealed(coord, 7)
    coord.resize(4)
    four = local_views(coord, 4)
    steps += step_views(four, 11)
    with pytest.raises(StaleReport):
        for _ in range(3):  # the old world size's next report is refused, not merged
            next(two[0])
            time.sleep(0.2)
    wait_sealed(coord, 18)
    with pytest.raises(ValueError, match="views of world size 4 are live"):
        coord.view(0, 1, reader="local")  # a stray view never resizes a live run
    coord.load_state_dict(coord.state_dict())  # restore, as a restarted trainer does
    steps += step_views(local_views(coord, 1))  # ... after which a new world size resizes
    full = uninterrupted(table_1k)
    flat = [i for s in steps for i in s]
    report = compare_steps(coverage([i for s in full for i in s], [], flat), full, steps)
    assert report.exactly_once and report.steps_identical, report


def test_a_stale_view_stops_within_one_batch_of_a_resize(coord_factory, table_1k):
    # Default (coalesced) reports: a view's own reports would tell it only within ~0.5 s or
    # 100 batches; the published generation stops it before its very next batch.
    coord = coord_factory("stale", num_splits=12)
    batch = 12
    views = [coord.view(r, 2, reader="local", read_batch_size=64) for r in range(2)]
    two = [v.iter_batches(batch // 2) for v in views]
    before = step_views(two, 5)
    wait_sealed(coord, 5)
    coord.resize(3)
    for view, running in zip(views, two):  # not a single batch more, and it stays stopped
        for it in (running, view.iter_batches(batch // 2)):
            with pytest.raises(StaleReport, match="resized since this view of world size 2"):
                next(it)
    with pytest.raises(StaleReport):  # nor does it move the live views' epoch
        views[0].set_epoch(1)
    with pytest.raises(StaleReport, match="view is stale"):  # the coordinator refuses too
        ray.get(coord.handle.set_epoch.remote(1, 0))
    assert coord.status()["epoch"] == 0
    three = [coord.view(r, 3, reader="local", read_batch_size=64).iter_batches(batch // 3)
             for r in range(3)]
    after = step_views(three)
    full = [b["id"].tolist() for b in lance_ray.StreamingDataset(
        table_1k, num_splits=12, reader="local").iter_batches(batch)]
    flat = [i for s in full for i in s]
    report = compare_steps(coverage(flat, [i for s in before for i in s],
                                    [i for s in after for i in s]), full, before + after)
    assert report.exactly_once and report.steps_identical, report


def test_a_stale_view_of_another_size_is_refused_after_a_restart_or_a_new_epoch(
        coord_factory):
    """While views of the run's world size report, a view of another size is stale (it
    would resize the run under them), also once the actor was restarted or the views moved
    to the next epoch; after a restore or a resize it is the new group."""
    coord = coord_factory("guarded", report_policy=ReportPolicy(every_batches=1))
    views = [coord.view(r, 2, reader="local", read_batch_size=64) for r in range(2)]
    step_views([v.iter_batches(GLOBAL_BATCH // 2) for v in views], 2)
    for v in views:
        v.state_dict()  # recorded, and written
    ray.kill(coord.handle, no_restart=False)
    with pytest.raises(ValueError, match="views of world size 2 are live"):
        coord.view(0, 4, reader="local")
    step_views([v.iter_batches(GLOBAL_BATCH // 2) for v in views])  # to the epoch's end
    for v in views:
        v.set_epoch(1)
    step_views([v.iter_batches(GLOBAL_BATCH // 2) for v in views], 1)
    with pytest.raises(ValueError, match="views of world size 2 are live"):
        coord.view(0, 4, reader="local")
    coord.load_state_dict(coord.state_dict())  # a restarted group restores its checkpoint
    assert coord.view(0, 4, reader="local").world_size == 4


def test_resize_refuses_world_sizes_that_do_not_divide_num_splits(coord_factory):
    coord = coord_factory("bad_resize")
    with pytest.raises(ValueError, match=r"valid world sizes for 8 splits are \[1, 2, 4, 8\]"):
        coord.resize(3)


def test_coordinators_with_different_names_never_see_each_others_progress(coord_factory):
    a, b = coord_factory("run_a"), coord_factory("run_b")
    step_views(local_views(a, 2), 5)
    wait_sealed(a, 5)
    assert b.status()["sealed_step"] == 0
    assert sum(b.state_dict()["samples_consumed_per_split"]) == 0


def test_create_attaches_to_its_own_live_run_and_refuses_another_runs(coord_factory,
                                                                       table_factory,
                                                                       tmp_path):
    coord = coord_factory("shared-name")
    again = Coordinator.create(table_1k_of(coord),
                               "shared-name", storage_path=str(tmp_path / "elsewhere"),
                               world_size=4, num_splits=NUM_SPLITS)
    assert not again.created and ray.get(again.handle.describe.remote()) == ray.get(
        coord.handle.describe.remote())
    other = table_factory(96)
    with pytest.raises(ValueError, match="a live coordinator named 'shared-name' runs another "
                                         "run .*uri"):
        Coordinator.create(other, "shared-name", storage_path=str(tmp_path / "b"),
                           world_size=2, num_splits=NUM_SPLITS)
    with pytest.raises(ValueError, match="spec"):
        Coordinator.create(table_1k_of(coord), "shared-name", storage_path=str(tmp_path / "b"),
                           world_size=2, num_splits=4)
    assert "lance_ray-shared-name" not in other.to_lance().tags.list()  # no tag left on it
    assert coord.status()["num_splits"] == NUM_SPLITS  # the live run goes on unchanged


def test_a_failed_create_leaves_no_version_tag(ray_session, table_factory, tmp_path):
    store = str(tmp_path / "store")
    first = Coordinator.create(table_factory(64), "ledger-owner", storage_path=store,
                               world_size=1, num_splits=4)
    first.kill()  # its ledger stays under store/ledger-owner
    other = table_factory(96)
    with pytest.raises(ValueError, match="different table or plan"):  # as raised in it
        Coordinator.create(other, "ledger-owner", storage_path=store, world_size=1,
                           num_splits=4)
    assert "lance_ray-ledger-owner" not in other.to_lance().tags.list()
    # The refused actor is gone at once: the run's own create right after resumes it.
    again = Coordinator.create(table_factory(64), "ledger-owner", storage_path=store,
                               world_size=1, num_splits=4)
    assert again.created and again.status()["num_splits"] == 4
    again.kill()


def test_a_killed_coordinator_leaves_no_generation_file(coord_factory):
    import os

    from lance_ray.plan.generation import node_path

    coord = coord_factory("tidy")
    view = coord.view(0, 2, reader="local")
    path = node_path(view._plans._watch.name)
    assert os.path.exists(path)
    coord.kill()
    assert not os.path.exists(path)


def table_1k_of(coord: Coordinator):
    """The table ``coord`` reads, as a URI at its version."""
    table, _ = ray.get(coord.handle.describe.remote())
    return table.uri


def test_epochs_advance_for_all_views_without_recreating_the_coordinator(coord_factory, table_1k):
    coord = coord_factory("epochs")
    views = [coord.view(r, 2, reader="local") for r in range(2)]
    for v in views:
        v.set_epoch(1)
    assert coord.status()["epoch"] == 1
    ids = [b["id"].tolist() for v in views for b in v.iter_batches(8)]
    ref = lance_ray.StreamingDataset(table_1k, num_splits=NUM_SPLITS, epoch=1, reader="local")
    assert sorted(i for b in ids for i in b) == sorted(r["id"] for r in ref)


def test_a_checkpoint_state_dict_waits_until_its_step_is_recorded(coord_factory):
    # Reports would otherwise wait a minute: only the checkpoint can have sent them.
    coord = coord_factory("checkpoint_flush",
                          report_policy=ReportPolicy(every_batches=128, every_s=60))
    views = [coord.view(r, 2, reader="local", read_batch_size=64) for r in range(2)]
    iters = [v.iter_batches(GLOBAL_BATCH // 2) for v in views]
    step_views(iters, 6)
    assert coord.status()["sealed_step"] == 0
    states = [v.state_dict() for v in views]  # what lance_ray.train.report saves
    status = coord.status()
    assert status["sealed_step"] == 6
    assert {r: p["step"] for r, p in status["ranks"].items()} == {0: 6, 1: 6}
    merged = lance_ray.merge_state_dicts(states)
    sealed = coord.state_dict(step=6)
    for key in ("samples_consumed_per_split", "positions_consumed_per_split"):
        assert sealed[key] == merged[key]


def test_a_restart_keeps_every_recorded_report_and_checkpoint(coord_factory, table_1k):
    """A rank's report of a step that has not sealed is acknowledged and never sent again:
    a restarted coordinator must still hold it, or the epoch's last step never seals and a
    resize delivers it again. A view's checkpoint (state_dict) is durable when it returns."""
    coord = coord_factory("restart_pending", report_policy=ReportPolicy(every_batches=1))
    views = [coord.view(r, 2, reader="local", read_batch_size=64) for r in range(2)]
    iters = [v.iter_batches(GLOBAL_BATCH // 2) for v in views]
    steps = step_views(iters)
    last = len(steps)
    del iters  # the last step again, one rank at a time, with a restart between them
    coord.load_state_dict(coord.state_dict(step=last - 1))
    views = [coord.view(r, 2, reader="local", read_batch_size=64) for r in range(2)]
    iters = [v.iter_batches(GLOBAL_BATCH // 2) for v in views]
    next(iters[0])
    views[0].state_dict()  # recorded, and durable: the actor is killed right after
    ray.kill(coord.handle, no_restart=False)
    next(iters[1])
    views[1].state_dict()
    assert coord.state_dict()["lance_ray"]["global_step"] == last
    assert [next(it, None) for it in iters] == [None, None]
    coord.resize(1)  # nothing of the epoch is left to deliver again
    assert list(coord.view(0, 1, reader="local").iter_batches(GLOBAL_BATCH)) == []


def test_steps_sealed_before_a_restore_are_not_handed_out_after_it(coord_factory):
    """After restoring an earlier checkpoint, a later step of the abandoned progress is not
    sealed any more: state_dict(step=...) refuses it rather than hand out a state the
    resumed run may never reach."""
    coord = coord_factory("restore_history", report_policy=ReportPolicy(every_batches=1))
    views = local_views(coord, 2)
    step_views(views, 4)
    wait_sealed(coord, 4)
    early = coord.state_dict()  # step 4 (reports may coalesce: not every step is sealed)
    step_views(views, 4)
    wait_sealed(coord, 8)
    coord.state_dict(step=8)  # sealed, before the restore
    coord.load_state_dict(early)
    with pytest.raises(ValueError, match="step 8 of epoch 0 is not sealed"):
        coord.state_dict(step=8)
    again = coord.state_dict(step=4)
    assert again["samples_consumed_per_split"] == early["samples_consumed_per_split"]


def test_status_is_current_within_the_report_interval_when_views_stop(coord_factory):
    coord = coord_factory("status_lag", report_policy=ReportPolicy(every_batches=128,
                                                                   every_s=0.2))
    step_views(local_views(coord, 2), 4)  # the views are dropped with steps still buffered
    status = wait_sealed(coord, 4)
    assert status["report_policy"]["every_s"] == 0.2


def test_an_attached_view_refuses_sample_by_sample_iteration(coord_factory):
    """Samples read one by one make no global step, so the coordinator would never hear of
    them and a resize would deliver them again: such a read is refused, naming the batch
    routes, and the coordinator's progress is untouched."""
    coord = coord_factory("one_by_one")
    view = coord.view(0, 2, reader="local")
    for read in (iter, lambda v: torch_loader(v)):
        with pytest.raises(RuntimeError, match=r"iter_batches\(batch_size\).*"
                                               r"StreamingDataLoader"):
            read(view)
    assert coord.status()["sealed_step"] == 0
    assert next(view.iter_batches(GLOBAL_BATCH // 2))["id"].tolist()


def torch_loader(view):
    from torch.utils.data import DataLoader

    return next(iter(DataLoader(view, batch_size=4)))


def test_a_loader_over_a_coordinators_view_reads_with_workers(coord_factory, table_1k):
    # DataLoader workers are not connected to Ray: the view's coordinator handle travels as
    # its name and is never needed there (the trainer commits and reports).
    coord = coord_factory("loader_workers", world_size=1, report_policy=ReportPolicy(
        every_batches=1))
    loader = lance_ray.StreamingDataLoader(coord.view(0, 1, reader="local"), GLOBAL_BATCH,
                                           num_workers=2)
    got = [b["id"].tolist() for _, b in zip(range(5), loader)]
    assert got == uninterrupted(table_1k)[:5]
    assert loader.state_dict() == coord.state_dict()


def test_ranks_with_different_batch_sizes_checkpoint_exactly_through_the_coordinator(
        coord_factory, table_1k):
    """Their own states break the lockstep assumption (the merge refuses them, naming it);
    the coordinator hears each rank's own splits, so its state resumes exactly."""
    coord = coord_factory("uneven", report_policy=ReportPolicy(every_batches=1))
    views = [coord.view(r, 2, reader="local", read_batch_size=64) for r in range(2)]
    its = [v.iter_batches(size) for v, size in zip(views, (4, 12))]
    seen = [i for _ in range(3) for it in its for i in next(it)["id"].tolist()]
    with pytest.raises(ValueError, match="lockstep states differ.*batch size"):
        lance_ray.merge_state_dicts([v.state_dict() for v in views])
    one = lance_ray.StreamingDataset(table_1k, num_splits=NUM_SPLITS, reader="local")
    one.load_state_dict(coord.state_dict())
    rest = [i for b in one.iter_batches(64) for i in b["id"].tolist()]
    assert sorted(seen + rest) == sorted(i for s in uninterrupted(table_1k) for i in s)
