"""``StreamingDataLoader``: a DataLoader whose checkpoints count only consumed batches."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from functools import partial
from typing import Any, NamedTuple, cast

from torch._utils import ExceptionWrapper
from torch.utils.data import IterableDataset, get_worker_info

from ..checks import numpy_scalars_accepted, positive_int
from ..read.batching import collate
from ..read.documents import DocumentReads
from ..read.requests import NO_COST, ChunkResult, ReadCost
from ..read.transform import portable_items
from ..stream.order import RankStream
from .dataset import StreamingDataset
from .iteration import Lease, leased, timed
from .loader_args import EachSample, PinsItself, dataloader_arguments
from .packed import PackedMode
from .placement import loader_placement, placed
from .reading import Pass
from .workers import ForwardsToDataset, TravelsByValue, prepare_workers


class _Delivered(NamedTuple):
    number: int
    size: int
    data: Any
    skipped: int
    cost: ReadCost


class _CollateFailed(NamedTuple):
    """Batch ``number``'s ``collate_fn`` raised in a worker: the trainer raises ``error`` when
    the batch is due, after every batch before it (as without workers)."""

    number: int
    size: int
    error: Any  # has reraise(): torch's ExceptionWrapper (a worker's traceback) or _Raise


class _Raise:
    """A ``collate_fn`` error in the trainer's own process (no workers): raised as it was,
    as ``iter_batches`` and torch's loader raise it there."""

    def __init__(self, error: BaseException):
        self.error = error

    def reraise(self) -> None:
        raise self.error


def _identity(x: Any) -> Any:
    return x


class _BatchSource(ForwardsToDataset, TravelsByValue, IterableDataset):
    """What each DataLoader worker iterates: its share of the rank's batches, collated.

    Batches travel in groups of ``group`` consecutive batches (one message each: torch's
    worker-to-trainer transfer has a fixed cost per tensor, so small batches sent one by one
    would cap a loader's rows/s). Worker ``w`` of ``k`` makes
    groups ``w, w+k, ...`` of the one rank sequence; torch's in-order loader returns them
    round-robin, i.e. in sequence order, so the batches (and every global step) are the
    same for any ``num_workers``.
    """

    def __init__(self, batch_size: int, collate_fn: Callable[[list[Any]], Any] | None):
        super().__init__()
        self.batch_size, self.collate_fn = batch_size, collate_fn
        self.pass_: Pass | None = None
        self.group = 1
        # A packed pass: the view's mode, the rows it reads and how their documents are
        # arranged.
        self.packed: tuple[PackedMode, RankStream, DocumentReads] | None = None

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.packed is not None:
            # Workers read and arrange documents (what does not depend on order); the trainer
            # packs them in order, so the blocks are those of num_workers=0.
            mode, rows, documents = self.packed
            yield from mode.read_share(rows, worker, workers, documents)
            return
        p = self.pass_
        assert p is not None, "StreamingDataLoader starts its source before iterating"
        if p.drops_rows:
            # Which rows survive is known only after their transform: workers read every
            # k-th read and the trainer interleaves the survivors (and runs the policy).
            for chunk in p.read_rows(worker, workers):
                if info is not None and isinstance(chunk.payload, list):  # crosses processes
                    chunk.payload = portable_items(chunk.payload)
                yield chunk
            return
        size = self.batch_size
        for group in p.read_batches(size * self.group, worker=worker, num_workers=workers,
                                    as_tensors=self.collate_fn is None):
            first = group.index * self.group
            made: list[_Delivered | _CollateFailed] = []
            for j, lo in enumerate(range(0, group.size, size)):
                try:
                    data, skipped = collate(group.payload[lo : lo + size], self.collate_fn)
                except Exception as e:
                    # The group's earlier batches still arrive, then the error, where it is
                    # raised without workers: the batches trained do not depend on workers.
                    error = _Raise(e) if info is None else ExceptionWrapper(
                        where=f"in DataLoader worker {worker}, collating batch {first + j}")
                    made.append(_CollateFailed(first + j, 0, error))
                    yield made
                    return
                made.append(_Delivered(first + j, min(size, group.size - lo), data, skipped,
                                       NO_COST if j else group.cost))
            yield made



