"""Which reader a view reads with, how large its reads are, and :class:`Reads`: a view's
reads of a stream, counted by the consumer and resolved by the transform policy.

``reader="auto"`` (the default) reads through Ray Data when this process is connected to a
Ray cluster (``ray.init()`` was called, or it is a Ray task, actor or job driver, or
``RAY_ADDRESS`` names one), and in this process otherwise: starting a Ray cluster just to
read costs seconds to the first batch (most of it ``ray.init``), while the
local reader gives its first batch in a fraction of a second. Both readers give the same
sequence and the same states, so the choice changes only where the reads run.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.utils.data import get_worker_info

from ..checks import positive_int
from ..plan.splits import SplitPlan
from ..plan.table import TableRef
from ..read.batching import Batch, assemble, requests_for, selected_batches
from ..read.documents import DocumentReads
from ..read.local import LocalReader
from ..read.ray_data import RayDataReader
from ..read.requests import (
    PREFETCH_BUDGET_BYTES,
    RAY_READ_TARGET_BYTES,
    READ_TARGET_BYTES,
    ChunkRequest,
    ChunkResult,
    ReadSizing,
)
from ..read.transform import TransformPolicy
from ..read.widths import row_bytes
from ..stream.order import RankStream
from .options import READERS
from .stats import Gauge

logger = logging.getLogger(__name__)
T = TypeVar("T")
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


@dataclass
class Reads:
    """How one view reads its streams: the reader and its settings, fixed when the view is
    made, and the view's ``gauge``, which counts each read as the consumer asks for it and
    as it comes back. Both modes (rows and packed blocks) and the loader's workers read
    through it."""

    table: TableRef
    columns: list[str] | None
    transform: TransformPolicy | None
    kind: str  # "ray" or "local": the reader outside DataLoader workers
    sizing: ReadSizing
    prefetch: int
    threads: int | None
    ray_remote_args: dict[str, Any] | None
    gauge: Gauge

    @property
    def drops(self) -> bool:
        """Whether failed rows drop out of their splits (``skip``/``warn``/a callable)."""
        return self.transform is not None and self.transform.drops_rows

    def reader(self, in_worker: bool, as_tensors: bool,
               documents: DocumentReads | None = None) -> LocalReader | RayDataReader:
        info = get_worker_info()
        return make_reader("local" if in_worker else self.kind, self.table, self.columns,
                           self.transform, as_tensors=as_tensors, prefetch=self.prefetch,
                           sizing=self.sizing, threads=self.threads,
                           ray_remote_args=self.ray_remote_args, documents=documents,
                           processes=1 if info is None else info.num_workers)

    def chunks(self, stream: RankStream, requests: Iterator[ChunkRequest], in_worker: bool,
               as_tensors: bool, documents: DocumentReads | None = None
               ) -> Iterator[ChunkResult]:
        """The reads of ``requests``, counted by the consumer as they are asked for and
        come back."""
        gauge = self.gauge

        def asked() -> Iterator[ChunkRequest]:
            for request in requests:
                gauge.requested += len(request.row_ids)
                yield request

        for chunk in self.reader(in_worker, as_tensors, documents).iter_chunks(asked()):
            gauge.received += len(chunk)
            yield chunk

    def resolved(self, stream: RankStream, chunk: ChunkResult) -> ChunkResult:
        """``chunk`` with the transform policy applied (here, in the consuming process)."""
        if self.transform is None or not isinstance(chunk.payload, list):
            return chunk

        def where(lo: int, hi: int) -> str:
            splits, positions = stream.slice(chunk.seq + lo, chunk.seq + hi)
            rows = list(zip(splits.tolist(), positions.tolist()))
            more = f" and {len(rows) - 4} more" if len(rows) > 4 else ""
            return (f"lance_ray: raised by the transform on (split, position) "
                    f"{rows[:4]}{more} of table version {self.table.version}")

        return ChunkResult(chunk.seq, self.transform.resolve(chunk.payload, where),
                           chunk.cost)

    def read_batches(self, plan: SplitPlan, stream: RankStream, batch_size: int, *,
                     worker: int = 0, num_workers: int = 1, as_tensors: bool = False
                     ) -> Iterator[Batch]:
        """The batches of ``stream`` (of ``plan``) this process makes, read and assembled
        in order. ``as_tensors``: payloads are ``Columns`` (unless a transform makes
        items)."""
        wanted = selected_batches(len(stream), batch_size, worker, num_workers)
        requests = requests_for(plan, stream, [(lo, hi) for _, lo, hi in wanted],
                                self.sizing)
        in_worker = get_worker_info() is not None or num_workers > 1
        chunks = self.chunks(stream, requests, in_worker, as_tensors)
        return closing(assemble((self.resolved(stream, c) for c in chunks), wanted), chunks)

    def read_rows(self, plan: SplitPlan, rows: RankStream, worker: int = 0,
                  num_workers: int = 1, *, documents: DocumentReads | None = None
                  ) -> Iterator[ChunkResult]:
        """Reads ``worker, worker + num_workers, ...`` of ``rows``, policy not yet applied;
        with ``documents``, arranged by split for packing (``read/documents``)."""
        requests = requests_for(plan, rows, [(0, len(rows))], self.sizing,
                                with_splits=documents is not None)
        mine = itertools.islice(requests, worker, None, num_workers)
        in_worker = get_worker_info() is not None or num_workers > 1
        return self.chunks(rows, mine, in_worker, as_tensors=False, documents=documents)


def closing(outer: Iterator[T], inner: Iterator[Any]) -> Iterator[T]:
    """``outer``'s items; ``inner`` (the reads ``outer`` draws from) is closed when
    ``outer`` ends, fails or is closed. An error's traceback keeps the frames of the
    generators it passed through, and with them the reads: without this, a caller that
    keeps the exception would keep a Ray pipeline and its blocks alive."""
    try:
        yield from outer
    finally:
        close = getattr(inner, "close", None)
        if close is not None:
            close()
