"""What a coordinator takes back after a restart or a new job, and what it refuses.

Invariant: whatever the coordinator recovers (its ledger, after Ray restarted it or a new job
made it) is the progress of this run's table and plan, and nothing a view has checkpointed
is lost; a restore or a refused call never leaves views reading on abandoned progress, and
never writes progress a view would refuse. Real Lance tables, one shared local Ray.
"""

from __future__ import annotations

import os
import signal
import time

import lancedb
import numpy as np
import pyarrow as pa
import pytest
from conftest import coordinators, wait_sealed
from test_coordinator import GLOBAL_BATCH, NUM_SPLITS, local_views, step_views, uninterrupted

from lance_ray.driver.handle import Coordinator
from lance_ray.state.ledger import StaleReport
from lance_ray.state.reporting import ReportPolicy


@pytest.fixture
def coord_factory(ray_session, table_1k, tmp_path):
    with coordinators(table_1k, str(tmp_path / "store"), world_size=2,
                      num_splits=NUM_SPLITS) as make:
        yield make


def test_reports_acknowledged_by_an_actor_that_died_before_writing_them_are_sent_again(
        coord_factory, table_1k):
    # Ledger writes are throttled: a report acknowledged within PERSIST_EVERY_S of the last
    # write is written later, and dies with the actor if it is killed before. The views'
    # checkpoints must still seal their step.
    coord = coord_factory("lost_report", report_policy=ReportPolicy(every_batches=1))
    views = [coord.view(r, 2, reader="local", read_batch_size=64) for r in range(2)]
    iters = [v.iter_batches(GLOBAL_BATCH // 2) for v in views]
    delivered = []
    for _ in range(10):
        time.sleep(0.3)  # the writes are idle: rank 0's report is written at once, rank 1's
        delivered += step_views(iters, 1)  # is held up to 0.2 s
    deadline = time.monotonic() + 10
    while {r: p["step"] for r, p in coord.status()["ranks"].items()} != {0: 10, 1: 10}:
        assert time.monotonic() < deadline, coord.status()  # both acknowledged
    os.kill(coord.status()["pid"], signal.SIGKILL)  # Ray restarts it from its last write
    assert [v.state_dict()["lance_ray"]["global_step"] for v in views] == [10, 10]
    assert coord.status()["sealed_step"] == 10
    coord.resize(1)  # nothing delivered comes again
    rest = step_views([coord.view(0, 1, reader="local").iter_batches(GLOBAL_BATCH)])
    flat = [i for step in delivered + rest for i in step]
    assert sorted(flat) == sorted(i for b in uninterrupted(table_1k) for i in b)  # each once


def test_a_restore_that_changes_the_progress_stops_the_views_before_it(coord_factory,
                                                                         table_1k):
    coord = coord_factory("restore_stale", report_policy=ReportPolicy(every_batches=1))
    old = local_views(coord, 2)
    step_views(old, 4)
    wait_sealed(coord, 4)
    early = coord.state_dict()
    step_views(old, 2)
    wait_sealed(coord, 6)
    coord.load_state_dict(early)
    with pytest.raises(StaleReport, match="a checkpoint was restored"):
        step_views(old, 1)  # its reports would seal steps of the abandoned progress
    resumed = step_views(local_views(coord, 2))
    assert [sorted(s) for s in resumed] == [sorted(s) for s in uninterrupted(table_1k)[4:]]


def test_a_restarted_group_is_not_disturbed_by_the_dead_groups_late_reports(coord_factory,
                                                                            table_1k):
    # Every rank of a restarted group restores the checkpoint and attaches, one after the
    # other; the dead group's views may still send steps past it (their buffered reports go
    # out late, by design). The first restore begins a new generation even though the
    # ledger already starts from the checkpoint: those reports are refused, the checkpoint's
    # progress stays, and the second rank's restore leaves the first rank's view alone.
    coord = coord_factory("late_reports", report_policy=ReportPolicy(every_batches=50,
                                                                     every_s=1.0))
    dead = local_views(coord, 2)
    step_views(dead, 3)
    wait_sealed(coord, 3)  # sent by the ticker within a second
    checkpoint = coord.state_dict()
    step_views(dead, 2)  # steps 4 and 5, buffered: sent a second later, after the restore
    coord.load_state_dict(checkpoint)  # rank 0's
    rank0 = coord.view(0, 2, reader="local", read_batch_size=64).iter_batches(GLOBAL_BATCH // 2)
    first = next(rank0)["id"].tolist()
    del dead
    time.sleep(2.0)  # the ticker sends the dead views' steps 4 and 5: refused
    assert coord.status()["sealed_step"] == 3
    coord.load_state_dict(checkpoint)  # rank 1's: the same restore again
    rank1 = coord.view(1, 2, reader="local", read_batch_size=64).iter_batches(GLOBAL_BATCH // 2)
    rest = [i for it in (rank0, rank1) for b in it for i in b["id"].tolist()]
    got = sorted(first + rest)
    assert got == sorted(i for s in uninterrupted(table_1k)[3:] for i in s)


def test_refused_states_and_epochs_change_nothing(coord_factory):
    coord = coord_factory("refusals")
    step_views(local_views(coord, 2), 3)
    before = coord.state_dict()
    beyond = {"shuffle_seed": before["shuffle_seed"], "num_splits": NUM_SPLITS, "epoch": 0,
              "samples_consumed_per_split": [10**6] * NUM_SPLITS,
              "positions_consumed_per_split": [10**6] * NUM_SPLITS}  # a lancedb-format state
    with pytest.raises(ValueError, match="beyond the split length"):
        coord.load_state_dict(beyond)
    for epoch in (1.5, -1, 2**62):
        with pytest.raises(ValueError, match="epoch"):
            coord.set_epoch(epoch)
    assert coord.state_dict() == before
    assert len(step_views(local_views(coord, 2))) > 0  # views still start from it


def test_a_new_job_drops_the_dead_jobs_unsealed_reports(coord_factory, tmp_path, table_1k):
    coord = coord_factory("pending", report_policy=ReportPolicy(every_batches=1))
    first = local_views(coord, 2)
    step_views(first, 2)
    next(first[0])  # rank 0 reports step 3; rank 1 never does
    wait = time.monotonic() + 10
    while coord.status()["pending_steps"] != [3]:
        assert time.monotonic() < wait, coord.status()
    coord.kill()
    again = coord_factory("pending")  # a new job: same name and storage path
    assert again.status()["pending_steps"] == []
    # Its ranks read another batch size: step 3 is another step, never refused.
    views = [again.view(r, 2, reader="local").iter_batches(GLOBAL_BATCH) for r in range(2)]
    got = step_views(views)
    assert sorted(i for b in got for i in b) == sorted(i for b in uninterrupted(table_1k)[2:]
                                                       for i in b)


def test_a_ledger_of_a_table_dropped_and_created_again_is_refused(ray_session, tmp_path):
    db = lancedb.connect(tmp_path / "db")
    table = db.create_table("t", pa.table({"id": np.arange(480)}))
    store = str(tmp_path / "store")
    coord = Coordinator.create(table, "recreated", storage_path=store, world_size=2,
                               num_splits=4)
    step_views([coord.view(r, 2, reader="local").iter_batches(24) for r in range(2)], 3)
    coord.state_dict()
    coord.release_version()
    coord.kill()
    db.drop_table("t")
    table = db.create_table("t", pa.table({"id": np.arange(1000, 1480)}))  # same version
    with pytest.raises(ValueError, match="dropped and created again"):
        Coordinator.create(table, "recreated", storage_path=store, world_size=2, num_splits=4)


def test_a_run_with_a_drawn_seed_is_resumed_by_passing_that_seed(coord_factory):
    # shuffle_seed=None draws a new seed at every create: the refusal names the run's own.
    coord = coord_factory("drawn_seed", shuffle_seed=None)
    seed = coord.state_dict()["shuffle_seed"]
    with pytest.raises(ValueError, match=f"to resume it, pass shuffle_seed={seed}$"):
        coord_factory("drawn_seed", shuffle_seed=None)  # a restarted driver, actor live
    coord.kill()
    with pytest.raises(ValueError, match=f"pass shuffle_seed={seed} to resume that run"):
        coord_factory("drawn_seed", shuffle_seed=None)  # a new job
    assert coord_factory("drawn_seed", shuffle_seed=seed).status()["sealed_step"] == 0


def test_a_ledger_is_resumed_when_the_tables_commit_cannot_be_read_now():
    from lance_ray.coordinator.run_file import COMMIT_KEY, check_saved_config

    saved = {"uri": "db/t.lance", "spec": {"num_splits": 4}, COMMIT_KEY: "abc"}
    check_saved_config(saved, {k: v for k, v in saved.items() if k != COMMIT_KEY}, "p", "n")
    check_saved_config({k: v for k, v in saved.items() if k != COMMIT_KEY}, saved, "p", "n")
    with pytest.raises(ValueError, match="dropped and created again"):
        check_saved_config(saved, {**saved, COMMIT_KEY: "def"}, "p", "n")


def test_a_mixture_views_link_keeps_the_coordinators_incarnation_when_pickled():
    import pickle

    from lance_ray.view.mix_attach import MixtureLink

    link = MixtureLink(("mix", "ns"), None, ReportPolicy())  # type: ignore[arg-type]
    link._incarnation = "a"
    assert pickle.loads(pickle.dumps(link))._incarnation == "a"
