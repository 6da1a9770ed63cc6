"""``StreamingDataset``: one rank's view of the split plan, as a torch ``IterableDataset``."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..checks import positive_int
from ..plan import pack_args
from ..plan.resolve import resolve_plan
from ..plan.sources import (
    DEFAULT_NAMESPACE,
    CoordinatorPlans,
    LocalPlans,
    PlanSource,
    RayTaskPlans,
    ray_is_up,
)
from ..plan.splits import PlanSpec, SplitPlan, check_epoch_seed
from ..plan.table import StorageOptionsFactory, TableRef, check_columns
from ..read.transform import ErrorPolicy, Transform, make_policy
from ..state import format as st
from ..state.ledger import RankReport
from ..state.merge import merge_state_dicts
from ..stream.cursor import Cursor
from ..stream.order import RankStream
from ..topology import Topology
from .compat import (
    UNTRACKED,
    WorkerInfo,
    current_worker,
    prefetch_depth,
    reference_options,
    worker_share,
)
from .iteration import leased
from .options import DEFAULT_READ_BATCH_SIZE, ReadOptions
from .packed import PackedView
from .placement import placed, placement
from .properties import ViewProperties
from .readers import choose_reader, read_sizing
from .reading import Reading
from .stats import Gauge, Meter, ReferenceCounters, ViewStats

logger = logging.getLogger(__name__)


class StreamingDataset(ViewProperties, PackedView, Reading, ReferenceCounters,
                       IterableDataset):
    """An elastic, exactly-resumable torch ``IterableDataset`` over a Lance / LanceDB table.

    Speaks the language of ``lancedb.streaming.StreamingDataset``: the table (at a pinned
    version, after ``filter``) is split into ``num_splits`` equal splits by lancedb's own
    permutation builder, rank ``r`` of ``world_size`` owns a contiguous block of splits and
    yields one sample per owned split per round-robin cycle. Same arguments give the same
    per-rank sequence as the reference, and its ``state_dict`` loads in either library.

    Differences that matter:

    * Reads (and ``transform``) run in an order-preserving Ray Data pipeline
      (``reader="ray"``; the default ``"auto"`` when Ray is connected) with prefetch and
      backpressure; ``reader="local"`` reads in-process.
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
        on_transform_error: ``"raise"`` (default); ``"skip"`` / ``"warn"`` /
            ``callable(exc) -> bool`` (True skips) drop the failed row from its split as the
            reference does (the split's next row takes its place; ranks may then yield
            different numbers of steps); ``"keep_slot"`` leaves the failed sample out of its
            batch but counts its slot, so every rank yields the same number of steps (use
            it for synchronous DDP); ``"fill"`` delivers ``fill_value`` instead. Failing
            batches are retried row by row: keep transforms deterministic. The policy (and
            a callable) runs in the consuming process.
        read_bytes, read_batch_size: bytes (default 16 MB, 64 MB on the Ray reader, from
            the row width) and most rows per read; reads grow to them from 4 MB (at most
            4096 rows).
        io_queue_depth, prefetch_bytes: reads kept in flight (``prefetch_batches``: the
            deprecated alias), and most bytes of them (default 128 MB).
        reader: ``"auto"`` (default: ``"ray"`` when this process is connected to a Ray
            cluster, else ``"local"``; never starts Ray), ``"ray"`` or ``"local"``.
        table_version: pin this table version (default: the table's current version).
        storage_options: zero-argument factory returning Lance storage options, so that
            credentials are never pickled or logged.
        connection_factory: picklable ``f(table_name) -> table`` that reopens a remote
            (``db://``) table in Ray tasks and DataLoader workers (docs/remote-tables.md).
        ray_remote_args: extra arguments for the Ray Data read and transform tasks.
        plan: ``"lancedb"`` (default): lancedb's own permutation, the reference's exact
            order (its builder stops at about 2.5M shuffled rows); ``"index"``: each row's
            shuffled position computed by a seeded bijection, O(num_splits) memory and no
            build step at any table size, with its own order and checkpoints (docs/plans.md).
        transform_parallelism, transform_queue_depth,
        worker_info_override: ``lancedb.streaming``'s own arguments; see
            :mod:`lance_ray.view.compat` for what each means here.
        pack_sequences, eos_id, pad_id, blocks_per_epoch, pack_position_ids, pack_cu_seqlens:
            sequence packing, as in the reference (docs/packing.md): items and
            batches are ``{"input_ids", "doc_ids"}`` LongTensors of ``pack_sequences`` tokens.
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
        prefetch_batches: int | None = None,
        reader: str = "auto",
        read_bytes: int | None = None,
        prefetch_bytes: int | None = None,
        table_version: int | None = None,
        storage_options: StorageOptionsFactory | None = None,
        ray_remote_args: dict[str, Any] | None = None,
        plan: str = "lancedb",
        # lancedb.streaming's own arguments (view/compat.py says what each maps to)
        io_queue_depth: int | None = None,
        transform_parallelism: int | None = None,
        transform_queue_depth: int | None = None,
        connection_factory: Callable[[str], Any] | None = None,
        worker_info_override: WorkerInfo | None = None,
        pack_sequences: int | None = None, eos_id: int | None = None, pad_id: int | None = None,
        blocks_per_epoch: int | str | None = None, pack_position_ids: bool = False,
        pack_cu_seqlens: bool = False,
    ) -> None:
        super().__init__()
        prefetch_batches = prefetch_depth(prefetch_batches, io_queue_depth)
        options = reference_options(
            transform_parallelism=transform_parallelism,
            transform_queue_depth=transform_queue_depth,
            connection_factory=connection_factory, worker_info_override=worker_info_override)
        positive_int("world_size", world_size)
        num_splits = world_size if num_splits is None else num_splits
        # Packing arguments first, as the reference checks them (before the table is read).
        pack_args.check_pack_arguments(num_splits, pack_sequences, eos_id, pad_id, blocks_per_epoch)
        resolved = resolve_plan(table, num_splits=num_splits, shuffle=shuffle,
                                shuffle_seed=shuffle_seed, epoch=epoch,
                                shuffle_clump_size=shuffle_clump_size, filter=filter, plan=plan,
                                table_version=table_version, storage_options=storage_options,
                                connection_factory=connection_factory)
        table_ref, spec = resolved.table, resolved.spec
        reader = choose_reader(reader)
        if reader == "ray":
            table_ref.check_shippable()  # now, not in the first read task
        # Large plans build in a Ray task when Ray is up, never starting Ray just for the plan
        # (a view read only by DataLoader workers needs no Ray at all).
        remote = reader == "ray" and ray_is_up()
        plans = (RayTaskPlans if remote else LocalPlans)(table_ref, resolved.rows)
        self._packing = pack_args.pack_options(
            table_ref, columns, transform, num_splits, pack_sequences, eos_id, pad_id,
            blocks_per_epoch, pack_position_ids, pack_cu_seqlens)
        read = ReadOptions(columns, make_policy(transform, on_transform_error, fill_value),
                           read_batch_size, prefetch_batches, reader, ray_remote_args, options,
                           read_bytes, prefetch_bytes)
        self._init_view(table_ref, spec, plans, Topology(rank, world_size), read)

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
        io_queue_depth: int | None = None,
        prefetch_batches: int | None = None,
        reader: str = "auto",
        ray_remote_args: dict[str, Any] | None = None,
        pack_position_ids: bool = False,
        pack_cu_seqlens: bool = False,
        **unsupported: Any,
    ) -> StreamingDataset:
        """A view for ``(rank, world_size)`` attached to the coordinator actor ``name``.

        The view receives only its own splits of the plan, starts from the coordinator's
        latest sealed step (so a restarted trainer picks up on its own; a new world size
        resizes the run), and reports its committed progress, coalesced under the coordinator's
        ``report_policy`` and always before a ``state_dict()``. A coordinator created with
        ``pack_sequences`` makes this a packed view of the run's blocks (its state is the
        packed format; ``pack_position_ids``/``pack_cu_seqlens`` add those outputs).
        """
        pack_args.refuse_unsupported(unsupported)
        plans = CoordinatorPlans.connect(name, namespace)
        table_ref, spec = plans.describe()
        self = cls.__new__(cls)
        IterableDataset.__init__(self)
        self._packing = pack_args.attached_packing(plans.packing(), columns, transform,
                                                   pack_position_ids, pack_cu_seqlens)
        if self._packing is not None:
            columns = [self._packing.column]
        read = ReadOptions(columns, make_policy(transform, on_transform_error, fill_value),
                           read_batch_size, prefetch_depth(prefetch_batches, io_queue_depth),
                           reader, ray_remote_args)
        topology = Topology(rank, world_size)
        self._init_view(table_ref, spec, plans, topology, read)
        self.load_state_dict(plans.start(topology))
        return self

    def _init_view(self, table: TableRef, spec: PlanSpec, plans: PlanSource,
                   topology: Topology, read: ReadOptions) -> None:
        self._owned = topology.owned(spec.num_splits)
        self._topology = topology
        rank, world_size = topology.rank, topology.world_size
        self._table = table
        self._columns = check_columns(table, read.columns)
        self._rank, self._world_size = rank, world_size
        self._transform = read.transform
        rows = read.read_batch_size if read.transform is None else \
            read.transform.read_rows(read.read_batch_size)
        self._reader_kind = choose_reader(read.reader)
        self._sizing = read_sizing(table, self._columns, rows, read.read_bytes,
                                   read.prefetch_bytes, reader=self._reader_kind)
        self._prefetch_batches = read.prefetch_batches
        self._ray_remote_args = read.ray_remote_args
        self._plans = plans
        self._options = read.reference
        self._meter = Meter(ViewStats(), rank)
        self._gauge = Gauge()
        # Set by plain DataLoader workers (shared memory, so the trainer sees it).
        self._untracked = torch.zeros(1, dtype=torch.int8).share_memory_()
        self._lease: weakref.ref[Iterator[Any]] | None = None  # the one active iterator
        self._set_plan(spec)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_lease"] = None  # iterators stay in their process
        return state

    def _set_plan(self, spec: PlanSpec) -> None:
        self._install_plan(spec, self._plans.part(spec, self._owned))

    def _install_plan(self, spec: PlanSpec, plan: SplitPlan) -> None:
        """Switch to ``plan`` from its start; any running iterator becomes stale."""
        self._plan, self._identity = plan, plan.identity()
        self._spec = spec
        zeros = [0] * spec.num_splits
        self._new_cursor(zeros, zeros, batches=0, origin=True)
        self._reset_packing()

    def _new_cursor(self, samples: list[int], positions: list[int], *, batches: int,
                    origin: bool) -> None:
        """Start from this progress; ``origin``: it is exact for every split. Any running
        iterator becomes stale."""
        generation = self._cursor.generation if hasattr(self, "_cursor") else 0
        worker, _ = current_worker(self._options.worker_info_override, warn=False)
        self._cursor = Cursor(worker_share(self._owned, worker), list(samples),
                              list(positions), self._plan.split_len, batches=batches,
                              generation=generation + 1,
                              origin=(list(samples), list(positions)) if origin else None)
        self._lease = None
        self._untracked[0] = 0

    def __len__(self) -> int:
        """Samples (packed: blocks) this rank yields in a whole epoch."""
        if self._packing:
            return self._packed_len()
        return len(self._owned) * self._plan.split_len

    # ----------------------------------------------------------------------- progress
    def _stream(self) -> RankStream:
        return self._cursor.stream()

    def _commit(self, samples: int, batches: int = 0) -> None:
        self._cursor.commit(samples, batches)
        if batches and self._plans.wants_reports:  # keep the commit O(1) without a coordinator
            done = self._stream().advanced(self._cursor.consumed)
            report = RankReport(self._rank, self._world_size, self._spec.epoch,
                                self._cursor.batches, done.samples, done.positions)
            self._plans.report(report, final=not len(done))

    @property
    def samples_remaining(self) -> int:
        """Samples (packed: blocks) this rank still has to yield in the current epoch."""
        if self._packing:
            return self._packed_remaining()
        return len(self._stream()) - self._cursor.consumed

    def state_dict(self) -> dict[str, Any]:
        """This rank's consumer-committed progress as plain, JSON-serialisable data.

        Owned splits are exact. The other splits follow from them when every rank (or
        simulated DataLoader worker) delivered as many samples since the epoch's start or
        the last complete state loaded, and no failed row was dropped: then the state is
        marked ``lockstep`` and loads alone on any rank of any valid world size. Otherwise
        they hold the lower bound this view started from: merge the states of every rank
        with :meth:`merge_state_dicts` before resuming elsewhere.
        """
        self._plans.flush()  # a checkpoint's step reaches the coordinator before it is used
        if self._untracked[0] and get_worker_info() is None:
            raise RuntimeError(UNTRACKED)
        if self._packing:
            return self._packed_state_dict()
        c, ws = self._cursor, self._world_size
        if ws == 1 and len(c.splits) == self.num_splits:
            return st.make_state(self._identity, *c.progress(), world_size=1, rank=None,
                                 global_step=c.batches)
        drops = self._transform is not None and self._transform.drops_rows
        derived = None if drops else c.lockstep_progress(self.num_splits)
        if derived is not None:
            # No rank: every rank of a lockstep run writes this same state (one file
            # resumes any topology, as in the reference).
            return st.make_state(self._identity, *derived, world_size=ws, rank=None,
                                 global_step=c.batches, lockstep=True)
        if len(c.splits) != len(self._owned):
            raise RuntimeError(
                "this view reads one DataLoader worker's share of its rank's splits "
                "(worker_info_override) and its progress does not determine the other "
                "workers'; checkpoint through StreamingDataLoader instead"
            )
        return st.make_state(self._identity, *c.progress(), world_size=ws,
                             rank=None if ws == 1 else self._rank, global_step=c.batches)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state``; nothing changes unless the whole state is valid."""
        if self._packing:
            return self._packed_load_state_dict(state)
        progress = st.parse_state(state, self._plan.split_len)
        st.check_compatible(state, self._identity)
        st.check_loadable_on(progress, self._topology)
        self._new_cursor(list(progress.samples), list(progress.positions),
                         batches=progress.global_step or 0,
                         origin=progress.loadable_anywhere)

    merge_state_dicts = staticmethod(merge_state_dicts)

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
        self._install_plan(spec, part)

    # ----------------------------------------------------------------------- reading
    def __iter__(self) -> Iterator[Any]:
        """Yield samples one by one: dicts of Python values, or the transform's items."""
        return leased(self._packed_items if self._packing else self._samples)

    def iter_batches(self, batch_size: int, *, collate_fn: Callable[[list[Any]], Any] | None = None,
                     device: Any = None, pin_memory: bool | None = None) -> Iterator[Any]:
        """Yield batches of ``batch_size`` consecutive samples (the last may be short).

        Without a transform a batch is ``{column: tensor}`` from Arrow, no Python object per
        row: fixed-size lists are 2-D; list-of-number and binary columns are ``{"values",
        "offsets" (int64, rows + 1, from 0), "valid"}`` tensors (docs/transforms.md); strings
        stay lists. With a transform, ``collate_fn`` (default torch's ``default_collate``;
        items stacked where it ran give its result) collates the items.
        Each batch is committed when it is handed over (``state_dict()`` is exact). Under
        ``on_transform_error="keep_slot"`` failed samples are left out, so such a batch is
        smaller (an empty list if none is left) and every rank yields the same number of
        batches; under ``"skip"`` every batch but the last is full.

        ``device="cuda[:N]"``: tensors arrive on that GPU, copied from reused pinned buffers
        on a side stream, the next batch's copy started before this one is handed over
        (``pin_memory=False`` stages in ordinary memory); ``"cpu"`` changes nothing.
        ``pin_memory=True`` alone gives pinned host tensors (docs/gpu.md).
        """
        positive_int("batch_size", batch_size)
        where = placement(device, pin_memory)
        run = self._packed_batches if self._packing else self._batches
        return leased(lambda lease: placed(lambda: run(lease, batch_size, collate_fn), where,
                                           self))
