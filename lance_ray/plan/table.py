"""A picklable reference to one version of a Lance dataset, and how to open it.

Storage credentials never travel inside a ``TableRef``: pass ``storage_options`` as a
zero-argument factory (for example one that reads the environment), which is called where
the table is opened. Remote LanceDB tables (``db://``) resolve to ``remote.RemoteTableRef``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ..storage import StorageOptionsFactory, hashable

logger = logging.getLogger(__name__)



@dataclass(frozen=True, eq=False)
class ConnectionOptions:
    """The storage options of the connection a LanceDB table was opened with, as a
    ``storage_options`` factory. In this process they are held (``local``, never pickled);
    in another process ``connection_factory`` reopens the table there and gives its
    connection's options, as ``lancedb.streaming`` reopens a table in DataLoader workers."""

    name: str
    connection_factory: Callable[[str], Any] | None
    local: dict[str, str] | None = field(default=None, repr=False)

    def __call__(self) -> dict[str, str]:
        if self.local is not None:
            return dict(self.local)
        assert self.connection_factory is not None  # unpickled: check_shippable held
        return dict(self.connection_factory(self.name).to_lance().initial_storage_options or {})

    def check_shippable(self) -> None:
        if self.connection_factory is None:
            raise TypeError(
                f"LanceDB table {self.name!r} was opened on a connection with storage "
                "options, which lance_ray never pickles (they may hold credentials), so it "
                "cannot be read in another process (a Ray task or a DataLoader worker). Pass "
                "connection_factory=<picklable function (table name) -> table> as for "
                "lancedb.streaming, or storage_options=<zero-argument function -> dict>, or "
                "read in this process (reader='local', num_workers=0)"
            )

    def __getstate__(self) -> dict[str, Any]:
        self.check_shippable()
        return {**self.__dict__, "local": None}


@dataclass(frozen=True)
class TableRef:
    """One version of a Lance dataset: where it is, which version, how to authenticate."""

    uri: str
    version: int
    storage_options: StorageOptionsFactory | None = None
    # Whether the next epoch's plan may be built ahead of need, while this one is read.
    plans_ahead = True

    def __repr__(self) -> str:
        # Never print the options themselves: they may hold credentials.
        return f"TableRef(uri={self.uri!r}, version={self.version})"

    def options(self) -> dict[str, str] | None:
        return self.storage_options() if self.storage_options is not None else None

    def open_lance(self) -> Any:
        """The pinned ``lance.LanceDataset`` (cached per process)."""
        return _open_lance(self.uri, self.version, self.storage_options)

    def open_lancedb(self) -> Any:
        """The pinned table as a LanceDB ``Table`` (what lancedb's plan builder takes)."""
        import lancedb
        from lancedb.table import LanceTable

        # Opened by its location, not by name in its parent directory: a dataset need not
        # be named ``<valid table name>.lance`` (``lance.write_dataset(t, "data/train")``).
        parent = os.path.dirname(self.uri.rstrip("/")) or "."
        options = self.options()
        db = lancedb.connect(parent, storage_options=options)
        table = LanceTable.open(db, "table", location=self.uri, storage_options=options)
        if table.version != self.version:
            table.checkout(self.version)
        return table

    def check_shippable(self) -> None:
        """Raise unless this reference can be sent to other processes (Ray tasks)."""
        if isinstance(self.storage_options, ConnectionOptions):
            self.storage_options.check_shippable()

    def row_count(self, filter: str | None) -> int:
        """Rows of the pinned version that match ``filter`` (all rows for None)."""
        return int(self.open_lance().count_rows(filter=filter))

    def schema(self) -> pa.Schema:
        return self.open_lance().schema

    def column_names(self) -> list[str]:
        return list(self.schema().names)

    def take_rows(self, row_ids: np.ndarray, columns: list[str] | None) -> pa.Table:
        """Rows ``row_ids`` at the pinned version, in the given order."""
        return self.open_lance()._take_rows(row_ids.tolist(), columns=columns)


