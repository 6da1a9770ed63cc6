"""``StreamingDataset``: one rank's view of the split plan, as a torch ``IterableDataset``."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

from . import state as st
from .batching import Batch, assemble, requests_for, selected_batches
from .convert import Columns
from .order import RankStream, stream_for
from .plan import (
    PlanSpec,
    SplitPlan,
    check_epoch_seed,
    check_plan_args,
    positive_int,
    rank_splits,
)
from .plan_source import DEFAULT_NAMESPACE, LocalPlans, PlanSource, RayTaskPlans
from .read import FIRST_READ_ROWS, LocalReader, RayDataReader
from .stats import Meter, ViewStats, progress_bar
from .table import StorageOptionsFactory, TableRef, check_columns, count_rows, resolve_table
from .transform import ErrorPolicy, Skipped, Transform, TransformPolicy, check_policy, delivered

logger = logging.getLogger(__name__)

# Large reads: a Ray read task and a Lance take each cost a fixed overhead, and denser row
# ids share pages (measured on 200k rows, full shuffle, local reader: 65536-row reads give
# 2.8x the rows/s of 16384-row ones). Reads start small (read.FIRST_READ_ROWS) and grow.
DEFAULT_READ_BATCH_SIZE = 65536
T = TypeVar("T")
READERS = ("ray", "local")


@dataclass
class _Cursor:
    """Where this view stands: the progress it started from plus what it has delivered."""

    samples: list[int]
    positions: list[int]
    consumed: int = 0  # samples delivered to the consumer since ``samples``/``positions``
    batches: int = 0  # batches delivered since the start of the epoch, when known
    generation: int = 0  # bumped by every new iterator; stale iterators refuse to go on


class StreamingDataset(IterableDataset):
    """An elastic, exactly-resumable torch ``IterableDataset`` over a Lance / LanceDB table.

    Speaks the language of ``lancedb.streaming.StreamingDataset``: the table (at a pinned
    version, after ``filter``) is split into ``num_splits`` equal splits by lancedb's own
    permutation builder, rank ``r`` of ``world_size`` owns a contiguous block of splits and
    yields one sample per owned split per round-robin cycle. Same arguments give the same
    per-rank sequence as the reference, and its ``state_dict`` loads in either library.

    Differences that matter:

    * Reads (and ``transform``) run in an order-preserving Ray Data pipeline
      (``reader="ray"``, the default) with prefetch and backpressure; ``reader="local"``
      reads in-process.
    * ``iter_batches`` yields whole batches as tensors, checkpointable at every batch.
    * ``set_epoch`` moves to the next epoch's plan; iterating after an epoch is exhausted
      starts the next epoch (logged) instead of silently yielding nothing.
    * States are self-describing and ``load_state_dict`` refuses any state that does not
      belong to this plan, topology or step, with an error naming the fix.

    Args:
        table: a LanceDB ``Table``, a ``lance.LanceDataset`` or the URI of a Lance dataset.
        num_splits: fixed number of splits (default ``world_size``); every world size you
            plan to resume on must divide it.
        shuffle, shuffle_seed, epoch, shuffle_clump_size, filter: the plan, as in the
            reference (the per-epoch seed is ``shuffle_seed + 100003 * epoch``).
        rank, world_size: this view's place in the data-parallel group.
        columns: columns to read (default all).
        transform: ``f(pyarrow.RecordBatch) -> sequence`` of one item per row; runs in Ray
            Data tasks. Default items are dicts of the row's Python values.
        on_transform_error: ``"raise"`` (default); ``"skip"`` / ``"warn"`` (leave the failed
            sample out; its slot still counts, so every rank yields the same number of
            steps); ``"fill"`` (deliver ``fill_value`` instead); or ``callable(exc) -> bool``
            (True skips). Failing batches are retried row by row: keep transforms
            deterministic.
        read_batch_size: most rows per read (one sorted Lance take, one Ray read task);
            reads grow to it from 4096 rows. Lower it for wide rows (images): a read holds
            ``read_batch_size`` rows in memory, ``prefetch_batches`` reads ahead.
        prefetch_batches: read chunks kept in flight ahead of the consumer.
        reader: ``"ray"`` or ``"local"``.
        table_version: pin this table version (default: the table's current version).
        storage_options: zero-argument factory returning Lance storage options, so that
            credentials are never pickled or logged.
        ray_remote_args: extra arguments for the Ray Data read tasks (e.g. ``num_cpus``).
    """

    def __init__(
        self,
        table: Any,
        *,
        num_splits: int | None = None,
        shuffle: bool = True,
        shuffle_seed: int | None = 0,
        epoch: int = 0,
        rank: int = 0,
        world_size: int = 1,
        columns: list[str] | None = None,
        filter: str | None = None,
        transform: Transform | None = None,
        on_transform_error: ErrorPolicy = "raise",
        fill_value: Any = None,
        shuffle_clump_size: int | None = None,
        read_batch_size: int = DEFAULT_READ_BATCH_SIZE,
        prefetch_batches: int = 2,
        reader: str = "ray",
        table_version: int | None = None,
        storage_options: StorageOptionsFactory | None = None,
        ray_remote_args: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        positive_int("world_size", world_size)
        num_splits = world_size if num_splits is None else num_splits
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        shuffle_seed = check_plan_args(num_splits=num_splits, shuffle_seed=shuffle_seed,
                                       epoch=epoch, shuffle_clump_size=shuffle_clump_size,
                                       filter=filter)
        table_ref = resolve_table(table, version=table_version, storage_options=storage_options)
        rows = count_rows(table_ref, filter, num_splits)
        spec = PlanSpec(table_ref.version, num_splits, shuffle, shuffle_seed, epoch,
                        shuffle_clump_size, filter)
        # In a Ray task when Ray is up: never start Ray just for the plan (a view read only by
        # DataLoader workers needs no Ray at all).
        remote = reader == "ray" and _ray_is_up()
        plans = (RayTaskPlans if remote else LocalPlans)(table_ref, rows)
        self._init_view(table_ref, spec, plans, rank=rank,
                        world_size=world_size, columns=columns,
                        transform=_policy(transform, on_transform_error, fill_value),
                        read_batch_size=read_batch_size, prefetch_batches=prefetch_batches,
                        reader=reader, ray_remote_args=ray_remote_args)

    @classmethod
    def from_coordinator(
        cls,
        name: str,
        *,
        rank: int,
        world_size: int,
        namespace: str = DEFAULT_NAMESPACE,
        columns: list[str] | None = None,
        transform: Transform | None = None,
        on_transform_error: ErrorPolicy = "raise",
        fill_value: Any = None,
        read_batch_size: int = DEFAULT_READ_BATCH_SIZE,
        prefetch_batches: int = 2,
        reader: str = "ray",
        ray_remote_args: dict[str, Any] | None = None,
    ) -> StreamingDataset:
        """A view for ``(rank, world_size)`` attached to the coordinator actor ``name``.

        The view receives only its own splits of the plan, starts from the coordinator's
        latest sealed step (so a restarted trainer picks up on its own; a new world size
        resizes the run), and reports its committed progress, coalesced under the coordinator's
        ``report_policy`` and always before a ``state_dict()``.
        """
        from .coordinator_plans import CoordinatorPlans

        plans = CoordinatorPlans.connect(name, namespace)
        table_ref, spec = plans.describe()
        self = cls.__new__(cls)
        IterableDataset.__init__(self)
        self._init_view(table_ref, spec, plans, rank=rank, world_size=world_size,
                        columns=columns,
                        transform=_policy(transform, on_transform_error, fill_value),
                        read_batch_size=read_batch_size,
                        prefetch_batches=prefetch_batches, reader=reader,
                        ray_remote_args=ray_remote_args)
        self.load_state_dict(plans.start(rank, world_size))
        return self

    def _init_view(self, table: TableRef, spec: PlanSpec, plans: PlanSource, *, rank: int,
                   world_size: int, columns: list[str] | None,
                   transform: TransformPolicy | None,
                   read_batch_size: int, prefetch_batches: int, reader: str,
                   ray_remote_args: dict[str, Any] | None) -> None:
        positive_int("world_size", world_size)
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
        self._owned = rank_splits(rank, world_size, spec.num_splits)
        positive_int("read_batch_size", read_batch_size)
        positive_int("prefetch_batches", prefetch_batches)
        if reader not in READERS:
            raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
        self._table = table
        self._columns = check_columns(table, columns)
        self._rank, self._world_size = rank, world_size
        self._transform = transform
        self._read_batch_size = read_batch_size
        self._prefetch_batches = prefetch_batches
        self._reader_kind = reader
        self._ray_remote_args = ray_remote_args
        self._plans = plans
        self._meter = Meter(ViewStats(), rank)
        self._set_plan(spec)

    def _set_plan(self, spec: PlanSpec) -> None:
        self._install_plan(spec, *self._plans.part(spec, self._owned))

    def _install_plan(self, spec: PlanSpec, plan: SplitPlan, identity: st.PlanIdentity) -> None:
        """Switch to ``plan`` from its start; any running iterator becomes stale."""
        self._plan, self._identity = plan, identity
        self._spec = spec
        zeros = [0] * spec.num_splits
        generation = getattr(self, "_cursor", _Cursor([], [])).generation
        self._cursor = _Cursor(list(zeros), list(zeros), generation=generation + 1)

    # ----------------------------------------------------------------------- properties

    @property
    def epoch(self) -> int:
        """The epoch whose plan this view reads."""
        return self._spec.epoch

    @property
    def num_splits(self) -> int:
        return self._spec.num_splits

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def global_step(self) -> int:
        """Batches delivered in this epoch (resumed states continue their count)."""
        return self._cursor.batches

    @property
    def table_version(self) -> int:
        """The pinned table version every read goes to."""
        return self._table.version

    @property
    def plan(self) -> SplitPlan:
        """This rank's part of the current epoch's plan."""
        return self._plan

    @property
    def identity(self) -> st.PlanIdentity:
        return self._identity

    def __len__(self) -> int:
        """Samples this rank yields in a whole epoch."""
        return len(self._owned) * self._plan.split_len

    # ----------------------------------------------------------------------- progress

    def _stream(self) -> RankStream:
        c = self._cursor
        return stream_for(self._owned, c.samples, c.positions, self._plan.split_len)

    def _progress(self) -> tuple[list[int], list[int]]:
        c = self._cursor
        samples, positions = list(c.samples), list(c.positions)
        done = self._stream().advanced(c.consumed)
        for split, s, p in zip(done.splits, done.samples, done.positions):
            samples[split], positions[split] = s, p
        return samples, positions

    def _rebase(self) -> RankStream:
        """Fold delivered samples into the start point; returns the remaining stream."""
        samples, positions = self._progress()
        c = self._cursor
        c.samples, c.positions, c.consumed = samples, positions, 0
        return self._stream()

    def _commit(self, samples: int, batches: int = 0) -> None:
        self._cursor.consumed += samples
        self._cursor.batches += batches
        if batches and self._plans.wants_reports:  # keep the commit O(1) without a coordinator
            done = self._stream().advanced(self._cursor.consumed)
            self._plans.report(self._rank, self._world_size, self._spec.epoch,
                               self._cursor.batches, done.samples, done.positions,
                               final=not len(done))

    @property
    def samples_remaining(self) -> int:
        """Samples this rank still has to yield in the current epoch."""
        return len(self._stream()) - self._cursor.consumed

    def state_dict(self) -> dict[str, Any]:
        """This rank's consumer-committed progress as plain, JSON-serialisable data.

        Owned splits are exact; other splits hold the lower bound this view started from.
        Merge the states of every rank with :meth:`merge_state_dicts` before resuming on
        another world size.
        """
        self._plans.flush()  # a checkpoint's step reaches the coordinator before it is used
        samples, positions = self._progress()
        return st.make_state(self._identity, samples, positions, world_size=self._world_size,
                             rank=None if self._world_size == 1 else self._rank,
                             global_step=self._cursor.batches)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state``; nothing changes unless the whole state is valid."""
        progress = st.parse_state(state, self._plan.split_len)
        st.check_compatible(state, self._identity)
        st.check_loadable_on(progress, self._rank, self._world_size)
        generation = self._cursor.generation + 1  # any running iterator is now stale
        self._cursor = _Cursor(list(progress.samples), list(progress.positions),
                               batches=progress.global_step or 0, generation=generation)

    merge_state_dicts = staticmethod(st.merge_state_dicts)

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch``'s plan from its start (no-op if already on it)."""
        check_epoch_seed(self._spec.shuffle_seed, epoch)
        if epoch == self._spec.epoch:
            return
        left = self.samples_remaining
        if left and self._cursor.consumed + sum(self._cursor.samples):
            logger.warning("leaving epoch %d with %d samples of rank %d unread",
                           self._spec.epoch, left, self._rank)
        spec = self._spec.for_epoch(epoch)
        part = self._plans.part(spec, self._owned)  # may fail: nothing has changed yet
        self._plans.set_epoch(epoch)
        self._install_plan(spec, *part)

    def _begin(self) -> tuple[RankStream, int]:
        """Start an iterator: the next epoch if this view itself read this one to its end,
        then a fresh generation.

        Only the view's own reading moves it on: a state just loaded in which this rank's
        splits are complete (other ranks may still be reading the epoch) yields nothing.
        """
        if self.samples_remaining == 0:
            if self._cursor.consumed > 0:
                logger.info("epoch %d is exhausted on rank %d; starting epoch %d",
                            self._spec.epoch, self._rank, self._spec.epoch + 1)
                self.set_epoch(self._spec.epoch + 1)
            else:
                logger.info("rank %d has no samples left in epoch %d; call set_epoch(%d) to "
                            "start the next one", self._rank, self._spec.epoch,
                            self._spec.epoch + 1)
        stream = self._rebase()
        self._cursor.generation += 1
        return stream, self._cursor.generation

    def _check_generation(self, generation: int) -> None:
        if generation != self._cursor.generation:
            raise RuntimeError(
                "this iterator was superseded by a newer iterator, load_state_dict() or "
                "set_epoch(); create a new iterator to continue"
            )

    # ----------------------------------------------------------------------- reading

    def _reader(self, in_worker: bool, as_tensors: bool) -> LocalReader | RayDataReader:
        if self._reader_kind == "local" or in_worker:
            return LocalReader(self._table, self._columns, self._transform,
                               as_tensors=as_tensors, prefetch=self._prefetch_batches)
        return RayDataReader(self._table, self._columns, self._transform,
                             as_tensors=as_tensors, prefetch_batches=self._prefetch_batches,
                             ray_remote_args=self._ray_remote_args)

    def _read_batches(self, stream: RankStream, batch_size: int, *, worker: int = 0,
                      num_workers: int = 1, as_tensors: bool = False) -> Iterator[Batch]:
        """The batches of ``stream`` this process makes, read and assembled in order.

        ``as_tensors``: payloads are ``Columns`` (unless a transform makes items).
        """
        wanted = selected_batches(len(stream), batch_size, worker, num_workers)
        requests = requests_for(self._plan, stream, [(lo, hi) for _, lo, hi in wanted],
                                self._read_batch_size)
        reader = self._reader(get_worker_info() is not None or num_workers > 1, as_tensors)
        return assemble(reader.iter_chunks(requests), wanted)

    def _timed(self, batches: Iterator[T]) -> Iterator[tuple[T, float]]:
        """Each batch with the time the consumer waited for it."""
        while True:
            started = time.monotonic()
            batch = next(batches, None)
            if batch is None:
                return
            yield batch, time.monotonic() - started

    def _delivered(self, size: int, nbytes: int, skipped: int, wait_s: float, *,
                   batches: int) -> None:
        """Commit ``size`` sample slots as consumed and record the delivery."""
        self._commit(size, batches=batches)
        self._meter.record(size, nbytes, skipped, wait_s, batches=batches, where=self._where)

    def _where(self) -> str:
        left = self.samples_remaining
        done = len(self) - left
        rate = self._meter.stats.rows_per_s
        eta = f", ETA {left / rate:.0f}s" if rate > 0 else ""
        return (f"epoch {self._spec.epoch} {progress_bar(done, len(self))} {done}/{len(self)} "
                f"samples ({100.0 * done / max(len(self), 1):.1f}%{eta})")

    @property
    def stats(self) -> ViewStats:
        """Exact counters of what this view delivered (rows, bytes, waits, skips, rate)."""
        return self._meter.stats

    def __iter__(self) -> Iterator[Any]:
        """Yield samples one by one: dicts of Python values, or the transform's items."""
        stream, generation = self._begin()
        if get_worker_info() is not None:
            logger.warning("iterating a StreamingDataset in a plain DataLoader worker: use "
                           "StreamingDataLoader so checkpoints count only consumed batches")
        # Batches the size of the first read: cut from the growing reads, rarely re-joined.
        group = min(self._read_batch_size, FIRST_READ_ROWS)
        for batch, wait_s in self._timed(self._read_batches(stream, group)):
            rows = batch.payload if isinstance(batch.payload, list) else batch.payload.to_pylist()
            nbytes = 0 if isinstance(batch.payload, list) else batch.payload.nbytes
            for i, row in enumerate(rows):
                self._check_generation(generation)
                skipped = isinstance(row, Skipped)
                # The chunk's bytes and wait are booked with its first row.
                self._delivered(1, 0 if i else nbytes, int(skipped), 0.0 if i else wait_s,
                                batches=0)
                if not skipped:
                    yield row

    def iter_batches(self, batch_size: int, *, collate_fn: Callable[[list[Any]], Any] | None = None
                     ) -> Iterator[Any]:
        """Yield batches of ``batch_size`` consecutive samples (the last may be short).

        Without a transform a batch is ``{column: tensor}`` built straight from Arrow (lists
        for non-numeric columns); with one, ``collate_fn`` (default torch's
        ``default_collate``) collates the items. Each batch is committed when it is handed
        over, so ``state_dict()`` between batches is exact. Samples whose transform failed
        under ``on_transform_error="skip"`` are left out, so such a batch is smaller (an
        empty list if none is left); every rank still yields the same number of batches.
        """
        positive_int("batch_size", batch_size)
        stream, generation = self._begin()
        batches = self._read_batches(stream, batch_size, as_tensors=collate_fn is None)
        for batch, wait_s in self._timed(batches):
            out, nbytes, skipped = collate(batch.payload, collate_fn)
            self._check_generation(generation)
            self._delivered(batch.size, nbytes, skipped, wait_s, batches=1)
            yield out

    def sample_positions(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``(split, position)`` of the next samples ``start .. stop-1`` (for logging/tests)."""
        remaining = self._stream().advanced(self._cursor.consumed)
        splits, positions = remaining.slice(start, stop)
        return list(zip(splits.tolist(), positions.tolist()))


def collate(payload: Any, collate_fn: Callable[[list[Any]], Any] | None
            ) -> tuple[Any, int, int]:
    """One assembled batch as the trainer receives it, its Arrow bytes and skipped count.

    Arrow payloads only come with a ``collate_fn``: without one the reader already made
    ``Columns`` (``_read_batches(as_tensors=True)``).
    """
    if isinstance(payload, list):
        kept, skipped = delivered(payload)
        if not kept:
            return [], 0, skipped
        if collate_fn is None:
            from torch.utils.data import default_collate

            return default_collate(kept), 0, skipped
        return collate_fn(kept), 0, skipped
    if isinstance(payload, Columns):
        return payload.data, payload.nbytes, 0
    assert collate_fn is not None, "Arrow payloads are read only for a collate_fn"
    return collate_fn(payload.to_pylist()), payload.nbytes, 0


def _ray_is_up() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _policy(transform: Transform | None, on_error: ErrorPolicy, fill_value: Any
            ) -> TransformPolicy | None:
    check_policy(on_error)
    if transform is None:
        if on_error != "raise":
            raise ValueError("on_transform_error needs a transform: without one nothing can fail")
        return None
    if not callable(transform):
        raise TypeError(f"transform must be callable, got {type(transform).__name__}")
    return TransformPolicy(transform, on_error, fill_value)
