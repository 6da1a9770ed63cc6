"""Remote LanceDB tables (``db://``) through a LanceDB HTTP stand-in served by this test.

Invariants: over a remote table, every rank gets the reference's sequence on both readers;
the plan costs one ``_rowid`` scan and rows come in bounded row-id takes, every request at
the pinned version; a state resumes exactly; the API key never reaches a checkpoint, a log
line, a repr or a pickle the user did not ask for.

The server (``lancedb_http``) is ours, backed by a real Lance dataset on disk; the client is
the real ``lancedb`` remote client.
"""

from __future__ import annotations

import itertools
import json
import logging
import pickle
import re
import sys
from typing import Any

import lance
import pyarrow as pa
import pytest
from conformance import Path, batch_ids, check_resumes_exactly
from conftest import write_table
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lancedb import streaming as reference
from lancedb_http import Connector, LanceHttpServer

import lance_ray
from lance_ray.plan import remote
from lance_ray.topology import valid_world_sizes

KEY = "sk-remote-test-9f3b"
ROWS = 600
PROPERTY = settings(deadline=None, max_examples=15,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Any:
    """A LanceDB stand-in hosting ``t`` (600 rows in 3 fragments) and ``moving`` (changed
    by tests)."""
    root = tmp_path_factory.mktemp("remote_db")
    fixed = write_table(str(root), ROWS, fragments=3, name="t")
    moving = write_table(str(root), 90, fragments=3, name="moving")
    srv = LanceHttpServer({"t": fixed.to_lance().uri, "moving": moving.to_lance().uri},
                          api_key=KEY)
    yield srv
    srv.close()


def connect(server: LanceHttpServer, name: str = "t") -> Any:
    return Connector(server.url, api_key=KEY)(name)


@pytest.fixture
def table(server) -> Any:
    t = connect(server)
    server.clear()
    return t


def ids(rows: Any) -> list[int]:
    return [r if isinstance(r, int) else r["id"] for r in rows]


def id_list(batch: pa.RecordBatch) -> list[int]:
    """A transform (module level, so Ray ships it)."""
    return batch.column("id").to_pylist()


@pytest.fixture(scope="module")
def ray_ships_this_module(ray_session):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@st.composite
def plans(draw: st.DrawFn) -> dict[str, Any]:
    num_splits = draw(st.integers(1, 12))
    world_size = draw(st.sampled_from(valid_world_sizes(num_splits)))
    return {
        "num_splits": num_splits, "world_size": world_size,
        "rank": draw(st.integers(0, world_size - 1)),
        "shuffle": draw(st.booleans()),
        "shuffle_seed": draw(st.integers(0, 2**32 - 1)),
        "epoch": draw(st.integers(0, 2)),
        "shuffle_clump_size": draw(st.one_of(st.none(), st.integers(1, 40))),
        "filter": draw(st.sampled_from([None, "id % 3 != 0"])),
    }


# ----------------------------------------------------------------------- same sequence


@PROPERTY
@given(kw=plans(), read_batch_size=st.integers(1, 700))
def test_remote_table_gives_the_reference_per_rank_sequence(table, kw, read_batch_size):
    ours = lance_ray.StreamingDataset(table, reader="local", read_batch_size=read_batch_size,
                                      **kw)
    got = ids(ours)
    assert got == ids(reference.StreamingDataset(table, **kw))
    assert len(got) == len(ours)


@pytest.mark.parametrize(("kw", "transform"), [
    pytest.param({"num_splits": 4, "world_size": 2, "rank": 1, "shuffle_seed": 7},
                 None, id="rank1of2-dicts"),
    pytest.param({"num_splits": 6, "world_size": 3, "rank": 2, "shuffle_seed": 3, "epoch": 1,
                  "shuffle_clump_size": 9, "filter": "id % 3 != 0"},
                 id_list, id="clumped-filter-transform"),
])
def test_ray_reader_over_a_remote_table_gives_the_reference_sequence(
        ray_ships_this_module, server, table, kw, transform):
    expected = ids(reference.StreamingDataset(table, transform=transform, **kw))

    def ours() -> lance_ray.StreamingDataset:
        return lance_ray.StreamingDataset(
            table, reader="ray", transform=transform, read_batch_size=37,
            connection_factory=Connector(server.url, api_key=KEY), **kw)

    assert ids(ours()) == expected
    if transform is None:  # the tensor batch path: the conformance check, also after 5 batches
        path = Path("remote iter_batches(16), Ray reader", lambda v: v.iter_batches(16),
                    batch_ids, reader="ray", boundaries=2)
        run = check_resumes_exactly(ours, path, also=[5])
        assert [i for b in run.whole for i in b] == expected


# ----------------------------------------------------------------------- request shapes


def test_each_epoch_plan_is_one_row_id_scan_and_takes_are_bounded_and_pinned(server, table,
                                                                  monkeypatch):
    monkeypatch.setattr(remote, "TAKE_ROWS_PER_REQUEST", 50)
    ds = lance_ray.StreamingDataset(table, num_splits=3, shuffle_seed=1, columns=["id", "v"],
                                    reader="local", read_batch_size=400)
    # One scan for this epoch's plan; the next epoch's waits for that epoch, since each
    # scan is a billed request (a local table builds it ahead, in the background).
    queries = server.of("query")
    assert [q.body.get("columns") for q in queries] == [["_rowid"]]
    reads = server.of("query") + server.of("count_rows")
    assert {r.body.get("version") for r in reads} == {ds.table_version}
    server.clear()
    got = ids(ds)
    assert not [q for q in server.of("query") if q.body.get("columns") == ["_rowid"]]
    assert sorted(got) == list(range(ROWS))
    takes = server.of("query")
    row_lists = [[int(i) for i in re.findall(r"\d+", q.body["filter"].split("IN", 1)[1])]
                 for q in takes]
    assert all(re.fullmatch(r"_rowid IN \([\d, ]+\)", q.body["filter"]) for q in takes)
    assert all(q.body.get("with_row_id") is True for q in takes)
    assert all(q.body["columns"] == ["id", "v"] for q in takes)
    assert max(len(r) for r in row_lists) <= 50
    assert sorted(i for r in row_lists for i in r) == sorted(ds.plan.row_ids.ravel().tolist())
    assert {r.body.get("version") for r in server.requests} == {ds.table_version}
    server.clear()
    ds.set_epoch(1)
    assert sorted(ids(ds)) == list(range(ROWS))
    scans = [q for q in server.of("query") if q.body.get("columns") == ["_rowid"]]
    assert len(scans) == 1  # the next epoch's plan: one scan, when that epoch starts


def reversed_rows(answer: pa.Table) -> pa.Table:
    return answer.take(pa.array(range(answer.num_rows - 1, -1, -1)))


def test_rows_answered_in_any_order_are_put_back_in_plan_order(server, table, monkeypatch):
    monkeypatch.setattr(remote, "TAKE_ROWS_PER_REQUEST", 64)
    kw = {"num_splits": 3, "shuffle_seed": 8, "shuffle_clump_size": 5}
    expected = ids(reference.StreamingDataset(table, **kw))
    monkeypatch.setattr(server, "reshape_takes", reversed_rows)
    assert ids(lance_ray.StreamingDataset(table, reader="local", **kw)) == expected


@pytest.mark.parametrize("reshape", [
    pytest.param(lambda t: t.slice(1), id="a-row-missing"),
    pytest.param(lambda t: pa.concat_tables([t, t.slice(0, 1)]), id="a-row-twice"),
])
def test_a_take_answer_that_is_not_the_planned_rows_is_an_error(server, table, monkeypatch,
                                                                reshape):
    ds = lance_ray.StreamingDataset(table, num_splits=2, reader="local")
    monkeypatch.setattr(server, "reshape_takes", reshape)
    with pytest.raises(RuntimeError, match="no longer holds the planned rows"):
        next(iter(ds))
    assert ds.state_dict()["samples_consumed_per_split"] == [0, 0]


# ----------------------------------------------------------------------- versions


def test_reads_stay_on_the_pinned_version_while_the_table_changes(server):
    uri = server.tables["moving"]
    before = lance.dataset(uri)
    table = connect(server, "moving")
    ds = lance_ray.StreamingDataset(table, num_splits=3, shuffle_seed=2, reader="local")
    first = ids(itertools.islice(iter(ds), 10))
    state = json.loads(json.dumps(ds.state_dict()))
    before.delete("id < 45")  # a new version, half the rows gone
    assert lance.dataset(uri).version == ds.table_version + 1
    rest = ids(ds)
    assert sorted(first + rest) == list(range(90))  # the deleted rows still read: pinned
    again = lance_ray.StreamingDataset(table, num_splits=3, shuffle_seed=2, reader="local",
                                       table_version=state["lance_ray"]["table_version"])
    again.load_state_dict(state)
    assert ids(again) == rest
    older = lance_ray.StreamingDataset(table, num_splits=3, shuffle_seed=2, reader="local",
                                       table_version=1)
    assert len(ids(older)) == 30  # version 1 held the first fragment only
    assert table.version == ds.table_version + 1  # the caller's table was never checked out


def test_a_version_the_server_does_not_hold_is_a_clear_error(table):
    with pytest.raises(ValueError, match="cannot open version 99 of the remote table 't'"):
        lance_ray.StreamingDataset(table, reader="local", table_version=99)


def test_a_factory_that_opens_another_table_is_refused(server, table):
    with pytest.raises(ValueError, match=r"connection_factory\('t'\) must return the remote"):
        lance_ray.StreamingDataset(table, reader="local",
                                   connection_factory=lambda name: connect(server, "moving"))


# ----------------------------------------------------------------------- resume


@PROPERTY
@given(kw=plans(), stop=st.floats(0, 1), batch_size=st.integers(1, 40))
def test_remote_state_resumes_the_rest_of_the_epoch_exactly(table, kw, stop, batch_size):
    """The conformance check (resume, next epoch, end-of-epoch state, one state shape) over a
    remote table, at both ends and at a drawn stop."""
    kw = {**kw, "rank": 0, "world_size": 1}
    path = Path(f"remote iter_batches({batch_size})", lambda v: v.iter_batches(batch_size),
                batch_ids, boundaries=2)
    whole = ids(lance_ray.StreamingDataset(table, reader="local", **kw))
    check_resumes_exactly(lambda: lance_ray.StreamingDataset(table, reader="local", **kw),
                          path, also=[int(stop * len(whole) / batch_size)])


# ----------------------------------------------------------------------- credentials


def test_api_key_never_reaches_a_state_repr_log_or_unasked_pickle(server, table, caplog,
                                                                  monkeypatch):
    caplog.set_level(logging.DEBUG)
    ds = lance_ray.StreamingDataset(table, num_splits=2, reader="local")
    next(iter(ds))
    assert KEY not in json.dumps(ds.state_dict())
    assert KEY not in repr(ds._table) and KEY not in caplog.text
    with pytest.raises(TypeError, match="without connection_factory"):
        pickle.dumps(ds._table)
    monkeypatch.setenv("LANCE_RAY_TEST_KEY", KEY)
    env_factory = Connector(server.url, key_env="LANCE_RAY_TEST_KEY")
    shipped = lance_ray.StreamingDataset(table, num_splits=2, reader="local",
                                         connection_factory=env_factory)
    blob = pickle.dumps(shipped._table)
    assert KEY.encode() not in blob
    reopened = pickle.loads(blob)
    assert reopened.local is None and reopened == shipped._table
    assert reopened.take_rows(shipped.plan.row_ids[0, :3], ["id"]).num_rows == 3


def test_ray_reader_without_connection_factory_names_the_fix(table):
    with pytest.raises(TypeError, match="without connection_factory"):
        lance_ray.StreamingDataset(table, num_splits=2, reader="ray")


def test_storage_options_on_a_remote_table_are_refused(table):
    with pytest.raises(ValueError, match="drop storage_options"):
        lance_ray.StreamingDataset(table, reader="local", storage_options=lambda: {})


def test_coordinator_and_leases_refuse_a_remote_table_by_name(table, tmp_path):
    from lance_ray.driver.handle import Coordinator

    ref = lance_ray.plan.resolve.resolve_table(table)
    with pytest.raises(ValueError, match="remote LanceDB table.*coordinator"):
        lance_ray.plan.table.take_lease(ref, "run")
    with pytest.raises(ValueError, match="coordinator needs a Lance dataset"):
        Coordinator.create(table, "run", storage_path=str(tmp_path), world_size=1,
                           lease_version=False)


def test_loader_workers_reopen_the_remote_table_and_match_the_reference(server, table):
    """DataLoader workers (a fork server) reopen the table with the factory; the batches
    are the reference's sequence and a checkpoint after 3 batches resumes the rest."""
    kw = {"num_splits": 4, "world_size": 2, "rank": 0, "shuffle_seed": 4}
    expected = ids(reference.StreamingDataset(table, **kw))

    def dataset() -> lance_ray.StreamingDataset:
        return lance_ray.StreamingDataset(table, reader="local", read_batch_size=50,
                                          connection_factory=Connector(server.url, api_key=KEY),
                                          **kw)

    ds = dataset()
    loader = lance_ray.StreamingDataLoader(ds, 20, num_workers=2, timeout=60)
    it = iter(loader)
    head = [i for b in itertools.islice(it, 3) for i in b["id"].tolist()]
    state = json.loads(json.dumps(ds.state_dict()))
    it.close()
    resumed = dataset()
    resumed.load_state_dict(state)
    rest = [i for b in lance_ray.StreamingDataLoader(resumed, 20, num_workers=2, timeout=60)
            for i in b["id"].tolist()]
    assert head + rest == expected


def test_loader_workers_without_connection_factory_name_the_fix(table):
    ds = lance_ray.StreamingDataset(table, num_splits=2, reader="local")
    loader = lance_ray.StreamingDataLoader(ds, 10, num_workers=2, timeout=60)
    with pytest.raises(TypeError, match="without connection_factory"):
        next(iter(loader))
    assert ds.state_dict()["lance_ray"]["global_step"] == 0


def test_packing_over_a_remote_table_gives_the_reference_blocks(tmp_path, token_table):
    table, _ = token_table
    srv = LanceHttpServer({"docs": table.to_lance().uri}, api_key=KEY)
    try:
        remote_table = connect(srv, "docs")
        kw = {"num_splits": 2, "columns": ["tokens"], "pack_sequences": 8, "eos_id": 0,
              "pad_id": 1, "blocks_per_epoch": 6}
        ours = lance_ray.StreamingDataset(remote_table, reader="local", **kw)
        theirs = reference.StreamingDataset(remote_table, **kw)
        assert ([(r["input_ids"].tolist(), r["doc_ids"].tolist()) for r in ours]
                == [(r["input_ids"].tolist(), r["doc_ids"].tolist()) for r in theirs])
        with pytest.raises(ValueError, match="blocks_per_epoch='auto'"):
            lance_ray.StreamingDataset(remote_table, reader="local",
                                       **{**kw, "blocks_per_epoch": "auto"})
    finally:
        srv.close()
