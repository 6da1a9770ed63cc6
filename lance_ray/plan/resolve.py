"""From what a user passes to a plan: the one place that checks the plan arguments, pins the
table (local, object store or remote) and counts its rows. Views, the coordinator and the
CLI all start here."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..checks import positive_int
from ..storage import StorageOptionsFactory
from .remote import is_remote_table, resolve_remote
from .splits import PlanSpec, check_plan_args
from .table import ConnectionOptions, TableRef, _open_lance_uncached, count_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedPlan:
    """A pinned table, the plan spec over it, and its row count after the filter."""

    table: TableRef
    spec: PlanSpec
    rows: int


def resolve_plan(
    table: Any,
    *,
    num_splits: int,
    shuffle: bool = True,
    shuffle_seed: int | None = 0,
    epoch: int = 0,
    shuffle_clump_size: int | None = None,
    filter: str | None = None,
    plan: str = "lancedb",
    table_version: int | None = None,
    storage_options: StorageOptionsFactory | None = None,
    connection_factory: Callable[[str], Any] | None = None,
) -> ResolvedPlan:
    """Check the plan arguments, pin ``table`` and count its rows; raises naming the fix."""
    if not isinstance(shuffle, bool):
        raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
    seed = check_plan_args(num_splits=num_splits, shuffle_seed=shuffle_seed, epoch=epoch,
                           shuffle_clump_size=shuffle_clump_size, filter=filter, plan=plan)
    ref = resolve_table(table, version=table_version, storage_options=storage_options,
                        connection_factory=connection_factory)
    rows = count_rows(ref, filter, num_splits)
    spec = PlanSpec(ref.version, num_splits, shuffle, seed, epoch, shuffle_clump_size, filter,
                    plan)
    return ResolvedPlan(ref, spec, rows)


def resolve_table(
    table: Any,
    *,
    version: int | None = None,
    storage_options: StorageOptionsFactory | None = None,
    connection_factory: Callable[[str], Any] | None = None,
) -> TableRef:
    """A ``TableRef`` for a LanceDB ``Table``, a ``lance.LanceDataset`` or a dataset URI.

    ``version=None`` pins the table's current version. ``connection_factory`` (table name
    -> table) reopens a remote table in other processes; local tables are reopened from
    their URI and do not need it.
    """
    positive_int("table_version", version, allow_none=True)
    if is_remote_table(table):
        if storage_options is not None:
            raise ValueError(
                "storage_options configure Lance storage; a remote LanceDB table is read "
                "through its server: drop storage_options (reopen it in other processes "
                "with connection_factory)"
            )
        return resolve_remote(table, version, connection_factory)
    if storage_options is not None and not callable(storage_options):
        raise TypeError(
            "storage_options must be a zero-argument callable returning a dict (so that "
            "credentials are never pickled or logged), e.g. "
            "storage_options=lambda: {'aws_access_key_id': os.environ['KEY']}"
        )
    if isinstance(table, str | os.PathLike):
        import lance

        uri = os.fspath(table)
        if uri.startswith("db://"):
            raise ValueError(
                f"{uri!r} names a remote LanceDB table, which has no Lance dataset to open by "
                "URI: pass the table itself (lancedb.connect(...).open_table(name), with "
                "connection_factory) to StreamingDataset; the CLI, the coordinator, "
                "plan='index' and version leases need a Lance dataset (docs/remote-tables.md)")
        try:
            current = lance.dataset(
                uri, storage_options=storage_options() if storage_options else None
            ).version
        except Exception as e:
            raise ValueError(f"no Lance dataset at {uri!r}: {e}") from e
    elif hasattr(table, "to_lance"):  # a LanceDB table
        check_not_in_memory(table)
        ds = table.to_lance()
        uri, current = ds.uri, table.version
        if storage_options is None and (connection_factory is not None
                                        or ds.initial_storage_options):
            storage_options = ConnectionOptions(table.name, connection_factory,
                                                ds.initial_storage_options)
    elif hasattr(table, "uri") and hasattr(table, "version"):  # a lance.LanceDataset
        uri, current = table.uri, table.version
    else:
        raise TypeError(
            "table must be a LanceDB Table, a lance.LanceDataset or the URI of a Lance "
            f"dataset, got {type(table).__name__}"
        )
    if connection_factory is not None and not isinstance(storage_options, ConnectionOptions):
        logger.info("connection_factory reopens LanceDB tables; %s is reopened from its URI",
                    type(table).__name__)
    if version is None:
        version = int(current)
    ref = TableRef(str(uri), int(version), storage_options)
    # Fail here, naming the version, if it no longer exists (the per-process cache of open
    # datasets could still hold it after a cleanup).
    _open_lance_uncached(ref.uri, ref.version, storage_options)
    return ref


def check_not_in_memory(table: Any) -> None:
    """Refuse a table of a ``memory://`` LanceDB connection: it has no dataset that
    lance_ray's readers could open by URI."""
    connection = getattr(table, "_conn", None)
    if str(getattr(connection, "uri", "")).startswith("memory://"):
        raise ValueError(
            f"LanceDB table {getattr(table, 'name', '?')!r} lives in a memory:// connection, "
            "which has no dataset that other readers can open: lance_ray reads Lance datasets "
            "by URI. Write it to a directory or object store first (e.g. "
            "lancedb.connect('data').create_table(name, table.to_arrow()))"
        )
