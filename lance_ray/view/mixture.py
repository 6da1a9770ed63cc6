"""``MixtureDataset``: one rank's weighted mixture of several tables, exact and resumable.

Each source is an ordinary :class:`StreamingDataset` view of its table (same ``num_splits``,
seed, rank and world size), so each source keeps every guarantee a single table has; the
mixture decides only *which* source each step reads (:mod:`lance_ray.stream.mixing`) and
keeps its own small state (:mod:`lance_ray.state.mixture`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from ..checks import numpy_scalars_accepted, positive_int
from ..coordinator.client import DEFAULT_NAMESPACE, refuse_sample_reads
from ..plan.splits import check_epoch_seed
from ..read.transform import Transform
from ..state.merge import merge_state_dicts
from ..state.mixture import (
    PACK_KEY,
    STOPS,
    check_distinct_sources,
    check_mixture_compatible,
    make_mixture_state,
    mixture_meta,
    mixture_seed,
    parse_mixture,
    phase_over,
    phase_step,
    rank_own,
    source_meta,
)
from ..stream.mixing import Schedule, integer_weights
from .dataset import StreamingDataset
from .iteration import Lease, leased
from .mix_attach import MixtureLink, attach
from .mix_batches import check_same_columns
from .mix_pack import TokenPacker, blocks, carries_for, pack_config
from .mix_reading import MixProgress

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """One table of a mixture: anything :class:`StreamingDataset` takes, its positive
    ``weight`` (proportions only matter: ``7, 2, 1`` is ``0.7, 0.2, 0.1``), and optionally a
    SQL ``filter`` and a pinned ``table_version``."""

    table: Any
    weight: float = 1.0
    filter: str | None = None
    table_version: int | None = None


class MixtureDataset(IterableDataset):
    """A weighted mixture of tables as an elastic, exactly-resumable ``IterableDataset``.

    Every item (a dict) and batch carries ``"source"``, the index of its source (an int64
    tensor in batches). Guarantees:

    * after ``k`` samples on a rank, the count from source ``i`` is within one sample of
      ``k * w_i / sum(w)`` (counted from the epoch's start, or from the resume point after
      a resume on another world size);
    * the sequence depends only on the arguments (not on the reader or the cluster);
    * ``stop="first_exhausted"``: no sample repeats in a mixture epoch, which ends for every
      rank at the same step, when the first source runs out under its share;
      ``stop="all_exhausted"``: a source that runs out starts its next pass (the plan of its
      next epoch) and keeps its share; the epoch ends once every source was read whole;
    * ``state_dict()`` at any batch resumes the same sequence; every rank's states merged
      (:meth:`merge_state_dicts`) resume on any world size dividing ``num_splits``, each
      remaining sample of each source delivered at most once (exactly once under
      ``all_exhausted``, and under ``first_exhausted`` unless the world grew mid-cycle);
    * ``load_state_dict`` refuses, naming the fix, a state of other sources, weights, order
      or table versions.

    Args:
        sources: the :class:`Source` list, in a fixed order (it is part of the state).
        num_splits, shuffle, shuffle_seed, epoch, rank, world_size, columns, transform,
        reader, read_batch_size, io_queue_depth, storage_options, ray_remote_args, plan,
        shuffle_clump_size: as for :class:`StreamingDataset`, applied to every source (a
            ``transform`` must return one dict per row).
        stop: ``"first_exhausted"`` (default) or ``"all_exhausted"``.
        pack_sequences, eos_id, pad_id: pack the rank's documents (one token column), in
            the mixture's order, into blocks of ``pack_sequences`` tokens that hold several
            sources: ``{"input_ids", "doc_ids", "source_ids"}`` LongTensors.
    """

    merge_state_dicts = staticmethod(merge_state_dicts)
    is_mixture = True  # StreamingDataLoader gives a mixture its own loader

    @numpy_scalars_accepted
    def __init__(self, sources: Sequence[Source], *, num_splits: int | None = None,
                 shuffle: bool = True, shuffle_seed: int = 0, epoch: int = 0, rank: int = 0,
                 world_size: int = 1, stop: str = "first_exhausted",
                 columns: list[str] | None = None, transform: Transform | None = None,
                 **view_kwargs: Any) -> None:
        super().__init__()
        if stop not in STOPS:
            raise ValueError(f"stop must be one of {STOPS}, got {stop!r}")
        if not isinstance(sources, Sequence) or not sources or \
                not all(isinstance(s, Source) for s in sources):
            raise ValueError("sources must be a non-empty list of lance_ray.Source(table, "
                             "weight=...)")
        pack = pack_config(view_kwargs, columns, transform)
        refused = {"fill_value", "worker_info_override"} & set(view_kwargs)
        if view_kwargs.get("on_transform_error", "raise") != "raise":
            refused.add("on_transform_error")
        if refused:
            raise ValueError(f"MixtureDataset does not take {sorted(refused)}: a mixture's "
                             "transform must not drop rows (on_transform_error='raise')")
        positive_int("world_size", world_size)
        shuffle_seed = mixture_seed(shuffle_seed)
        weights = integer_weights([s.weight for s in sources])
        num_splits = world_size if num_splits is None else num_splits

        def view(s: Source) -> StreamingDataset:
            return StreamingDataset(
                s.table, num_splits=num_splits, shuffle=shuffle, shuffle_seed=shuffle_seed,
                epoch=epoch, rank=rank, world_size=world_size, columns=columns,
                filter=s.filter, transform=transform, table_version=s.table_version,
                **view_kwargs)

        # The sources' plans build at once (each mostly waits on its table's scan).
        with ThreadPoolExecutor(len(sources), thread_name_prefix="mixture-plan") as pool:
            views = list(pool.map(view, sources))
        self._setup(views, [s.filter for s in sources], weights, stop=stop, rank=rank,
                    world_size=world_size, num_splits=num_splits, shuffle_seed=shuffle_seed,
                    epoch=epoch, pack=pack)

    def _setup(self, views: list[StreamingDataset], filters: list[str | None],
               weights: tuple[int, ...], *, stop: str, rank: int, world_size: int,
               num_splits: int, shuffle_seed: int, epoch: int,
               pack: dict[str, Any] | None, link: MixtureLink | None = None) -> None:
        """The mixture over one view per source (built here, or attached to the
        coordinator ``link``'s sources), at the start of ``epoch``."""
        empty = [i for i, v in enumerate(views) if len(v) == 0]
        if empty:
            raise ValueError(f"source(s) {empty} give rank {rank} no samples (no rows after "
                             f"the filter, or fewer than num_splits={num_splits}); remove them "
                             "or lower num_splits")
        check_distinct_sources([(v._table.uri, v._table.version, f)
                                for v, f in zip(views, filters)])
        check_same_columns(views)
        self._pack, self._link = pack, link  # link: the coordinator of an attached view
        for v, w in zip(views, weights):  # the first batch waits for one table's first read
            v._reads.sizing = replace(v._reads.sizing, first_share=w / sum(weights))
        self._meta = mixture_meta(
            [source_meta(v._table.uri, v._table.version, f, v._plan.total_rows)
             for f, v in zip(filters, views)],
            weights, stop, num_splits, shuffle_seed)
        self._new_packer()
        self._progress = MixProgress(
            views, Schedule(weights), stop=stop, rank=rank, world_size=world_size,
            num_splits=num_splits, epoch=epoch, next_epoch=self.set_epoch,
            on_batch=self._report_step,
            tail=self._carries_tokens)

    @classmethod
    @numpy_scalars_accepted
    def from_coordinator(cls, name: str, *, rank: int, world_size: int,
                         namespace: str = DEFAULT_NAMESPACE, **view_kwargs: Any
                         ) -> MixtureDataset:
        """Rank ``rank`` of ``world_size`` of the mixture coordinator ``name`` (made by
        ``Coordinator.create`` over a list of :class:`Source`): each source's view takes
        its splits from the source's coordinator; the view starts from the latest sealed
        step (a new world size resizes the run) and sends its state every ``every_batches``
        global steps of the ``report_policy``, at each phase's end and new epoch, and at
        every ``state_dict()`` (which returns once the coordinator recorded it).
        ``view_kwargs``: :meth:`StreamingDataset.from_coordinator`'s read arguments
        (``columns``, ``transform``, ``reader``...), applied to every source.
        """
        views, link, state, epoch = attach(name, rank=rank, world_size=world_size,
                                           namespace=namespace, **view_kwargs)
        meta = link.run.meta
        self = cls.__new__(cls)
        IterableDataset.__init__(self)
        self._setup(views, [s["filter"] for s in meta["sources"]],
                    tuple(s["weight"] for s in meta["sources"]), stop=meta["stop"], rank=rank,
                    world_size=world_size, num_splits=meta["num_splits"],
                    shuffle_seed=meta["shuffle_seed"], epoch=link.run.epoch,
                    pack=link.run.pack, link=link)
        if self._meta != meta:
            raise RuntimeError(f"the views of coordinator {name!r} describe another mixture "
                               f"({self._meta}) than the coordinator ({meta}); this is a bug "
                               "in lance_ray")
        if state is not None:
            self.load_state_dict(state)
        elif epoch != self.epoch:
            self.set_epoch(epoch)
        return self

    def _carries_tokens(self) -> bool:
        """Whether a packed mixture's packer holds tokens not yet handed over in a block."""
        return self._pack is not None and bool(self._packer.tokens)

    def _new_packer(self) -> None:
        """A packed mixture's packer, empty (an epoch's last block is padded: nothing
        carries over into the next)."""
        if self._pack is not None:
            self._packer = TokenPacker(self._pack["pack_sequences"], self._pack["eos_id"],
                                       self._pack["pad_id"])

    # ----------------------------------------------------------------------- progress
    @property
    def progress(self) -> MixProgress:
        """This mixture's iteration object: its progress, and the reading that advances it
        (what ``StreamingDataLoader`` reads through)."""
        return self._progress

    @property
    def packed(self) -> bool:
        """Whether the mixture yields packed token blocks (``pack_sequences``)."""
        return self._pack is not None

    @property
    def rank(self) -> int:
        return self._progress.rank

    @property
    def world_size(self) -> int:
        return self._progress.world_size

    @property
    def epoch(self) -> int:
        """The mixture epoch being read."""
        return self._progress.epoch

    @property
    def global_step(self) -> int:
        """Batches this rank delivered in the current epoch (checkpoints count in them)."""
        return self._progress.global_step

    @property
    def num_splits(self) -> int:
        return int(self._meta["num_splits"])

    @property
    def sources(self) -> list[StreamingDataset]:
        """Each source's own view (its plan, stats and state)."""
        return list(self._progress.views)

    @property
    def samples_remaining(self) -> int:
        """Samples this rank still yields in the current mixture epoch."""
        return self._progress.end - self._progress.step

    def __len__(self) -> int:
        """Samples this rank yields in the current phase (an epoch, unless it resumed on
        another world size: then from the resume point); ``TypeError`` when packed."""
        if self._pack is not None:
            raise TypeError("a packed mixture has no len(): how many blocks its documents fill "
                            "is known only once they are read (samples_remaining counts them)")
        return self._progress.end

    def state_dict(self) -> dict[str, Any]:
        """This rank's consumer-committed progress as plain, JSON-serialisable data (an
        attached view returns it once its coordinator has recorded it)."""
        state = self._state()
        if self._link is not None:
            self._link.report(state, wait=True)
        return state

    def _report_step(self) -> None:
        """An attached view sends its state after the global steps every rank sends."""
        run = self._progress
        if self._link is not None and self._link.due(run.global_step, run.step >= run.end):
            self._link.report(self._state())

    def _state(self) -> dict[str, Any]:
        ws, run = self.world_size, self._progress
        return make_mixture_state(
            self._meta, epoch=run.epoch, world_size=ws, rank=None if ws == 1 else self.rank,
            step=run.step, end=run.end, global_step=run.global_step,
            passes=run.passes, whole=run.whole,
            sources=[v.state_dict() if self._pack is None or ws == 1 else
                     rank_own(v.state_dict(), self.rank, ws) for v in run.views],
            **({} if self._pack is None else {PACK_KEY: {
                **self._pack, "world_size": ws, "carries": {
                    str(self.rank): self._packer.carry()}}}))

    @numpy_scalars_accepted
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state``; the mixture's progress changes only if the whole state is
        valid. A state refused once the sources' views took their parts (a phase its
        sources do not bear out) still supersedes a live iterator: create a new one."""
        mix = parse_mixture(state)
        check_mixture_compatible(mix, self._meta)
        if (PACK_KEY in state) != (self._pack is not None):
            raise ValueError("this state is of a " + ("packed" if PACK_KEY in state else
                             "unpacked") + " mixture; construct the MixtureDataset " +
                             ("with" if PACK_KEY in state else "without") + " pack_sequences")
        carries = None if self._pack is None else carries_for(
            state[PACK_KEY], self._pack, self.rank, self.world_size)
        self._progress.load(
            state["sources"], passes=mix["passes"], epoch=mix["epoch"],
            whole=mix["read_whole"], global_step=mix["global_step"], end=mix["end"],
            step=phase_step(state, self.rank, self.world_size), over=phase_over(state),
            # One rank's packed state says nothing of the others' steps (their blocks hold
            # other documents); an unpacked rank's own state is lockstep.
            common=mix["step"] is not None and (self._pack is None or mix["rank"] is None))
        if carries is not None:
            self._packer.restore(carries)

    @numpy_scalars_accepted
    def set_epoch(self, epoch: int) -> None:
        """Read mixture epoch ``epoch`` from its start (every source at its plan of that
        epoch); a no-op on the epoch being read, as for a view, so that the usual
        ``set_epoch(epoch)`` before each epoch keeps a resumed position."""
        check_epoch_seed(self._meta["shuffle_seed"], epoch)
        run = self._progress
        if epoch == run.epoch:
            return
        if self.samples_remaining and run.step:
            logger.warning("leaving mixture epoch %d with %d samples of rank %d unread",
                           run.epoch, self.samples_remaining, self.rank)
        if self._link is not None:
            self._link.set_epoch(epoch)  # may be refused (an older epoch): nothing changed
        for v in run.views:
            _restart(v, epoch)
        self._new_packer()
        run.begin_epoch(epoch)
        if self._link is not None:  # once every rank is here, restarts begin this epoch
            self._link.report(self._state())

    # ----------------------------------------------------------------------- reading
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield samples one by one: dicts carrying ``"source"`` (packed: blocks)."""
        if self._link is not None:
            refuse_sample_reads()
        if self._pack is not None:
            return leased(lambda lease: self._packed(lease, None))
        return leased(lambda lease: self._progress.read(lease, None, None))

    @numpy_scalars_accepted
    def iter_batches(self, batch_size: int, *,
                     collate_fn: Callable[[list[Any]], Any] | None = None) -> Iterator[Any]:
        """Yield batches of ``batch_size`` consecutive samples (the last may be short),
        each committed when handed over; ``batch["source"]`` is an int64 tensor."""
        positive_int("batch_size", batch_size)
        if self._pack is not None:
            return leased(lambda lease: self._packed(lease, batch_size))
        return leased(lambda lease: self._progress.read(lease, batch_size, collate_fn))

    def _packed(self, lease: Lease, batch_size: int | None) -> Iterator[dict[str, Any]]:
        return self.pack_blocks(self._progress.read(lease, None, None), batch_size)

    def pack_blocks(self, documents: Iterator[dict[str, Any]], batch_size: int | None
                    ) -> Iterator[dict[str, Any]]:
        """Blocks (``{"input_ids", "doc_ids", "source_ids"}``) packed from ``documents``
        (this mixture's items in its order, each committed as the packer takes it), one by
        one or ``batch_size`` at a time."""
        import torch

        assert self._pack is not None, "pack_blocks is for a packed mixture"
        # Starting the read may roll over to the next epoch, which makes a new packer: take
        # the packer only once the read has started.
        documents = iter(documents)
        first = next(documents, None)
        started = documents if first is None else itertools.chain([first], documents)
        out = blocks(self._packer, started, self._pack["column"])
        while True:
            group = list(itertools.islice(out, batch_size or 1))
            if not group:
                return
            if batch_size is None:
                yield {k: torch.from_numpy(v) for k, v in group[0].items()}
            else:
                batch = {k: torch.from_numpy(np.stack([b[k] for b in group])) for k in group[0]}
                self._progress.commit_packed_batch()
                yield batch


def _restart(view: StreamingDataset, epoch: int) -> None:
    """``view`` at the start of epoch ``epoch``'s plan, even if it is already on it."""
    if view._spec.epoch == epoch:
        view._install_plan(view._spec, view._plan)
    else:
        view.set_epoch(epoch)
