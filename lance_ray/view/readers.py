"""Which reader a view reads with, and how large its reads are.

``reader="auto"`` (the default) reads through Ray Data when this process is connected to a
Ray cluster (``ray.init()`` was called, or it is a Ray task, actor or job driver, or
``RAY_ADDRESS`` names one), and in this process otherwise: starting a Ray cluster just to
read costs seconds to the first batch (most of it ``ray.init``), while the
local reader gives its first batch in a fraction of a second. Both readers give the same
sequence and the same states, so the choice changes only where the reads run.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from ..checks import positive_int
from ..plan.table import TableRef
from ..read.documents import DocumentReads
from ..read.local import LocalReader
from ..read.ray_data import RayDataReader
from ..read.requests import (
    PREFETCH_BUDGET_BYTES,
    RAY_READ_TARGET_BYTES,
    READ_TARGET_BYTES,
    ReadSizing,
)
from ..read.transform import TransformPolicy
from ..read.widths import row_bytes
from .options import READERS

logger = logging.getLogger(__name__)
_told: list[bool] = []  # "auto" chose the local reader: said once per process


def ray_connected() -> bool:
    """Whether this process is, or will be at its first Ray call, attached to a cluster
    (never starts one)."""
    ray = sys.modules.get("ray")
    return bool(os.environ.get("RAY_ADDRESS")) or (ray is not None and ray.is_initialized())


def choose_reader(reader: str) -> str:
    """``"ray"`` or ``"local"`` for the ``reader`` argument; raises naming the choices."""
    if reader not in READERS:
        raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
    if reader != "auto":
        return reader
    if ray_connected():
        return "ray"
    if not _told:
        _told.append(True)
        logger.info("no Ray cluster is connected (ray.init() not called, RAY_ADDRESS unset): "
                    "reading in this process (reader='local'). Call ray.init() before "
                    "building the dataset, or pass reader='ray', to read through Ray Data")
    return "local"


def read_sizing(table: TableRef, columns: list[str] | None, read_batch_size: int,
                read_bytes: int | None, prefetch_bytes: int | None, *,
                reader: str = "local") -> ReadSizing:
    """The view's read sizes: ``read_bytes`` per read (from the columns' row width; by
    default larger for the ``"ray"`` reader, see ``RAY_READ_TARGET_BYTES``), at most
    ``read_batch_size`` rows, ``prefetch_bytes`` in flight."""
    positive_int("read_batch_size", read_batch_size)
    positive_int("read_bytes", read_bytes, allow_none=True)
    positive_int("prefetch_bytes", prefetch_bytes, allow_none=True)
    if read_bytes is None:
        read_bytes = RAY_READ_TARGET_BYTES if reader == "ray" else READ_TARGET_BYTES
    return ReadSizing(read_batch_size, row_bytes(table, columns), read_bytes,
                      PREFETCH_BUDGET_BYTES if prefetch_bytes is None else prefetch_bytes,
                      prefetch_bytes is not None)


def make_reader(kind: str, table: TableRef, columns: list[str] | None,
                transform: TransformPolicy | None, *, as_tensors: bool, prefetch: int,
                sizing: ReadSizing, threads: int | None,
                ray_remote_args: dict[str, Any] | None,
                documents: DocumentReads | None = None,
                processes: int = 1) -> LocalReader | RayDataReader:
    """The reader of kind ``kind`` (``"ray"`` or ``"local"``); a local reader shares the
    cores with ``processes - 1`` others (DataLoader workers)."""
    if kind == "local":
        return LocalReader(table, columns, transform, as_tensors=as_tensors,
                           prefetch=prefetch, transform_threads=threads, sizing=sizing,
                           documents=documents, processes=processes)
    return RayDataReader(table, columns, transform, as_tensors=as_tensors,
                         prefetch_batches=prefetch, ray_remote_args=ray_remote_args,
                         transform_tasks=threads, sizing=sizing, documents=documents)