def stop_workers(inner: Iterator[Any]) -> None:
    """Stop the workers of a DataLoader iterator now (not when it is collected)."""
    shutdown = getattr(inner, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


class _InOrder:
    """The workers' reads of a packed pass, checked to arrive in stream order and counted
    (``received``); ``close()`` stops the workers, even when no read was ever asked for."""

    def __init__(self, inner: Iterator[ChunkResult], received: Callable[[int], None]):
        self.inner, self.received, self.expected = inner, received, 0

    def __iter__(self) -> _InOrder:
        return self

    def __next__(self) -> ChunkResult:
        chunk = next(self.inner)
        if chunk.seq != self.expected:
            raise RuntimeError(f"a read of rows {chunk.seq}.. arrived where rows "
                               f"{self.expected}.. were due; refusing to pack out of order")
        self.expected += len(chunk)
        self.received(len(chunk))
        return chunk

    def close(self) -> None:
        stop_workers(self.inner)


class _LoaderIterator:
    """What ``iter(StreamingDataLoader)`` returns. ``close()`` (or torch's name for it,
    ``_shutdown_workers()``) stops its workers and gives up the dataset's lease at once;
    so does exhausting it, and so does dropping it (when it is collected)."""

    def __init__(self, run: Generator[Any, None, None]):
        self._run = run

    def __iter__(self) -> _LoaderIterator:
        return self

    def __next__(self) -> Any:
        return next(self._run)

    def close(self) -> None:
        self._run.close()

    _shutdown_workers = close


class StreamingDataLoader(PinsItself):
    """A ``DataLoader`` over a :class:`StreamingDataset` with exact, consumer-committed state.

    Progress is committed in this (the trainer's) process when a batch is returned by
    ``next()``, never when a worker prefetches it, so ``dataset.state_dict()`` (or this
    loader's ``state_dict()``) is exact after every batch, with any ``num_workers``. Unless
    you pass ``multiprocessing_context``, workers start from a fork server (Lance is not
    fork-safe); each opens the table itself.

    Without a transform and without ``collate_fn`` a batch is ``{column: tensor}`` built
    from Arrow, as ``StreamingDataset.iter_batches`` gives it (fixed-size list columns
    become 2-D tensors, list and binary columns ``{"values", "offsets", "valid"}``);
    otherwise ``collate_fn`` (default torch's ``default_collate``) collates the batch's
    items, in the worker. A packed dataset (``pack_sequences``) gives the batches of its
    ``iter_batches``: workers read and arrange its documents, this process packs them.
    ``pin_memory=True`` (torch's meaning; ``pin_memory_device``, deprecated by torch, is
    ignored with its warning) returns the tensors in pinned host memory, pinned a few
    batches ahead on threads; without CUDA it warns as torch does and returns them
    unpinned. ``batch_size=None`` is torch's unbatched mode: each sample through
    ``collate_fn`` (default ``default_convert``). Arguments may be given in ``DataLoader``'s
    positional order.
    """

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any) -> Any:
        if getattr(dataset, "is_mixture", False):  # a MixtureDataset: its own loader
            from .mix_loader import MixtureDataLoader

            return MixtureDataLoader(dataset, *args, **kwargs)
        return super().__new__(cls)

    @numpy_scalars_accepted
    @dataloader_arguments
    def __init__(self, dataset: StreamingDataset, batch_size: int | None = 1, *,
                 num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None, drop_last: bool = False,
                 persistent_workers: bool = False, pin_memory: Any = False,
                 pin_memory_device: Any = "", **kwargs: Any) -> None:
        if not isinstance(dataset, StreamingDataset):
            kind = type(dataset)
            raise TypeError(
                f"StreamingDataLoader requires a lance_ray.StreamingDataset, got "
                f"{kind.__module__}.{kind.__qualname__}: build the dataset with "
                "lance_ray.StreamingDataset(...) (it takes the same arguments)")
        if type(dataset).__iter__ is not StreamingDataset.__iter__:
            raise TypeError(
                f"StreamingDataLoader cannot load {type(dataset).__name__}: datasets it loads "
                "must not override __iter__, which the loader never calls (it reads the "
                "dataset's batches itself), so the override would be silently ignored. "
                "Iterate the subclass with a plain loop, or move its logic into a transform"
            )
        requested = batch_size
        if batch_size is None:  # torch's unbatched mode
            batch_size, collate_fn = 1, EachSample(collate_fn)
        positive_int("batch_size", batch_size)
        if drop_last:
            raise ValueError(
                "drop_last=True is not supported: dropped samples could not be accounted for "
                "in the checkpoint. Choose batch_size so that the rank's epoch divides evenly"
            )
        if persistent_workers:
            raise ValueError(
                "persistent_workers=True is not supported: each iteration must start its "
                "workers from the committed state"
            )
        for banned in ("sampler", "batch_sampler", "shuffle"):
            if kwargs.get(banned):
                raise ValueError(f"{banned} is not supported: the split plan decides the order")
        if kwargs.get("in_order") is False:
            raise ValueError("in_order=False is not supported: batches must arrive in order")
        # Pinned here, from torch's caching host allocator, by the same feed as
        # iter_batches(device=); torch's own pinning is left off.
        self._placement = loader_placement(pin_memory, pin_memory_device)
        self._source = _BatchSource(batch_size, collate_fn)
        self._source.forward_to(dataset)
        if num_workers > 0:
            prepare_workers(kwargs)
        self._streaming_dataset = dataset
        self._batch_size_samples = batch_size
        super().__init__(self._source, batch_size=None, num_workers=num_workers,
                         collate_fn=_identity, **kwargs)
        # What the user asked for, as torch's loader reports it (torch itself reads it only
        # in __len__, which this class answers; its batching is off: batches come whole).
        self.__dict__["batch_size"] = requested
        self._report_pinning(pin_memory, pin_memory_device)


    @property
    def streaming_dataset(self) -> StreamingDataset:
        return self._streaming_dataset

    def __iter__(self) -> _LoaderIterator:  # type: ignore[override]
        """A new iterator, holding the dataset's one-iterator lease from now on: refused
        (``RuntimeError``, "concurrent iteration") while another iterator of the dataset,
        or of any loader over it, is live, i.e. not yet exhausted, closed or collected."""
        view = self._streaming_dataset
        run = cast("Generator[Any, None, None]", leased(  # a generator, placed or not
            lambda lease: placed(lambda: self._run(lease), self._placement, view)))
        view.reserve(run)
        return _LoaderIterator(run)

    def _run(self, lease: Lease) -> Iterator[Any]:
        mode = self._streaming_dataset.mode
        if isinstance(mode, PackedMode):  # blocks are packed here, from the workers' reads
            reads = partial(self._worker_reads, mode) if self.num_workers else None
            yield from mode.batches(lease, self._batch_size_samples, self._source.collate_fn,
                                    reads)
            return
        p = mode.begin_pass(lease[0])
        self._source.pass_ = p  # pickled into the workers started below
        # Groups only pay off across processes; in-process they would delay the first batch.
        # A transform's batches cost far more than their message: one per group keeps the
        # workers' shares even to the epoch's end.
        self._source.group = max(1, p.first_read_rows // self._batch_size_samples
                                 ) if self.num_workers and not p.transforms else 1
        p.read_ahead_everything()
        inner = None
        try:
            inner = super().__iter__()  # may refuse its arguments: the pass still closes
            if p.drops_rows:
                yield from self._survivors(p, inner)
            else:
                yield from self._committed(p, inner)
            p.finished()
        finally:
            if inner is not None:
                stop_workers(inner)
            p.close()

    def _worker_reads(self, mode: PackedMode, rows: RankStream,
                      documents: DocumentReads) -> _InOrder:
        """A packed pass's reads of ``rows``, made by the workers (worker ``w`` of ``k`` reads
        ``w, w + k, ...``; torch's in-order loader returns them round-robin, in order)."""
        self._source.packed = (mode, rows, documents)  # pickled into the workers
        try:
            inner = super().__iter__()  # the workers start here, on the consumer's thread
        finally:
            self._source.packed = None
        return _InOrder(inner, mode.received)

    def _survivors(self, p: Pass, inner: Iterator[ChunkResult]) -> Iterator[Any]:
        def received() -> Iterator[ChunkResult]:
            for chunk in inner:
                p.received(len(chunk))
                yield chunk

        for out, taken, cost, wait_s in p.survivor_batches(
                p.survivors(received()), self._batch_size_samples, self._source.collate_fn):
            p.deliver(len(taken), cost, 0, wait_s, batches=1, survivors=taken)
            yield out

    def _committed(self, p: Pass, inner: Iterator[list[_Delivered | _CollateFailed]]
                   ) -> Iterator[Any]:
        expected = 0
        for group, wait_s in timed(inner):
            p.received(sum(d.size for d in group))
            for delivered in group:
                if delivered.number != expected:
                    raise RuntimeError(
                        f"batch {delivered.number} arrived where batch {expected} was "
                        "due; refusing to commit out-of-order progress"
                    )
                if isinstance(delivered, _CollateFailed):
                    delivered.error.reraise()
                    return
                p.deliver(delivered.size, delivered.cost, delivered.skipped, wait_s, batches=1)
                wait_s = 0.0  # the group's wait is booked with its first batch
                expected += 1
                yield delivered.data

    def __len__(self) -> int:
        """Batches the next iteration yields: the rest of the epoch, or the whole next
        epoch once this view read the current one to its end (iterating then starts it)."""
        ds = self._streaming_dataset
        n = len(ds) if ds.mode.rolls_over else ds.samples_remaining
        return -(-n // self._batch_size_samples)

    def state_dict(self) -> dict[str, Any]:
        """The dataset's committed state (what ``dataset.state_dict()`` returns)."""
        return self._streaming_dataset.state_dict()

    @numpy_scalars_accepted
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state`` into the dataset; the next iteration resumes from it."""
        self._streaming_dataset.load_state_dict(state)

