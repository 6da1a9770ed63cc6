"""What every mode of a view shares: its plan, topology and readers, its commit point (the
cursor), the rule of one live iterator, the handover of progress, and the read-only
properties and counters a view shows.

``StreamingDataset`` is this core plus its constructors and public methods; how it iterates
is one :class:`Mode` object (``view/reading.py``: rows; ``view/packed.py``: packed blocks)
that holds its own progress and reads the core's plan.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch.utils.data import get_worker_info

from ..checks import numpy_scalars_accepted
from ..plan.sources import PlanSource
from ..plan.splits import PlanSpec, SplitPlan, check_epoch_seed
from ..plan.table import TableRef, check_columns, table_commit
from ..state import format as st
from ..state.contract import Stateful
from ..stream.cursor import Cursor
from ..topology import Topology
from .compat import ReferenceOptions, WorkerInfo, current_worker, worker_share
from .device import FeedStats
from .iteration import CONCURRENT, Lease
from .options import ReadOptions
from .readers import Reads, choose_reader, read_sizing
from .stats import Gauge, Meter, ViewStats, progress_bar

logger = logging.getLogger("lance_ray.view.dataset")


class Mode(Stateful, Protocol):
    """One way of iterating a view (rows, or packed blocks): it holds that mode's progress
    and makes the view's iterators, states and counts from it."""

    @property
    def packed(self) -> bool:
        """Whether the mode yields packed token blocks."""

    def reset(self) -> None:
        """The view's plan was just installed: start its epoch from the beginning."""

    def __len__(self) -> int:
        """Samples (packed: blocks) this rank yields in a whole epoch."""

    @property
    def remaining(self) -> int:
        """Samples (packed: blocks) this rank still has to yield in the current epoch."""

    @property
    def rolls_over(self) -> bool:
        """Whether the next iteration starts the next epoch: this view read the current one
        to its end (a state loaded at its end yields nothing instead)."""

    def items(self, lease: Lease) -> Iterator[Any]:
        """The view's ``__iter__``: one sample (block) at a time."""

    def batches(self, lease: Lease, batch_size: int,
                collate_fn: Callable[[list[Any]], Any] | None) -> Iterator[Any]:
        """The view's ``iter_batches``: ``batch_size`` samples (blocks) at a time."""


