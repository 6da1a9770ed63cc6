"""``lancedb.streaming`` constructor arguments, and which DataLoader worker reads what.

Every argument of the reference is accepted: each is an alias of ours, is mapped onto the
reader knob it means, or is a validated no-op whose reason is documented here and in
docs/migrating.md.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from torch.utils.data import get_worker_info

from ..checks import positive_or_default

logger = logging.getLogger(__name__)

DEFAULT_PREFETCH_BATCHES = 2
UNTRACKED = ("StreamingDataset cannot checkpoint after a plain torch DataLoader with "
             "num_workers > 0 read it: its workers' progress never reaches this process. Use "
             "StreamingDataLoader instead (lance_ray.StreamingDataLoader), which commits each "
             "batch when next() returns it")


class WorkerInfo(Protocol):
    """What a DataLoader worker is: torch's ``WorkerInfo`` or a stand-in with the same
    two attributes (``worker_info_override``)."""

    id: int
    num_workers: int


@dataclass(frozen=True)
class ReferenceOptions:
    """The reference arguments that change how this view reads.

    ``transform_parallelism``: threads that run the transform in the local reader (default
    1, so user code need not be thread-safe), or the most concurrent transform tasks in
    the Ray reader (default: Ray Data decides). ``worker_info_override``: simulate being
    that DataLoader worker. The rest are validated and kept only to be reported back:
    ``transform_queue_depth`` (reads in flight, ``prefetch_batches``, already bound how many
    transformed rows wait for the consumer) and ``connection_factory`` (used only to reopen
    a LanceDB table in other processes: a remote one, see :mod:`lance_ray.plan.remote`, or
    one whose connection has storage options, see ``plan.table.ConnectionOptions``; other
    tables are reopened from their URI at the pinned version).
    """

    transform_parallelism: int | None = None
    transform_queue_depth: int | None = None
    connection_factory: Callable[[str], Any] | None = None
    worker_info_override: WorkerInfo | None = None


def prefetch_depth(prefetch_batches: int | None, io_queue_depth: int | None) -> int:
    """Reads kept in flight: ``io_queue_depth``; ``prefetch_batches`` is its deprecated alias
    (warned about, as the reference does)."""
    positive_or_default("io_queue_depth", io_queue_depth)
    if prefetch_batches is not None:
        message = ("prefetch_batches is deprecated; use io_queue_depth (the same setting: "
                   "reads kept in flight)")
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        logger.warning(message)
    if io_queue_depth is None:
        return DEFAULT_PREFETCH_BATCHES if prefetch_batches is None else prefetch_batches
    if prefetch_batches is not None and prefetch_batches != io_queue_depth:
        raise ValueError(
            f"prefetch_batches ({prefetch_batches}) and io_queue_depth ({io_queue_depth}) "
            "name the same setting (reads kept in flight); pass only one of them"
        )
    return io_queue_depth


def reference_options(*, transform_parallelism: int | None = None,
                      transform_queue_depth: int | None = None,
                      connection_factory: Callable[[str], Any] | None = None,
                      worker_info_override: WorkerInfo | None = None) -> ReferenceOptions:
    """Validate the reference-only arguments (as the reference does, at construction)."""
    positive_or_default("transform_parallelism", transform_parallelism)
    positive_or_default("transform_queue_depth", transform_queue_depth)
    if connection_factory is not None and not callable(connection_factory):
        raise TypeError("connection_factory must be a callable(table_name) -> Table, got "
                        f"{type(connection_factory).__name__}")
    if worker_info_override is not None:
        for attr in ("id", "num_workers"):
            if not isinstance(getattr(worker_info_override, attr, None), int):
                raise TypeError("worker_info_override must have integer attributes id and "
                                f"num_workers (like torch's WorkerInfo), got "
                                f"{worker_info_override!r}")
    return ReferenceOptions(transform_parallelism, transform_queue_depth, connection_factory,
                            worker_info_override)


def current_worker(override: WorkerInfo | None, *, warn: bool = True
                   ) -> tuple[WorkerInfo | None, bool]:
    """The DataLoader worker this process is (the override wins), and whether this is a
    real torch worker process."""
    real = cast("WorkerInfo | None", get_worker_info())
    if override is not None:
        if real is not None and warn:
            logger.warning(
                "worker_info_override is set inside a real DataLoader worker: the override "
                "decides which splits this worker reads, so workers may read the same rows"
            )
        return override, real is not None
    return real, real is not None


def worker_share(owned: Sequence[int], worker: WorkerInfo | None) -> tuple[int, ...]:
    """The contiguous block of the rank's splits that DataLoader worker ``worker`` reads
    (the rank's every split outside a worker), as the reference assigns them."""
    if worker is None or worker.num_workers == 1:
        return tuple(owned)
    k, n = worker.num_workers, len(owned)
    if k < 1 or not 0 <= worker.id < k:
        raise ValueError(f"worker id {worker.id} is not in [0, {k})")
    if n % k:
        raise ValueError(
            f"Number of rank splits ({n}) must be divisible by num_workers ({k}): they "
            f"cannot be shared evenly by the DataLoader workers; use a num_workers that "
            f"divides {n}, or StreamingDataLoader (any num_workers)"
        )
    per = n // k
    return tuple(owned[worker.id * per:(worker.id + 1) * per])