def table_commit(table: Any) -> str | None:
    """The id of the commit that made ``table``'s pinned version (its Lance transaction's
    uuid), which a version number alone is not: a table dropped and created again reaches
    the same versions with other rows. None where it cannot be read (a remote table, a
    version whose transaction file is gone)."""
    if type(table) is not TableRef:  # a remote table: no Lance dataset here
        return None
    try:
        # A dataset of its own: reading the transaction borrows a Lance dataset mutably, and
        # the cached one may be counting or reading on another thread (RuntimeError:
        # "Already mutably borrowed").
        ds = _open_lance_uncached(table.uri, table.version, table.storage_options)
        return str(ds.read_transaction(table.version).uuid)
    except Exception:  # lance raises by backend; no commit id only skips the check
        return None


def _open_lance(uri: str, version: int, storage_options: StorageOptionsFactory | None) -> Any:
    if not hashable(storage_options):  # a factory that cannot key the cache opens each time
        return _open_lance_uncached(uri, version, storage_options)
    return _open_lance_cached(uri, version, storage_options)


@functools.lru_cache(maxsize=8)
def _open_lance_cached(uri: str, version: int,
                       storage_options: StorageOptionsFactory | None) -> Any:
    return _open_lance_uncached(uri, version, storage_options)


def _open_lance_uncached(uri: str, version: int,
                         storage_options: StorageOptionsFactory | None) -> Any:
    import lance

    try:
        return lance.dataset(
            uri,
            version=version,
            storage_options=storage_options() if storage_options else None,
        )
    except Exception as e:  # lance raises OSError/ValueError/RuntimeError by backend
        raise ValueError(
            f"cannot open version {version} of the Lance dataset at {uri!r}: {e}. Check the "
            "URI and the storage credentials (storage_options); if that version was cleaned "
            "up, restore it or start a new run from the latest version"
        ) from e


def count_rows(table: TableRef, filter: str | None, num_splits: int) -> int:
    """Rows left after ``filter``; raises if there are fewer than ``num_splits``."""
    try:
        rows = table.row_count(filter)
    except Exception as e:
        if filter is None:
            raise
        table.row_count(None)  # a storage or connection error is raised as itself
        raise ValueError(
            f"filter {filter!r} is not a valid SQL predicate for this table: {e}"
        ) from e
    if num_splits > rows:
        raise ValueError(
            f"num_splits ({num_splits}) is larger than the number of rows ({rows}) after the "
            "filter; there must be at least 1 row per split: use fewer splits"
        )
    return rows


def check_columns(table: TableRef, columns: list[str] | None) -> list[str] | None:
    """``columns`` as a list, each once (in the order of first mention, as the reference
    reads them), after checking each exists in the table."""
    if columns is None:
        return None
    if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
        raise TypeError(f"columns must be a list of column names, got {columns!r}")
    if not columns:
        raise ValueError("columns must name at least one column (or be None for all columns)")
    names = table.column_names()
    unknown = [c for c in columns if c not in names]
    if unknown:
        raise ValueError(f"unknown column(s) {unknown}; the table has columns {names}")
    return list(dict.fromkeys(columns))


def lease_tag(run: str) -> str:
    """The Lance tag that pins a run's table version (tags survive version cleanup). A name
    with characters a tag cannot hold gets them replaced and a hash of the whole name, so
    runs ``exp.1`` and ``exp-1`` never share (and release) one tag."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", run)
    if safe != run:
        safe += "-" + hashlib.sha256(run.encode()).hexdigest()[:8]
    return f"lance_ray-{safe}"


def take_lease(table: TableRef, run: str) -> bool:
    """Tag ``table.version`` for ``run`` so cleanup cannot remove it while the run needs it;
    whether this call made the tag (False: the run held it already).

    Raises if the run's tag already pins another version: a run never silently moves to a
    new version of its table.
    """
    tag = lease_tag(run)
    tags = table.open_lance().tags
    held = tags.list().get(tag)
    if held is None:
        tags.create(tag, table.version)
        logger.info("pinned version %d of %s with tag %r", table.version, table.uri, tag)
        return True
    if held["version"] != table.version:
        raise ValueError(
            f"run {run!r} holds version {held['version']} of {table.uri} (tag {tag!r}), not "
            f"version {table.version}: resume with table_version={held['version']}, or "
            f"release the lease (Coordinator.release_version) to start over"
        )
    return False


def release_lease(table: TableRef, run: str) -> None:
    """Drop ``run``'s tag; its version may then be cleaned up."""
    tags = table.open_lance().tags
    if lease_tag(run) in tags.list():
        tags.delete(lease_tag(run))
