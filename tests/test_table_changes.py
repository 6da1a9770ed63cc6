"""Table changes between runs: a paused run resumes exactly on its pinned version, or fails
at start naming the version it needs; it never silently re-plans on a new version."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pyarrow as pa
import pytest
from conftest import wait_sealed, write_table

import lance_ray
from lance_ray.driver.handle import Coordinator
from lance_ray.proof.verify import coverage


@pytest.fixture
def fresh_table(tmp_path):
    return write_table(str(tmp_path / "db"), 800, fragments=4)


def mutate_and_clean_up(table) -> None:
    """Append, delete, compact, and clean up every old version the lease allows."""
    ids = np.arange(10_000, 10_200, dtype=np.int64)
    table.add(pa.table({"id": ids, "x": ids.astype(np.float32),
                        "v": pa.FixedSizeListArray.from_arrays(
                            pa.array(np.repeat(ids, 4).astype(np.float32)), 4)}))
    table.delete("id < 300")
    table.optimize()
    table.to_lance().cleanup_old_versions(older_than=timedelta(0),
                                          error_if_tagged_old_versions=False)


def views(coord: Coordinator, world_size: int = 2):
    return [coord.view(r, world_size, reader="local").iter_batches(16) for r in range(world_size)]


def drain(iterators, steps=None) -> list[int]:
    out = []
    while steps is None or steps > 0:
        parts = [next(i, None) for i in iterators]
        if all(p is None for p in parts):
            break
        out += [x for p in parts if p is not None for x in p["id"].tolist()]
        steps = None if steps is None else steps - 1
    return out


def test_a_paused_run_resumes_exactly_on_its_pinned_version_after_changes_and_cleanup(
        ray_session, fresh_table, tmp_path):
    store = str(tmp_path / "store")
    version = fresh_table.version
    planned = [r["id"] for r in lance_ray.StreamingDataset(fresh_table, num_splits=8,
                                                           reader="local")]
    coord = Coordinator.create(fresh_table, "pinned", storage_path=store, world_size=2,
                               num_splits=8)
    before = drain(views(coord), steps=10)
    wait_sealed(coord, 10)  # the views' last, coalesced reports
    coord.state_dict()  # make the sealed step durable, as a checkpoint would
    coord.kill()
    mutate_and_clean_up(fresh_table)
    assert fresh_table.version > version
    again = Coordinator.create(fresh_table, "pinned", storage_path=store, world_size=2,
                               num_splits=8, table_version=version)
    after = drain(views(again))
    report = coverage(planned, before, after)
    assert report.exactly_once and report.before + report.after == len(planned), report
    again.release_version()
    again.kill()


def test_resuming_on_a_cleaned_up_version_fails_at_start_naming_the_version(fresh_table):
    ds = lance_ray.StreamingDataset(fresh_table, num_splits=8, reader="local")
    state = ds.state_dict()
    version = fresh_table.version
    mutate_and_clean_up(fresh_table)  # nothing holds a lease: the version goes away
    with pytest.raises(ValueError, match=f"cannot open version {version}.*cleaned up"):
        lance_ray.StreamingDataset(fresh_table, num_splits=8, reader="local",
                                   table_version=state["lance_ray"]["table_version"])


def test_an_old_checkpoint_never_loads_into_a_plan_of_the_new_version(fresh_table):
    old = lance_ray.StreamingDataset(fresh_table, num_splits=8, reader="local")
    next(old.iter_batches(8))
    mutate_and_clean_up(fresh_table)
    new = lance_ray.StreamingDataset(fresh_table, num_splits=8, reader="local")
    with pytest.raises(ValueError, match="mismatch"):
        new.load_state_dict(old.state_dict())


def test_a_run_never_moves_its_lease_to_another_version(ray_session, fresh_table, tmp_path):
    coord = Coordinator.create(fresh_table, "moving", storage_path=str(tmp_path), world_size=1,
                               num_splits=4)
    coord.kill()
    fresh_table.delete("id < 10")
    with pytest.raises(ValueError, match="holds version"):
        Coordinator.create(fresh_table, "moving", storage_path=str(tmp_path), world_size=1,
                           num_splits=4)


def test_run_names_that_differ_only_in_punctuation_never_share_a_tag():
    from lance_ray.plan.table import lease_tag

    names = ["exp-1", "exp.1", "exp/1", "exp:1", "exp_1"]
    assert len({lease_tag(n) for n in names}) == len(names)
    assert lease_tag("exp-1") == "lance_ray-exp-1"  # a name a tag can hold keeps its tag


def test_a_checkpoint_never_loads_into_a_table_dropped_and_created_again(tmp_path):
    """The new table reaches the same version number with other rows: refused by name."""
    import lancedb

    db = lancedb.connect(str(tmp_path))
    old = db.create_table("t", pa.table({"id": np.arange(100)}))
    ds = lance_ray.StreamingDataset(old, num_splits=4, reader="local")
    next(ds.iter_batches(8))
    state = ds.state_dict()
    db.drop_table("t")
    new = db.create_table("t", pa.table({"id": np.arange(1000, 1100)}))
    assert new.version == state["lance_ray"]["table_version"]
    again = lance_ray.StreamingDataset(new, num_splits=4, reader="local")
    with pytest.raises(ValueError, match="table_commit mismatch.*dropped and created again"):
        again.load_state_dict(state)
    with pytest.raises(ValueError, match="table_commit mismatch"):
        lance_ray.merge_state_dicts([state, again.state_dict()])
    del state["lance_ray"]["table_commit"]  # a state saved before commits were recorded
    again.load_state_dict(state)