class ViewCore:
    """The state every mode of a :class:`~lance_ray.view.dataset.StreamingDataset` shares,
    and the rules its iterators keep."""

    _device_stats: FeedStats | None = None

    def _init_view(self, table: TableRef, spec: PlanSpec, plans: PlanSource,
                   topology: Topology, read: ReadOptions,
                   mode: Callable[[ViewCore], Mode]) -> None:
        """Set up the view over ``plans`` for ``topology``, iterating in ``mode``."""
        self._topology = topology
        self._owned = topology.owned(spec.num_splits)
        self._rank, self._world_size = topology.rank, topology.world_size
        # The commit that made the pinned version, read once: every plan's identity holds it.
        self._table, self._commit = table, table_commit(table)
        self._plans = plans
        self._options: ReferenceOptions = read.reference
        columns = check_columns(table, read.columns)
        rows = read.read_batch_size if read.transform is None else \
            read.transform.read_rows(read.read_batch_size)
        kind = choose_reader(read.reader)
        self._gauge = Gauge()
        self._reads = Reads(table, columns, read.transform, kind,
                            read_sizing(table, columns, rows, read.read_bytes,
                                        read.prefetch_bytes, reader=kind),
                            read.prefetch_batches, read.reference.transform_parallelism,
                            read.ray_remote_args, self._gauge)
        self._meter = Meter(ViewStats(), topology.rank)
        # Set by plain DataLoader workers (shared memory, so the trainer sees it).
        self._untracked = torch.zeros(1, dtype=torch.int8).share_memory_()
        self._lease: weakref.ref[Iterator[Any]] | None = None  # the one active iterator
        self._mode = mode(self)
        self._set_plan(spec)

    def __getstate__(self) -> dict[str, Any]:
        self._plan_ahead()
        state = dict(self.__dict__)
        state["_lease"] = None  # iterators stay in their process
        return state

    # ----------------------------------------------------------------------- the plan
    def _set_plan(self, spec: PlanSpec) -> None:
        self._install_plan(spec, self._plans.part(spec, self._owned))

    def _install_plan(self, spec: PlanSpec, plan: SplitPlan) -> None:
        """Switch to ``plan`` from its start; any running iterator becomes stale."""
        self._plan, self._identity = plan, plan.identity(self._commit)
        self._spec = spec
        self._planned_ahead = False
        zeros = [0] * spec.num_splits
        self._new_cursor(zeros, zeros, batches=0, origin=True)
        self._mode.reset()

    def _new_cursor(self, samples: list[int], positions: list[int], *, batches: int,
                    origin: bool) -> None:
        """Start from this progress; ``origin``: it is exact for every split. Any running
        iterator becomes stale."""
        generation = self._cursor.generation if hasattr(self, "_cursor") else 0
        worker, _ = current_worker(self._options.worker_info_override, warn=False)
        self._cursor: Cursor = Cursor(worker_share(self._owned, worker), list(samples),
                              list(positions), self._plan.split_len, batches=batches,
                              generation=generation + 1,
                              origin=(list(samples), list(positions)) if origin else None)
        self._lease = None
        self._untracked[0] = 0

    @numpy_scalars_accepted
    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch``'s plan from its start (no-op if already on it)."""
        check_epoch_seed(self._spec.shuffle_seed, epoch)
        if epoch == self._spec.epoch:
            return
        left = self._mode.remaining
        if left and self._cursor.consumed + sum(self._cursor.samples):
            logger.warning("leaving epoch %d with %d samples of rank %d unread",
                           self._spec.epoch, left, self._rank)
        spec = self._spec.for_epoch(epoch)
        part = self._plans.part(spec, self._owned)  # may fail: nothing has changed yet
        self._plans.set_epoch(epoch)
        self._install_plan(spec, part)

    def sample_positions(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``(split, position)`` of the next samples ``start .. stop-1`` (for logging/tests)."""
        remaining = self._cursor.stream().advanced(self._cursor.consumed)
        splits, positions = remaining.slice(start, stop)
        return list(zip(splits.tolist(), positions.tolist()))

    # ----------------------------------------------------------------------- iterators
    def reserve(self, iterator: Iterator[Any]) -> None:
        """Make ``iterator`` (not started yet) the view's one live iterator now, refusing
        if another one is live (a loader's iterator reserves when it is created)."""
        lease = weakref.ref(iterator)
        self._refuse_concurrent(lease)
        self._lease = lease

    def _refuse_concurrent(self, lease: weakref.ref[Iterator[Any]] | None) -> None:
        active = self._lease() if self._lease is not None else None
        if active is not None and getattr(active, "gi_frame", None) is not None and (
                lease is None or active is not lease()):
            raise RuntimeError(CONCURRENT)

    def _claim(self, lease: weakref.ref[Iterator[Any]] | None) -> WorkerInfo | None:
        """Make ``lease`` the view's iterator, of a fresh generation; the DataLoader worker
        this process is (None outside one)."""
        worker, real = current_worker(self._options.worker_info_override)
        if real and lease is not None:  # a plain DataLoader worker: the trainer cannot know
            self._untracked[0] = 1
        self._cursor.generation += 1
        self._lease = lease
        return worker

    def _check_generation(self, generation: int) -> None:
        """Raise unless the iterator of ``generation`` may deliver: not superseded here, and
        its plan not replaced by the coordinator."""
        if generation != self._cursor.generation:
            raise RuntimeError(
                "this iterator was superseded by load_state_dict() or set_epoch(); create "
                "a new iterator to continue"
            )
        self._plans.check_current()
        self._plan_ahead()

    def _plan_ahead(self) -> None:
        """Start building the next epoch's plan, once per plan: at the first handover of
        its batches, so that the first batch's reads have the cores to themselves, or when
        the view is sent to DataLoader workers (which never plan ahead themselves)."""
        if self._planned_ahead or get_worker_info() is not None:
            return
        self._planned_ahead = True
        self._plans.ahead(self._spec, self._owned)

    def _where(self) -> str:
        """Where the epoch stands, for the periodic progress log."""
        left, total = self._mode.remaining, len(self._mode)
        done = total - left
        rate = self._meter.stats.rows_per_s
        eta = f", ETA {left / rate:.0f}s" if rate > 0 else ""
        return (f"epoch {self._spec.epoch} {progress_bar(done, total)} {done}/{total} "
                f"samples ({100.0 * done / max(total, 1):.1f}%{eta})")

    # ----------------------------------------------------------------------- handover
    # Progress changes go where a batch is handed over: applied at once, or, while
    # ``holding`` is open (a device feed pulling batches ahead of the consumer), collected
    # for the feed to apply when it hands that batch over. The collector belongs to the
    # thread that pulls (the source makes its changes there): another iterator of this view,
    # pulling on another thread meanwhile, applies its own changes as before.
    def _on_handover(self, change: Callable[[], None]) -> None:
        held = _collectors().get(id(self))
        if held is None:
            change()
        else:
            held.append(change)

    @contextmanager
    def holding(self) -> Iterator[list[Callable[[], None]]]:
        """Collect the changes this thread makes while open, instead of applying them."""
        collectors = _collectors()
        held: list[Callable[[], None]] = []
        outer = collectors.get(id(self))
        collectors[id(self)] = held
        try:
            yield held
        finally:
            if outer is None:
                del collectors[id(self)]
            else:
                collectors[id(self)] = outer

    @property
    def device_stats(self) -> FeedStats:
        """Batches this view handed over on a device (or pinned), how many of them the
        consumer waited for on their copy, and how many on their read (``FeedStats``)."""
        if self._device_stats is None:
            self._device_stats = FeedStats()
        return self._device_stats

    # ----------------------------------------------------------------------- properties
    @property
    def packed(self) -> bool:
        """Whether this view yields packed token blocks (``pack_sequences``)."""
        return self._mode.packed

    @property
    def epoch(self) -> int:
        """The epoch whose plan this view reads."""
        return self._spec.epoch

    @property
    def num_splits(self) -> int:
        return self._spec.num_splits

    @property
    def shuffle_seed(self) -> int:
        """The resolved shuffle seed (``shuffle_seed=None`` picks one at construction)."""
        return self._spec.shuffle_seed

    # lancedb.streaming's private names for the two, which its users read (migrating.md).
    _num_splits = num_splits
    _shuffle_seed = shuffle_seed

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

    # ------------------------------------------- lancedb.streaming's observability counters
    # Read from the consumer's own exact counters (never from reader threads or workers).
    @property
    def stats(self) -> ViewStats:
        """Exact counters of what this view delivered (rows, bytes, waits, skips, rate)."""
        return self._meter.stats

    @property
    def bytes_loaded(self) -> int:
        """Arrow bytes read for the samples delivered so far (before any transform)."""
        return self._meter.stats.bytes

    @property
    def fetch_time(self) -> float:
        """Seconds spent reading the delivered samples, summed over read threads/tasks."""
        return self._meter.stats.fetch_s

    @property
    def transform_time(self) -> float:
        """Seconds spent in the transform (or converting Arrow rows) for the same."""
        return self._meter.stats.transform_s

    @property
    def rows_skipped(self) -> int:
        """Samples left out because their transform failed, over all iterations."""
        return self._meter.stats.rows_skipped

    @property
    def consumed_rows(self) -> int:
        """Samples yielded by the current (or last) iterator (packed: the documents its
        yielded blocks took, as in the reference)."""
        return self._gauge.delivered

    @property
    def unscanned_rows(self) -> int:
        """Rows of the running iterator not yet handed to the reader (0 when idle)."""
        g = self._gauge
        return g.total - g.requested if g.active else 0

    @property
    def raw_queue_depth(self) -> int:
        """Rows handed to the reader whose data has not reached the consumer (0 when idle)."""
        g = self._gauge
        return g.requested - g.received if g.active else 0

    @property
    def prefetch_queue_depth(self) -> int:
        """Rows that reached the consumer and are ready to be handed out (0 when idle)."""
        g = self._gauge
        return g.received - g.taken if g.active else 0


_thread = threading.local()


def _collectors() -> dict[int, list[Callable[[], None]]]:
    """This thread's open ``holding`` collectors, by view."""
    if not hasattr(_thread, "collectors"):
        _thread.collectors = {}
    return _thread.collectors  # type: ignore[no-any-return]
