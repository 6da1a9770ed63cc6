"""Row mode: how a view turns its stream into delivered samples, and its state.

:class:`RowMode` is the iteration object of a view that yields rows (samples): it reads
through the view's ``Reads``, applies the transform policy where samples are consumed, keeps
the survivor order when failed rows drop, commits to the view's cursor, and makes the
view's states. The order and the bookkeeping themselves live in pure modules (``order``,
``survivors``, ``cursor``).
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from ..read.batching import Batch, collate
from ..read.items import as_items
from ..read.requests import NO_COST, ChunkResult, ReadCost
from ..read.transform import Failed, Skipped
from ..state import format as st
from ..state.ledger import RankReport
from ..stream.order import RankStream
from ..stream.survivors import Interleaver
from .compat import worker_share
from .core import ViewCore
from .iteration import Lease, Survivor, every_row, timed

logger = logging.getLogger("lance_ray.view.dataset")


class Pass:
    """One iteration over a view, from its start to its end: the stream it reads and the
    operations that read, count and commit it. ``StreamingDataset``'s own iterators and
    ``StreamingDataLoader`` (its workers read, its trainer process delivers) both go
    through it; a pass superseded by ``load_state_dict()``/``set_epoch()`` refuses to
    deliver."""

    def __init__(self, mode: RowMode, stream: RankStream, generation: int):
        self.mode, self.stream, self.generation = mode, stream, generation

    @property
    def first_read_rows(self) -> int:
        """Rows of the view's first read: the smallest unit worth a message of its own."""
        return self.mode.view._reads.sizing.first_rows

    @property
    def transforms(self) -> bool:
        return self.mode.view._reads.transform is not None

    @property
    def drops_rows(self) -> bool:
        """Whether failed rows drop out of their splits (survivors are known only after
        the transform, so every row is read and the survivor order is made here)."""
        return self.mode.view._reads.drops

    def read_batches(self, batch_size: int, *, worker: int = 0, num_workers: int = 1,
                     as_tensors: bool = False) -> Iterator[Batch]:
        """Batches ``worker, worker + num_workers, ...`` of the stream, read and assembled."""
        view = self.mode.view
        return view._reads.read_batches(view._plan, self.stream, batch_size, worker=worker,
                                        num_workers=num_workers, as_tensors=as_tensors)

    def read_rows(self, worker: int = 0, num_workers: int = 1) -> Iterator[ChunkResult]:
        """Reads ``worker, worker + num_workers, ...`` of every row not yet read, the
        transform policy not yet applied (what a pass that drops rows reads)."""
        view = self.mode.view
        return view._reads.read_rows(view._plan, every_row(self.stream), worker, num_workers)

    def survivors(self, chunks: Iterator[ChunkResult]) -> Iterator[Survivor]:
        """The samples that survive, in order, from :meth:`read_rows`' chunks."""
        return self.mode.survivors(self.stream, chunks)

    def survivor_batches(self, survivors: Iterator[Survivor], batch_size: int,
                         collate_fn: Callable[[list[Any]], Any] | None
                         ) -> Iterator[tuple[Any, list[tuple[int, int]], ReadCost, float]]:
        return survivor_batches(survivors, batch_size, collate_fn)

    def read_ahead_everything(self) -> None:
        """Count the whole stream as requested (DataLoader workers hold the whole plan)."""
        gauge = self.mode.view._gauge
        gauge.requested = gauge.total

    def received(self, rows: int) -> None:
        """Count ``rows`` arriving in the consuming process."""
        self.mode.view._gauge.received += rows

    def deliver(self, size: int, cost: ReadCost, skipped: int, wait_s: float, *,
                batches: int, survivors: list[tuple[int, int]] | None = None) -> None:
        """Commit ``size`` sample slots (or exactly the ``survivors``) as consumed, unless
        the pass was superseded, when the batch is handed over (``ViewCore.holding``)."""
        self.mode.view._on_handover(partial(self._deliver, size, cost, skipped, wait_s,
                                            batches, survivors))

    def _deliver(self, size: int, cost: ReadCost, skipped: int, wait_s: float,
                 batches: int, survivors: list[tuple[int, int]] | None) -> None:
        self.mode.view._check_generation(self.generation)
        self.mode.delivered(size, cost, skipped, wait_s, batches=batches,
                            survivors=survivors)

    def finished(self) -> None:
        """The pass read its stream to the end: the next iteration starts the next epoch
        (once the last batch is handed over)."""
        self.mode.view._on_handover(self._finished)

    def _finished(self) -> None:
        cursor = self.mode.view._cursor
        cursor.ended = self.generation == cursor.generation

    def close(self) -> None:
        view = self.mode.view
        if self.generation == view._cursor.generation:
            view._gauge.stop()


