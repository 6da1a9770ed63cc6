"""How a view turns its stream into delivered samples: readers, counters, the transform
policy applied where samples are consumed, and the survivor order when failed rows drop.

A mixin of ``StreamingDataset`` (it uses the view's plan, cursor, meter and gauge); the
order and the bookkeeping themselves live in pure modules (``order``, ``survivors``,
``cursor``).
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from torch.utils.data import get_worker_info

from ..read.batching import Batch, assemble, collate, requests_for, selected_batches
from ..read.documents import DocumentReads
from ..read.items import as_items
from ..read.local import LocalReader
from ..read.ray_data import RayDataReader
from ..read.requests import NO_COST, ChunkRequest, ChunkResult, ReadCost, ReadSizing
from ..read.transform import Failed, Skipped
from ..stream.order import RankStream
from ..stream.survivors import Interleaver
from .compat import current_worker, worker_share
from .iteration import CONCURRENT, Commits, Lease, Survivor, every_row, timed
from .readers import make_reader
from .stats import progress_bar

if TYPE_CHECKING:
    from ..plan.splits import PlanSpec, SplitPlan
    from ..plan.table import TableRef
    from ..read.transform import TransformPolicy
    from ..stream.cursor import Cursor
    from .compat import ReferenceOptions, WorkerInfo
    from .stats import Gauge, Meter

logger = logging.getLogger("lance_ray.view.dataset")
T = TypeVar("T")
class Pass:
    """One iteration over a view, from its start to its end: the stream it reads and the
    operations that read, count and commit it. ``StreamingDataset``'s own iterators and
    ``StreamingDataLoader`` (its workers read, its trainer process delivers) both go
    through it; a pass superseded by ``load_state_dict()``/``set_epoch()`` refuses to
    deliver."""

    def __init__(self, view: Reading, stream: RankStream, generation: int):
        self.view, self.stream, self.generation = view, stream, generation

    @property
    def first_read_rows(self) -> int:
        """Rows of the view's first read: the smallest unit worth a message of its own."""
        return self.view._sizing.first_rows

    @property
    def transforms(self) -> bool:
        return self.view._transform is not None

    @property
    def drops_rows(self) -> bool:
        """Whether failed rows drop out of their splits (survivors are known only after
        the transform, so every row is read and the survivor order is made here)."""
        return self.view._drops

    def read_batches(self, batch_size: int, *, worker: int = 0, num_workers: int = 1,
                     as_tensors: bool = False) -> Iterator[Batch]:
        """Batches ``worker, worker + num_workers, ...`` of the stream, read and assembled."""
        return self.view._read_batches(self.stream, batch_size, worker=worker,
                                       num_workers=num_workers, as_tensors=as_tensors)

    def read_rows(self, worker: int = 0, num_workers: int = 1) -> Iterator[ChunkResult]:
        """Reads ``worker, worker + num_workers, ...`` of every row not yet read, the
        transform policy not yet applied (what a pass that drops rows reads)."""
        return self.view._read_rows(every_row(self.stream), worker, num_workers)

    def survivors(self, chunks: Iterator[ChunkResult]) -> Iterator[Survivor]:
        """The samples that survive, in order, from :meth:`read_rows`' chunks."""
        return self.view._survivors(self.stream, chunks)

    def survivor_batches(self, survivors: Iterator[Survivor], batch_size: int,
                         collate_fn: Callable[[list[Any]], Any] | None
                         ) -> Iterator[tuple[Any, list[tuple[int, int]], ReadCost, float]]:
        return self.view._survivor_batches(survivors, batch_size, collate_fn)

    def read_ahead_everything(self) -> None:
        """Count the whole stream as requested (DataLoader workers hold the whole plan)."""
        self.view._gauge.requested = self.view._gauge.total

    def received(self, rows: int) -> None:
        """Count ``rows`` arriving in the consuming process."""
        self.view._gauge.received += rows

    def deliver(self, size: int, cost: ReadCost, skipped: int, wait_s: float, *,
                batches: int, survivors: list[tuple[int, int]] | None = None) -> None:
        """Commit ``size`` sample slots (or exactly the ``survivors``) as consumed, unless
        the pass was superseded, when the batch is handed over (``Commits``)."""
        self.view._on_handover(partial(self._deliver, size, cost, skipped, wait_s, batches,
                                       survivors))

    def _deliver(self, size: int, cost: ReadCost, skipped: int, wait_s: float,
                 batches: int, survivors: list[tuple[int, int]] | None) -> None:
        self.view._check_generation(self.generation)
        self.view._delivered(size, cost, skipped, wait_s, batches=batches,
                             survivors=survivors)

    def finished(self) -> None:
        """The pass read its stream to the end: the next iteration starts the next epoch
        (once the last batch is handed over)."""
        self.view._on_handover(self._finished)

    def _finished(self) -> None:
        view = self.view
        view._cursor.ended = self.generation == view._cursor.generation

    def close(self) -> None:
        view = self.view
        if self.generation == view._cursor.generation:
            view._gauge.stop()


