"""``StreamingDataset``: one rank's view of the split plan, as a torch ``IterableDataset``."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from ..checks import numpy_scalars_accepted, positive_int
from ..coordinator.client import DEFAULT_NAMESPACE, CoordinatorPlans, refuse_sample_reads
from ..plan import pack_args
from ..plan.resolve import resolve_plan
from ..plan.sources import LocalPlans, RayTaskPlans, ray_is_up
from ..plan.table import StorageOptionsFactory
from ..read.transform import ErrorPolicy, Transform, make_policy
from ..state.merge import merge_state_dicts
from ..state.mixture import MixtureRun
from ..topology import Topology
from .compat import UNTRACKED, WorkerInfo, prefetch_depth, reference_options
from .core import Mode, ViewCore
from .iteration import leased
from .options import DEFAULT_READ_BATCH_SIZE, ReadOptions
from .packed import PackedMode
from .placement import placed, placement
from .readers import choose_reader
from .reading import Pass, RowMode


class StreamingDataset(ViewCore, IterableDataset):
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
            shuffled position computed by a seeded bijection, O(num_splits + fragments)
            memory (plus 4 bytes per matching row with a filter or deleted rows) and no
            build step at any table size, with its own order and checkpoints (docs/plans.md).
        transform_parallelism, transform_queue_depth,
        worker_info_override: ``lancedb.streaming``'s own arguments; see
            :mod:`lance_ray.view.compat` for what each means here.
        pack_sequences, eos_id, pad_id, blocks_per_epoch: sequence packing, as in the
            reference (docs/packing.md): items and batches are ``{"input_ids", "doc_ids"}``
            LongTensors of ``pack_sequences`` tokens.
        pack_position_ids, pack_cu_seqlens: lance_ray's additions to packing: each block
            also carries ``position_ids`` (restarting at every document), or ``cu_seqlens``
            and ``max_seqlen`` (the documents' boundaries, for varlen attention).
    """

    @numpy_scalars_accepted
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
        packing = pack_args.pack_options(
            table_ref, columns, transform, num_splits, pack_sequences, eos_id, pad_id,
            blocks_per_epoch, pack_position_ids, pack_cu_seqlens)
        read = ReadOptions(columns, make_policy(transform, on_transform_error, fill_value),
                           read_batch_size, prefetch_batches, reader, ray_remote_args, options,
                           read_bytes, prefetch_bytes)
        self._init_view(table_ref, spec, plans, Topology(rank, world_size), read,
                        mode_for(packing))

    @classmethod
    @numpy_scalars_accepted
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
        described = plans.describe()
        if isinstance(described, MixtureRun):
            raise ValueError(f"coordinator {name!r} reads a mixture of tables, not one table: "
                             "attach with MixtureDataset.from_coordinator (or Coordinator.view, "
                             "or lance_ray.train.get_dataset in a Ray Train worker)")
        table_ref, spec = described
        self = cls.__new__(cls)
        IterableDataset.__init__(self)
        packing = pack_args.attached_packing(plans.packing(), columns, transform,
                                             pack_position_ids, pack_cu_seqlens)
        if packing is not None:
            columns = [packing.column]
        read = ReadOptions(columns, make_policy(transform, on_transform_error, fill_value),
                           read_batch_size, prefetch_depth(prefetch_batches, io_queue_depth),
                           reader, ray_remote_args)
        topology = Topology(rank, world_size)
        self._init_view(table_ref, spec, plans, topology, read, mode_for(packing))
        self.load_state_dict(plans.start(topology))
        return self

    def __len__(self) -> int:
        """Samples (packed: blocks) this rank yields in a whole epoch."""
        return len(self._mode)

    @property
    def samples_remaining(self) -> int:
        """Samples (packed: blocks) this rank still has to yield in the current epoch."""
        return self._mode.remaining

    @property
    def mode(self) -> RowMode | PackedMode:
        """This view's iteration object: :class:`RowMode`, or :class:`PackedMode` with
        ``pack_sequences`` (what ``StreamingDataLoader`` reads through)."""
        mode = self._mode
        assert isinstance(mode, (RowMode, PackedMode))
        return mode

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
        return self._mode.state_dict()

    @numpy_scalars_accepted
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state``; nothing changes unless the whole state is valid."""
        self._mode.load_state_dict(state)

    merge_state_dicts = staticmethod(merge_state_dicts)

    # ----------------------------------------------------------------------- reading
    def begin_pass(self, lease: weakref.ref[Iterator[Any]] | None = None) -> Pass:
        """Start a row-mode pass for iterator ``lease`` (see :meth:`RowMode.begin_pass`)."""
        return self._rows().begin_pass(lease)

    def _rows(self) -> RowMode:
        mode = self._mode
        if not isinstance(mode, RowMode):
            raise TypeError("a packed view (pack_sequences) has no row-mode passes")
        return mode

    def __iter__(self) -> Iterator[Any]:
        """Yield samples one by one: dicts of Python values, or the transform's items."""
        if self._plans.wants_reports:
            refuse_sample_reads()
        return leased(self._mode.items)

    @numpy_scalars_accepted
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
        run = self._mode.batches
        return leased(lambda lease: placed(lambda: run(lease, batch_size, collate_fn), where,
                                           self))


def mode_for(packing: pack_args.PackOptions | None) -> Callable[[ViewCore], Mode]:
    """The iteration object a view of these packing options makes."""
    return RowMode if packing is None else partial(PackedMode, options=packing)