def survivor_batches(survivors: Iterator[Survivor], batch_size: int,
                     collate_fn: Callable[[list[Any]], Any] | None
                     ) -> Iterator[tuple[Any, list[tuple[int, int]], ReadCost, float]]:
    """Batches of ``batch_size`` surviving samples: (collated, their (split, position)
    pairs, cost, wait)."""
    from torch.utils.data import default_collate

    waited = timed(survivors)
    while True:
        items, taken, cost, wait = [], [], NO_COST, 0.0
        for (split, position, item, c), w in itertools.islice(waited, batch_size):
            items.append(item)
            taken.append((split, position))
            cost, wait = cost + c, wait + w
        if not items:
            return
        yield (collate_fn or default_collate)(items), taken, cost, wait


class RowMode:
    """Row mode, the iteration object of a view that yields samples: its progress is the
    view's cursor (samples and positions of every split)."""

    packed = False

    def __init__(self, view: ViewCore):
        self.view = view

    def reset(self) -> None:
        """Nothing to reset: installing the plan gave the view a fresh cursor."""

    def __len__(self) -> int:
        return len(self.view._owned) * self.view._plan.split_len

    @property
    def remaining(self) -> int:
        cursor = self.view._cursor
        return len(cursor.stream()) - cursor.consumed

    @property
    def rolls_over(self) -> bool:
        c = self.view._cursor
        return c.ended or (self.remaining == 0 and c.consumed > 0)

    # ----------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The view's row-mode state (``StreamingDataset.state_dict`` says what it holds)."""
        view = self.view
        c, ws = view._cursor, view._world_size
        if ws == 1 and len(c.splits) == view.num_splits:
            return st.make_state(view._identity, *c.progress(), world_size=1, rank=None,
                                 global_step=c.batches)
        derived = None if view._reads.drops else c.lockstep_progress(view.num_splits)
        if derived is not None:
            # No rank: every rank of a lockstep run writes this same state (one file
            # resumes any topology, as in the reference).
            return st.make_state(view._identity, *derived, world_size=ws, rank=None,
                                 global_step=c.batches, lockstep=True)
        if len(c.splits) != len(view._owned):
            raise RuntimeError(
                "this view reads one DataLoader worker's share of its rank's splits "
                "(worker_info_override) and its progress does not determine the other "
                "workers'; checkpoint through StreamingDataLoader instead"
            )
        return st.make_state(view._identity, *c.progress(), world_size=ws,
                             rank=None if ws == 1 else view._rank, global_step=c.batches)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        view = self.view
        progress = st.parse_state(state, view._plan.split_len)
        st.check_compatible(state, view._identity)
        st.check_loadable_on(progress, view._topology)
        view._new_cursor(list(progress.samples), list(progress.positions),
                         batches=progress.global_step or 0,
                         origin=progress.exact_everywhere)

    def _commit(self, samples: int, batches: int = 0) -> None:
        view = self.view
        view._cursor.commit(samples, batches)
        if batches and view._plans.wants_reports:  # keep the commit O(1) without a coordinator
            done = view._cursor.stream().advanced(view._cursor.consumed)
            report = RankReport(view._rank, view._world_size, view._spec.epoch,
                                view._cursor.batches, done.samples, done.positions)
            view._plans.report(report, final=not len(done))

    def delivered(self, size: int, cost: ReadCost, skipped: int,
                  wait_s: float, *, batches: int,
                  survivors: list[tuple[int, int]] | None = None) -> None:
        """Commit ``size`` sample slots (or exactly the ``survivors``) as consumed."""
        view = self.view
        if survivors is not None:
            view._cursor.take(survivors)
        self._commit(size if survivors is None else 0, batches=batches)
        view._gauge.taken += size
        view._gauge.delivered += size - skipped
        view._meter.record(size, cost, skipped, wait_s, batches=batches, where=view._where)

    # ----------------------------------------------------------------------- reading
    def begin_pass(self, lease: weakref.ref[Iterator[Any]] | None = None) -> Pass:
        """Start iterator ``lease``: refuse a second live iterator, move to the next epoch
        if this view itself read this one to its end, then a fresh generation.

        Only the view's own reading moves it on: a state just loaded in which this rank's
        splits are complete (other ranks may still be reading the epoch) yields nothing.
        """
        view = self.view
        view._refuse_concurrent(lease)
        if self.rolls_over:
            logger.info("epoch %d is exhausted on rank %d; starting epoch %d",
                        view._spec.epoch, view._rank, view._spec.epoch + 1)
            view.set_epoch(view._spec.epoch + 1)
        elif self.remaining == 0:
            logger.info("rank %d has no samples left in epoch %d; call set_epoch(%d) to "
                        "start the next one", view._rank, view._spec.epoch,
                        view._spec.epoch + 1)
        stream = view._cursor.rebase(worker_share(view._owned, view._claim(lease)))
        view._gauge.start(len(every_row(stream) if view._reads.drops else stream))
        return Pass(self, stream, view._cursor.generation)

    def survivors(self, stream: RankStream,
                  chunks: Iterator[ChunkResult]) -> Iterator[Survivor]:
        """The samples of ``stream`` when failed rows drop out of their splits, from the
        reads of ``every_row(stream)`` in order."""
        rows = every_row(stream)
        order = Interleaver(stream.splits, stream.samples, stream.positions, stream.split_len)
        for chunk in chunks:
            chunk = self.view._reads.resolved(rows, chunk)
            splits, positions = rows.slice(chunk.seq, chunk.seq + len(chunk))
            before = order.dropped
            for split, position, item in zip(splits.tolist(), positions.tolist(),
                                             as_items(chunk.payload)):
                order.feed(split, position, item, isinstance(item, Failed))
            self.view._on_handover(partial(self._dropped, order.dropped - before))
            cost = chunk.cost
            for split, position, item in order.ready():
                yield split, position, item, cost
                cost = NO_COST
            if order.finished:
                return

    def _dropped(self, rows: int) -> None:
        """Count ``rows`` failed rows dropped from their splits."""
        view = self.view
        view._gauge.taken += rows
        view._meter.record(0, NO_COST, rows, 0.0, batches=0, where=view._where)

    def items(self, lease: Lease) -> Iterator[Any]:
        p = self.begin_pass(lease[0])
        try:
            if p.drops_rows:
                for split, position, item, cost in p.survivors(p.read_rows()):
                    p.deliver(1, cost, 0, 0.0, batches=0, survivors=[(split, position)])
                    yield item
            else:
                yield from self._sample_rows(p)
            p.finished()
        finally:
            p.close()

    def _sample_rows(self, p: Pass) -> Iterator[Any]:
        # Batches the size of the first read: cut from the growing reads, rarely re-joined.
        group = p.first_read_rows
        for batch, wait_s in timed(p.read_batches(group)):
            cost = batch.cost
            if isinstance(batch.payload, list):
                rows = batch.payload
            else:  # columns to items here, on the consumer's thread: book it as such
                started = time.perf_counter()
                rows = as_items(batch.payload)
                cost = cost + ReadCost(0, 0.0, time.perf_counter() - started)
            for i, row in enumerate(rows):
                skipped = isinstance(row, Skipped)
                # The chunk's cost and wait are booked with its first row.
                p.deliver(1, NO_COST if i else cost, int(skipped), 0.0 if i else wait_s,
                          batches=0)
                if not skipped:
                    yield row

    def batches(self, lease: Lease, batch_size: int,
                collate_fn: Callable[[list[Any]], Any] | None) -> Iterator[Any]:
        p = self.begin_pass(lease[0])
        try:
            if p.drops_rows:
                survivors = p.survivors(p.read_rows())
                for out, taken, cost, wait_s in p.survivor_batches(survivors, batch_size,
                                                                   collate_fn):
                    p.deliver(len(taken), cost, 0, wait_s, batches=1, survivors=taken)
                    yield out
            else:
                batches = p.read_batches(batch_size, as_tensors=collate_fn is None)
                for batch, wait_s in timed(batches):
                    out, skipped = collate(batch.payload, collate_fn)
                    p.deliver(batch.size, batch.cost, skipped, wait_s, batches=1)
                    yield out
            p.finished()
        finally:
            p.close()