class Reading(Commits):
    """Reading and delivering, for :class:`~lance_ray.view.dataset.StreamingDataset`."""

    _options: ReferenceOptions
    _reader_kind: str
    _table: TableRef
    _columns: list[str] | None
    _transform: TransformPolicy | None
    _prefetch_batches: int
    _sizing: ReadSizing
    _ray_remote_args: dict[str, Any] | None
    _plan: SplitPlan
    _spec: PlanSpec
    _owned: list[int]
    _rank: int
    _cursor: Cursor
    _meter: Meter
    _gauge: Gauge
    _lease: weakref.ref[Iterator[Any]] | None
    _untracked: Any

    # Provided by StreamingDataset.
    @property
    def samples_remaining(self) -> int:
        raise NotImplementedError

    def _commit(self, samples: int, batches: int = 0) -> None:
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def _reader(self, in_worker: bool, as_tensors: bool,
                documents: DocumentReads | None = None) -> LocalReader | RayDataReader:
        info = get_worker_info()
        return make_reader("local" if in_worker else self._reader_kind, self._table,
                           self._columns, self._transform, as_tensors=as_tensors,
                           prefetch=self._prefetch_batches, sizing=self._sizing,
                           threads=self._options.transform_parallelism,
                           ray_remote_args=self._ray_remote_args, documents=documents,
                           processes=1 if info is None else info.num_workers)

    def _chunks(self, stream: RankStream, requests: Iterator[ChunkRequest],
                in_worker: bool, as_tensors: bool,
                documents: DocumentReads | None = None) -> Iterator[ChunkResult]:
        """The reads of ``requests``, counted by the consumer as they are asked for and
        come back."""
        gauge = self._gauge

        def asked() -> Iterator[ChunkRequest]:
            for request in requests:
                gauge.requested += len(request.row_ids)
                yield request

        for chunk in self._reader(in_worker, as_tensors, documents).iter_chunks(asked()):
            gauge.received += len(chunk)
            yield chunk

    def _resolved(self, stream: RankStream, chunk: ChunkResult
                  ) -> ChunkResult:
        """``chunk`` with the transform policy applied (here, in the consuming process)."""
        if self._transform is None or not isinstance(chunk.payload, list):
            return chunk

        def where(lo: int, hi: int) -> str:
            splits, positions = stream.slice(chunk.seq + lo, chunk.seq + hi)
            rows = list(zip(splits.tolist(), positions.tolist()))
            more = f" and {len(rows) - 4} more" if len(rows) > 4 else ""
            return (f"lance_ray: raised by the transform on (split, position) "
                    f"{rows[:4]}{more} of table version {self._table.version}")

        return ChunkResult(chunk.seq, self._transform.resolve(chunk.payload, where),
                           chunk.cost)

    def _read_batches(self, stream: RankStream, batch_size: int, *,
                      worker: int = 0, num_workers: int = 1, as_tensors: bool = False
                      ) -> Iterator[Batch]:
        """The batches of ``stream`` this process makes, read and assembled in order.

        ``as_tensors``: payloads are ``Columns`` (unless a transform makes items).
        """
        wanted = selected_batches(len(stream), batch_size, worker, num_workers)
        requests = requests_for(self._plan, stream, [(lo, hi) for _, lo, hi in wanted],
                                self._sizing)
        in_worker = get_worker_info() is not None or num_workers > 1
        chunks = self._chunks(stream, requests, in_worker, as_tensors)
        return assemble((self._resolved(stream, c) for c in chunks), wanted)

    def _read_rows(self, rows: RankStream, worker: int = 0, num_workers: int = 1, *,
                   documents: DocumentReads | None = None) -> Iterator[ChunkResult]:
        """Reads ``worker, worker + num_workers, ...`` of ``rows``, policy not yet applied;
        with ``documents``, arranged by split for packing (``read/documents``)."""
        requests = requests_for(self._plan, rows, [(0, len(rows))], self._sizing,
                                with_splits=documents is not None)
        mine = itertools.islice(requests, worker, None, num_workers)
        in_worker = get_worker_info() is not None or num_workers > 1
        return self._chunks(rows, mine, in_worker, as_tensors=False, documents=documents)

    def _survivors(self, stream: RankStream,
                   chunks: Iterator[ChunkResult]) -> Iterator[Survivor]:
        """The samples of ``stream`` when failed rows drop out of their splits, from the
        reads of ``every_row(stream)`` in order."""
        rows = every_row(stream)
        order = Interleaver(stream.splits, stream.samples, stream.positions, stream.split_len)
        for chunk in chunks:
            chunk = self._resolved(rows, chunk)
            splits, positions = rows.slice(chunk.seq, chunk.seq + len(chunk))
            before = order.dropped
            for split, position, item in zip(splits.tolist(), positions.tolist(),
                                             as_items(chunk.payload)):
                order.feed(split, position, item, isinstance(item, Failed))
            self._on_handover(partial(self._dropped, order.dropped - before))
            cost = chunk.cost
            for split, position, item in order.ready():
                yield split, position, item, cost
                cost = NO_COST
            if order.finished:
                return

    def _dropped(self, rows: int) -> None:
        """Count ``rows`` failed rows dropped from their splits."""
        self._gauge.taken += rows
        self._meter.record(0, NO_COST, rows, 0.0, batches=0, where=self._where)

    def _delivered(self, size: int, cost: ReadCost, skipped: int,
                   wait_s: float, *, batches: int,
                   survivors: list[tuple[int, int]] | None = None) -> None:
        """Commit ``size`` sample slots (or exactly the ``survivors``) as consumed."""
        if survivors is not None:
            self._cursor.take(survivors)
        self._commit(size if survivors is None else 0, batches=batches)
        self._gauge.taken += size
        self._gauge.delivered += size - skipped
        self._meter.record(size, cost, skipped, wait_s, batches=batches, where=self._where)

    def _where(self) -> str:
        left = self.samples_remaining
        done = len(self) - left
        rate = self._meter.stats.rows_per_s
        eta = f", ETA {left / rate:.0f}s" if rate > 0 else ""
        return (f"epoch {self._spec.epoch} {progress_bar(done, len(self))} {done}/{len(self)} "
                f"samples ({100.0 * done / max(len(self), 1):.1f}%{eta})")

    def _survivor_batches(self, survivors: Iterator[Survivor],
                          batch_size: int, collate_fn: Callable[[list[Any]], Any] | None
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

    def begin_pass(self, lease: weakref.ref[Iterator[Any]] | None = None) -> Pass:
        """Start iterator ``lease``: refuse a second live iterator, move to the next epoch
        if this view itself read this one to its end, then a fresh generation.

        Only the view's own reading moves it on: a state just loaded in which this rank's
        splits are complete (other ranks may still be reading the epoch) yields nothing.
        """
        self._refuse_concurrent(lease)
        c = self._cursor
        if c.ended or (self.samples_remaining == 0 and c.consumed > 0):
            logger.info("epoch %d is exhausted on rank %d; starting epoch %d",
                        self._spec.epoch, self._rank, self._spec.epoch + 1)
            self.set_epoch(self._spec.epoch + 1)
        elif self.samples_remaining == 0:
            logger.info("rank %d has no samples left in epoch %d; call set_epoch(%d) to "
                        "start the next one", self._rank, self._spec.epoch,
                        self._spec.epoch + 1)
        stream = self._cursor.rebase(worker_share(self._owned, self._claim(lease)))
        self._gauge.start(len(every_row(stream) if self._drops else stream))
        return Pass(self, stream, self._cursor.generation)

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
        if generation != self._cursor.generation:
            raise RuntimeError(
                "this iterator was superseded by load_state_dict() or set_epoch(); create "
                "a new iterator to continue"
            )

    @property
    def _drops(self) -> bool:
        return self._transform is not None and self._transform.drops_rows

    def _samples(self, lease: Lease) -> Iterator[Any]:
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
        group = self._sizing.first_rows
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

    def _batches(self, lease: Lease, batch_size: int,
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

    def sample_positions(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``(split, position)`` of the next samples ``start .. stop-1`` (for logging/tests)."""
        remaining = self._cursor.stream().advanced(self._cursor.consumed)
        splits, positions = remaining.slice(start, stop)
        return list(zip(splits.tolist(), positions.tolist()))
