"""``StreamingDataLoader`` over a ``MixtureDataset``: DataLoader workers read and collate the
mixture's batches, the trainer's process commits each when ``next()`` returns it.

The trainer plans the iteration's batches (:func:`~lance_ray.view.mix_batches.plan_batches`:
per batch, which samples of which source pass); worker ``w`` of ``k`` reads batches ``w,
w+k, ...`` of that plan (each source's ranges of its rank stream, in order), and torch's
in-order loader hands them back round-robin, so the batches are those of ``num_workers=0``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from torch.utils.data import IterableDataset, get_worker_info

from ..checks import positive_int
from ..plan.splits import SplitPlan
from ..read.batching import Batch, assemble, requests_for
from ..read.requests import NO_COST, ReadCost
from ..stream.order import RankStream, stream_for
from .iteration import Lease, leased, timed
from .loader_args import PinsItself, dataloader_arguments
from .mix_batches import MixBatch, mixed_batch
from .placement import loader_placement, placed_in_turn
from .workers import ForwardsToDataset, TravelsByValue, prepare_workers

if TYPE_CHECKING:
    from .dataset import StreamingDataset
    from .mixture import MixtureDataset


class _Made(NamedTuple):
    number: int
    data: Any
    cost: ReadCost


class _Arrival(NamedTuple):
    """A batch a worker made, in order, checked current: what to commit for it."""

    batch: MixBatch
    data: Any
    cost: ReadCost
    wait_s: float
    generation: int


# Documents per worker batch of a packed mixture (the trainer packs them; any size gives
# the same blocks).
PACKED_DOCUMENTS = 256


def _identity(x: Any) -> Any:
    return x


def read_ranges(view: StreamingDataset, plan: SplitPlan, stream: RankStream,
                ranges: list[tuple[int, int]], as_tensors: bool) -> Iterator[Batch]:
    """Samples ``lo .. hi-1`` of ``stream`` (over ``plan``, a pass of ``view``'s source) for
    each range, in order, read in this process."""
    wanted = [(j, lo, hi) for j, (lo, hi) in enumerate(ranges)]
    reads = view._reads
    requests = requests_for(plan, stream, ranges, reads.sizing)
    chunks = reads.chunks(stream, requests, True, as_tensors)
    return assemble((reads.resolved(stream, c) for c in chunks), wanted)


def later_passes(mix: MixtureDataset, plan: list[MixBatch]) -> dict[tuple[int, int], SplitPlan]:
    """The plan (its part for the rank's splits) of each source pass after the current one
    that ``plan``'s batches reach (under ``all_exhausted``), keyed by (source, pass)."""
    out: dict[tuple[int, int], SplitPlan] = {}
    views, first = mix.sources, mix.progress.passes
    for mb in plan:
        for i, segments in enumerate(mb.segments):
            for pass_no, _, _ in segments:
                if pass_no != first[i] and (i, pass_no) not in out:
                    view = views[i]
                    out[(i, pass_no)] = view._plans.part(view._spec.for_epoch(pass_no),
                                                         view._owned)
    return out


class _MixtureBatches(ForwardsToDataset, TravelsByValue, IterableDataset):
    """What each worker iterates: its share of the planned batches, read and collated."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None):
        super().__init__()
        self.collate_fn = collate_fn
        self.mixture: MixtureDataset | None = None
        self.plan: list[MixBatch] = []
        self.streams: list[RankStream] = []
        # The plans of the later source passes the batches reach: got once by the trainer
        # (an attached mixture's workers cannot ask its coordinators), for every worker.
        self.later: dict[tuple[int, int], SplitPlan] = {}

    def __iter__(self) -> Iterator[_Made]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mix = self.mixture
        assert mix is not None, "the loader sets its mixture before iterating"
        mine = self.plan[worker::workers]
        views, first = mix.sources, mix.progress.passes
        ranges: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for mb in mine:
            for i, segments in enumerate(mb.segments):
                for pass_no, lo, hi in segments:
                    ranges[(i, pass_no)].append((lo, hi))
        readers: dict[tuple[int, int], Iterator[Batch]] = {}
        as_tensors = self.collate_fn is None

        def reader(i: int, pass_no: int) -> Iterator[Batch]:
            if (i, pass_no) not in readers:
                view, plan, stream = views[i], views[i]._plan, self.streams[i]
                if pass_no != first[i]:  # a later pass of the source: its plan, from 0
                    # Only read it: installing it in the view would make the view's cursor
                    # take this worker for a plain DataLoader worker's split share.
                    plan = self.later[(i, pass_no)]
                    zeros = [0] * view.num_splits
                    stream = stream_for(view._owned, zeros, zeros, plan.split_len)
                readers[(i, pass_no)] = read_ranges(view, plan, stream, ranges[(i, pass_no)],
                                                    as_tensors)
            return readers[(i, pass_no)]

        for mb in mine:
            parts: list[list[Any]] = [[] for _ in mb.segments]
            cost = NO_COST
            for i, segments in enumerate(mb.segments):
                for pass_no, _, _ in segments:
                    batch = next(reader(i, pass_no))
                    parts[i].append(batch.payload)
                    cost = cost + batch.cost
            yield _Made(mb.index, mixed_batch(parts, mb.sources, self.collate_fn), cost)


class MixtureDataLoader(PinsItself):
    """What ``StreamingDataLoader(mixture, ...)`` makes: batches of ``mixture.iter_batches``
    (the same with any ``num_workers``), committed when ``next()`` returns them, so the
    mixture's ``state_dict()`` is exact after every batch. ``pin_memory`` as torch means it:
    each batch is pinned as it is handed over (a mixture commits its batches as it makes
    them, so it pins none ahead)."""

    @dataloader_arguments
    def __init__(self, dataset: MixtureDataset, batch_size: int = 1, *, num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None, drop_last: bool = False,
                 persistent_workers: bool = False, pin_memory: Any = False,
                 pin_memory_device: Any = "", **kwargs: Any) -> None:
        positive_int("batch_size", batch_size)
        if drop_last or persistent_workers:
            raise ValueError("drop_last=True and persistent_workers=True are not supported: "
                             "each iteration starts its workers from the committed state")
        for banned in ("sampler", "batch_sampler", "shuffle"):
            if kwargs.get(banned):
                raise ValueError(f"{banned} is not supported: the mixture decides the order")
        # A packed mixture's workers send its documents (item lists); this process packs.
        self._source = _MixtureBatches(list if dataset.packed else collate_fn)
        self._source.forward_to(dataset)
        if num_workers > 0:
            prepare_workers(kwargs)
        self._mixture = dataset
        self._batch_size_samples = batch_size
        super().__init__(self._source, batch_size=None, num_workers=num_workers,
                         collate_fn=_identity, **kwargs)
        self.__dict__["batch_size"] = batch_size  # as torch's loader reports it (see loader)
        self._placement = loader_placement(pin_memory, pin_memory_device)
        self._report_pinning(pin_memory, pin_memory_device)

    @property
    def streaming_dataset(self) -> MixtureDataset:
        return self._mixture

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = self._batches()
        return batches if self._placement is None else placed_in_turn(batches, self._placement)

    def _batches(self) -> Iterator[Any]:
        if self.num_workers == 0:
            return self._mixture.iter_batches(self._batch_size_samples,
                                              collate_fn=self._source.collate_fn)
        if self._mixture.packed:
            return leased(lambda lease: self._mixture.pack_blocks(self._documents(lease),
                                                                  self._batch_size_samples))
        return leased(self._run)

    def _run(self, lease: Lease) -> Iterator[Any]:
        run = self._mixture.progress
        for got in self._arrivals(lease, self._batch_size_samples):
            run.commit(got.batch, got.cost, got.wait_s)
            yield got.data

    def _documents(self, lease: Lease) -> Iterator[dict[str, Any]]:
        """A packed mixture's documents from the workers, each committed as it is taken (as
        the packer takes them when this process reads), so states equal num_workers=0's."""
        run = self._mixture.progress
        for got in self._arrivals(lease, PACKED_DOCUMENTS):
            passes = [iter([p for p, lo, hi in segments for _ in range(hi - lo)])
                      for segments in got.batch.segments]
            cost, wait_s = got.cost, got.wait_s
            for item, i in zip(got.data, got.batch.sources.tolist(), strict=True):
                run.check_current(got.generation)
                run.commit_document(i, next(passes[i]), cost, wait_s)
                cost, wait_s = NO_COST, 0.0
                yield item

    def _arrivals(self, lease: Lease, unit: int) -> Iterator[_Arrival]:
        """The workers' batches of ``unit`` samples, in plan order, each checked current."""
        mix = self._mixture
        run = mix.progress
        generation, passes = run.begin(lease)
        if not passes:  # no step left in this epoch: no workers to start
            run.finished(generation)
            return
        plan = self._source.plan = list(run.plan(unit))
        self._source.streams = [p.stream for p in passes]
        self._source.later = later_passes(mix, plan)
        self._source.mixture = mix  # pickled into the workers started below
        try:
            inner = super().__iter__()
        finally:
            self._source.mixture, self._source.plan, self._source.later = None, [], {}
        try:
            for expected, (made, wait_s) in enumerate(timed(inner)):
                if made.number != expected:
                    raise RuntimeError(f"batch {made.number} arrived where batch {expected} "
                                       "was due; refusing to commit out-of-order progress")
                run.check_current(generation)
                yield _Arrival(plan[expected], made.data, made.cost, wait_s, generation)
            run.finished(generation)
        finally:
            shutdown = getattr(inner, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            run.close()

    def __len__(self) -> int:
        """Batches the next iteration yields: the rest of the epoch, or the whole next
        epoch once this mixture read the current one to its end (iterating then starts it)."""
        len(self._mixture)  # a packed mixture has none: TypeError
        run = self._mixture.progress
        n = run.epoch_steps() if run.rolls_over else self._mixture.samples_remaining
        return -(-n // self._batch_size_samples)

    def state_dict(self) -> dict[str, Any]:
        return self._mixture.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._mixture.load_state_dict(state)
