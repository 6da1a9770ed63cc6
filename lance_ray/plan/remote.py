"""Remote LanceDB tables (LanceDB Cloud / Enterprise, ``lancedb.connect("db://...")``).

A remote table has no Lance dataset this process can open: everything goes through the
LanceDB client's public API, the way ``lancedb.streaming`` reads such a table. The plan
comes from lancedb's permutation builder on the pinned table (one ``_rowid`` scan through
the remote query route), and rows are taken with ``table.take_row_ids`` (a query filtered
on ``_rowid IN (...)``), at most ``TAKE_ROWS_PER_REQUEST`` row ids per request so that no
request grows with the read size.

Credentials: a ``RemoteTable`` pickles its connection state, API key included. lance_ray
never pickles it. Other processes (Ray read tasks, DataLoader workers) reopen the table
with the user's ``connection_factory(name) -> Table``; without one the table is read only
in the process that opened it.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ..storage import hashable
from .table import TableRef

logger = logging.getLogger(__name__)

ConnectionFactory = Callable[[str], Any]
# Row ids per take request: the ``IN (...)`` list stays around 12 kB whatever the read size.
TAKE_ROWS_PER_REQUEST = 1024
# Take requests of one read in flight at once (a read of 65536 rows is 64 requests).
TAKE_REQUESTS_IN_FLIGHT = 4
ROW_ID = "_rowid"


def is_remote_table(table: Any) -> bool:
    """Whether ``table`` is a LanceDB table served over HTTP (``db://`` connections)."""
    from lancedb.remote.table import RemoteTable

    return isinstance(table, RemoteTable)


@dataclass(frozen=True)
class RemoteTableRef(TableRef):
    """One version of a table behind a LanceDB server, and how to reopen it elsewhere.

    ``uri`` is ``db://<database>/<table>``, for messages only. ``branch`` is the table's
    branch (None: main). ``local`` is a handle pinned to ``version`` in the process that
    resolved the table; it is never pickled.
    """

    name: str = ""
    branch: str | None = None
    connection_factory: ConnectionFactory | None = None
    local: Any = field(default=None, compare=False, repr=False)
    # A plan is a row-id scan through the server, a request the user pays for: build the
    # next epoch's when that epoch starts, as lancedb.streaming does, so that a run that
    # reads one epoch makes one scan.
    plans_ahead = False

    def __repr__(self) -> str:
        return f"RemoteTableRef(uri={self.uri!r}, version={self.version})"

    def __getstate__(self) -> dict[str, Any]:
        self.check_shippable()
        return {**self.__dict__, "local": None}

    def check_shippable(self) -> None:
        if self.connection_factory is None:
            raise TypeError(
                f"{self!r} cannot be sent to another process (a Ray task or a DataLoader "
                "worker) without connection_factory: a RemoteTable would carry its API key "
                "in the pickle. Pass connection_factory=<picklable function (table name) -> "
                "table> that reads the key where it runs, e.g. from the environment, or "
                "read in this process (reader='local', num_workers=0)"
            )

    def open_lance(self) -> Any:
        raise ValueError(
            f"{self!r} is a remote LanceDB table: lance_ray reads it through the LanceDB "
            "API (StreamingDataset), but this operation needs a Lance dataset (a local or "
            "object-store table): plan='index', blocks_per_epoch='auto' (pass the number of "
            "blocks), the coordinator, version leases and the CLI"
        )

    def open_lancedb(self) -> Any:
        """The table pinned to ``version`` (cached per process)."""
        if self.local is not None:
            return self.local
        factory = self.connection_factory
        assert factory is not None  # a ref without local handle was unpickled: has one
        if not hashable(factory):  # cannot be a cache key: reopen for every use
            return _pin(factory(self.name), self.name, self.branch, self.version)
        return _open_pinned(factory, self.name, self.branch, self.version)

    def row_count(self, filter: str | None) -> int:
        return int(self.open_lancedb().count_rows(filter))

    def schema(self) -> pa.Schema:
        return self.open_lancedb().schema

    def take_rows(self, row_ids: np.ndarray, columns: list[str] | None) -> pa.Table:
        """Rows ``row_ids`` at the pinned version, in the given order."""
        table = self.open_lancedb()
        ids = np.asarray(row_ids, dtype=np.uint64)
        if not len(ids):
            schema = table.schema
            return (schema if columns is None
                    else pa.schema([schema.field(c) for c in columns])).empty_table()
        parts = [ids[i : i + TAKE_ROWS_PER_REQUEST]
                 for i in range(0, len(ids), TAKE_ROWS_PER_REQUEST)]

        def fetch(part: np.ndarray) -> pa.Table:
            query = table.take_row_ids(part.tolist()).with_row_id()
            return (query if columns is None else query.select(columns)).to_arrow()

        if len(parts) == 1:
            got = fetch(parts[0])
        else:
            with ThreadPoolExecutor(min(TAKE_REQUESTS_IN_FLIGHT, len(parts)),
                                    thread_name_prefix="lance_ray_take") as pool:
                got = pa.concat_tables(list(pool.map(fetch, parts)))
        return in_row_id_order(got, ids, self)


def in_row_id_order(got: pa.Table, ids: np.ndarray, table: RemoteTableRef) -> pa.Table:
    """``got`` (rows with a ``_rowid`` column, in any order) as the rows of ``ids``, in order.

    The server answers in its own order; a row missing or answered twice is an error, never
    a silently shorter or repeated batch.
    """
    wanted, back = np.unique(ids, return_inverse=True)
    got_ids = got.column(ROW_ID).to_numpy().astype(np.uint64)
    at = np.searchsorted(wanted, got_ids)
    found = at < len(wanted)
    found[found] = wanted[at[found]] == got_ids[found]
    if len(got_ids) != len(wanted) or not found.all() or len(np.unique(at)) != len(wanted):
        raise RuntimeError(
            f"the server returned {len(got_ids)} rows for {len(wanted)} planned row ids of "
            f"{table!r}; the pinned version no longer holds the planned rows"
        )
    where = np.empty(len(wanted), dtype=np.int64)
    where[at] = np.arange(len(at))
    return got.drop_columns([ROW_ID]).take(pa.array(where[back]))


def resolve_remote(table: Any, version: int | None,
                   connection_factory: ConnectionFactory | None) -> RemoteTableRef:
    """A ``RemoteTableRef`` for ``table`` at ``version`` (default: its current version).

    The user's table object is never changed: this process reads through its own pinned
    handle (from ``connection_factory``, or a copy of ``table`` that stays in memory).
    """
    if connection_factory is not None and not callable(connection_factory):
        raise TypeError(
            "connection_factory must be a function (table name) -> LanceDB table, got "
            f"{type(connection_factory).__name__}"
        )
    name, branch = table.name, table.current_branch()
    pinned_version = int(table.version) if version is None else version
    if connection_factory is not None:
        local = _pin(connection_factory(name), name, branch, pinned_version)
    else:
        try:
            # An in-memory copy (the client's own reopen path), so that checking out the
            # pinned version leaves the caller's table as it was.
            own = copy.copy(table)
        except RuntimeError as e:  # a handle without reopen state
            raise ValueError(
                f"cannot reopen the remote table {name!r} ({e}): pass connection_factory="
                "<function (table name) -> table>"
            ) from e
        local = _pin(own, name, branch, pinned_version)
    ref = RemoteTableRef(f"db://{table.db_name}/{name}", pinned_version, None, name, branch,
                         connection_factory, local)
    logger.info("reading remote table %s at version %d", ref.uri, pinned_version)
    return ref


@functools.lru_cache(maxsize=8)
def _open_pinned(factory: ConnectionFactory, name: str, branch: str | None, version: int
                 ) -> Any:
    return _pin(factory(name), name, branch, version)


def _pin(table: Any, name: str, branch: str | None, version: int) -> Any:
    """``table`` checked out at ``version``: every request then names that version."""
    if not is_remote_table(table) or table.name != name:
        raise ValueError(
            f"connection_factory({name!r}) must return the remote LanceDB table {name!r}, got "
            f"{table!r}"
        )
    if table.current_branch() != branch:
        raise ValueError(
            f"connection_factory({name!r}) opened branch {table.current_branch()!r} of "
            f"{name!r}, but the run reads branch {branch!r}: open the same branch"
        )
    try:
        table.checkout(version)
    except Exception as e:  # the client raises by HTTP status
        raise ValueError(
            f"cannot open version {version} of the remote table {name!r}: {e}. If the server "
            "no longer keeps that version, start a new run from the latest version"
        ) from e
    return table
