"""How a :class:`~lance_ray.view.mixture.MixtureDataset` reads: :class:`MixProgress` is its
iteration object. It holds the mixture's progress (the step, the phase's end, each source's
pass and samples left), plans its batches (which samples of which source pass), reads each
source's pass in order, and commits each batch's samples to their sources' views when the
batch is handed over (here, or in the trainer's process when DataLoader workers read).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..read.requests import NO_COST, ReadCost
from ..state.mixture import ranks_left, split_left
from ..stream.mixing import Schedule, end_step
from .iteration import CONCURRENT, Lease
from .mix_batches import (
    RUN_BYTES,
    MixBatch,
    SourceBuffer,
    mixed_batch,
    mixed_items,
    mixed_run,
    plan_batches,
    runs,
)
from .mix_phase import check_ended, check_phase, phase_end

if TYPE_CHECKING:
    from .dataset import StreamingDataset
    from .reading import Pass

logger = logging.getLogger("lance_ray.view.mixture")


class MixProgress:
    """One rank's progress through a mixture of ``views`` (one per source), and the reading
    and committing that advance it.

    ``next_epoch(epoch)``: the mixture's ``set_epoch``, called when an iteration starts
    after this rank read its epoch to the end; ``on_batch()``: called after each committed
    batch (an attached mixture sends its state to its coordinator there); ``tail()``:
    whether the epoch still has output to hand over once its samples are all read (a packed
    mixture's last, padded block), so that the next iteration hands it over instead of
    starting the next epoch.
    """

    def __init__(self, views: list[StreamingDataset], schedule: Schedule, *, stop: str,
                 rank: int, world_size: int, num_splits: int, epoch: int,
                 next_epoch: Callable[[int], None], on_batch: Callable[[], None],
                 tail: Callable[[], bool]) -> None:
        self.views, self.schedule, self.stop = views, schedule, stop
        self.rank, self.world_size, self.num_splits = rank, world_size, num_splits
        self._next_epoch, self._on_batch, self._tail = next_epoch, on_batch, tail
        self._generation = 0
        self._lease: weakref.ref[Iterator[Any]] | None = None  # the one live iterator
        self._pass_objs: list[Pass] = []
        self.begin_epoch(epoch)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_lease"] = None  # iterators stay in their process
        return state

    # ----------------------------------------------------------------------- progress
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        """Samples this rank delivered in the current phase's steps (from its start)."""
        return self._step

    @property
    def end(self) -> int:
        """The step at which the current phase ends."""
        return self._end

    @property
    def global_step(self) -> int:
        return self._global_step

    @property
    def passes(self) -> list[int]:
        """Each source's current pass (its epoch)."""
        return list(self._passes)

    @property
    def whole(self) -> list[bool]:
        """Whether each source was read whole in this mixture epoch."""
        return list(self._whole)

    @property
    def left(self) -> list[int]:
        """Samples this rank has left of each source's current pass."""
        return list(self._left)

    def begin_epoch(self, epoch: int) -> None:
        """Mixture epoch ``epoch`` from its start (the views are at its plans already)."""
        self._epoch = epoch
        self._passes = [epoch] * len(self.views)
        self._whole = [False] * len(self.views)
        self._global_step = 0
        self._ended = self._loaded = False
        self._generation += 1
        self._start_phase([[len(v)] * self.world_size for v in self.views], step=0,
                          end=self.epoch_steps())

    def load(self, subs: list[dict[str, Any]], *, passes: list[int], **phase: Any) -> None:
        """Load each source's state ``subs[i]`` into its view at its pass ``passes[i]``, then
        the progress (``phase``: :meth:`resume`'s arguments but ``left``). If refused, the
        views are restored as they were (a live iterator is superseded all the same)."""
        before = [(v._spec, v._plan, v.state_dict()) for v in self.views]
        try:
            for view, sub, p in zip(self.views, subs, passes):
                # From its pass's start first: the state replaces the view's progress, which
                # set_epoch would otherwise report as samples left unread.
                view._install_plan(view._spec, view._plan)
                view.set_epoch(p)
                view.load_state_dict(sub)
            self.resume(passes=passes, left=[split_left(v.state_dict()) for v in self.views],
                        **phase)
        except Exception:
            for view, (spec, plan, sub) in zip(self.views, before):
                # Not set_epoch: it would report the refused state's progress as unread.
                view._install_plan(spec, plan)
                view.load_state_dict(sub)
            raise

    def resume(self, *, epoch: int, passes: list[int], whole: list[bool], global_step: int,
               left: list[list[int]], step: int | None, end: int, over: bool = False,
               common: bool = True) -> None:
        """Progress loaded from a state (the views already hold their parts):
        ``left[i][s]``: samples split ``s`` has left of source ``i``'s pass; ``step``: the
        phase goes on at ``step`` to ``end`` (None: a new phase starts here, at step 0);
        ``over``: the state's phase was read to its end; ``common``: every rank is at
        ``step`` (else ranks' steps differ, as packed ranks' do). Nothing changes if the
        state is refused."""
        saved = self._epoch, self._passes, self._whole, self._global_step
        self._epoch, self._passes = epoch, list(passes)
        self._whole, self._global_step = list(whole), global_step
        phase: dict[str, Any] = {"left": left, "world_size": self.world_size}
        remaining = [ranks_left(s, self.world_size) for s in left]
        try:
            if over and not step:
                # An ended epoch stays ended on any world size: its sources' next passes,
                # partly read, are no phase's, and another grouping of their splits would
                # only refuse or prolong an epoch that is over.
                check_ended(stop=self.stop, rank=self.rank, common=common, whole=whole,
                            **phase)
                self._start_phase(remaining, step=0, end=0)
            elif step is not None:  # the same group: the phase goes on
                check_phase(self.schedule, stop=self.stop, rank=self.rank, step=step,
                            end=end, common=common, whole=whole, **phase)
                self._start_phase(remaining, step=step, end=end)
            else:
                self._start_phase(remaining, step=0, end=phase_end(
                    self.schedule, stop=self.stop, step=0, whole=whole, **phase))
        except Exception:
            self._epoch, self._passes, self._whole, self._global_step = saved
            raise
        self._ended = False
        self._loaded = True  # a state loaded at its epoch's end yields nothing, as a view's
        self._generation += 1

    def _start_phase(self, remaining: list[list[int]], *, step: int, end: int) -> None:
        """Steps run from ``step`` to ``end``; ``remaining[i][r]``: samples rank ``r`` has
        left of source ``i``'s pass."""
        self._step, self._end = step, end
        self._left = [r[self.rank] for r in remaining]  # this rank, in the current pass

    # ----------------------------------------------------------------------- reading
    @property
    def rolls_over(self) -> bool:
        """Whether the next iteration starts the next epoch: this view read the current one
        to its end (a state loaded at its end yields nothing instead)."""
        at_end = self._step >= self._end
        return not (at_end and self._loaded) and (self._ended or (at_end and self._step > 0)) \
            and not self._tail()

    def epoch_steps(self) -> int:
        """Steps of a mixture epoch read from its start (every source at a fresh pass)."""
        return end_step(self.schedule, [len(v) for v in self.views], stop=self.stop)

    def _roll_over(self) -> None:
        """Iterating an epoch this view read to its end starts the next one."""
        if self._step >= self._end and self._loaded:
            logger.info("rank %d has no samples left in mixture epoch %d; call set_epoch(%d) "
                        "to start the next one", self.rank, self._epoch, self._epoch + 1)
        elif self.rolls_over:
            logger.info("mixture epoch %d is exhausted on rank %d; starting epoch %d",
                        self._epoch, self.rank, self._epoch + 1)
            self._next_epoch(self._epoch + 1)

    def begin(self, lease: Lease | None = None) -> tuple[int, list[Pass]]:
        """A new iteration (``lease``: its iterator): its generation, and a pass over each
        source's current pass (none when this epoch has no step left to read: its tail, or
        a state loaded at its end). A second live iterator is refused, as a view refuses it."""
        active = self._lease() if self._lease is not None else None
        if active is not None and getattr(active, "gi_frame", None) is not None and (
                not lease or active is not lease[0]()):
            raise RuntimeError(CONCURRENT.replace("StreamingDataset", "MixtureDataset"))
        self._lease = lease[0] if lease else None
        self._roll_over()
        # A source view read to its end would start its own next epoch when a pass begins:
        # with no step left, the sources' passes stay as they are.
        self._pass_objs = [] if self._step >= self._end else [
            v.begin_pass(None) for v in self.views]
        return self._generation, self._pass_objs

    def plan(self, batch_size: int) -> Iterator[MixBatch]:
        """The batches from the current step to the phase's end."""
        return plan_batches(self.schedule, self._step, self._end, batch_size, self._left,
                            [len(v) for v in self.views], self._passes)

    def read(self, lease: Lease, batch_size: int | None,
             collate_fn: Callable[[list[Any]], Any] | None) -> Iterator[Any]:
        """Items (``batch_size`` None) or batches, each committed when handed over."""
        generation, passes = self.begin(lease)
        if not passes:
            self.finished(generation)
            return
        as_tensors = batch_size is not None and collate_fn is None
        # Each source's reads are cut into batches of the mixture's size: a mixture batch then
        # takes from one (rarely two) of them, whatever the source's share.
        group = [batch_size or v._reads.sizing.first_rows for v in self.views]
        buffers: list[SourceBuffer | None] = [
            SourceBuffer(p.read_batches(g, as_tensors=as_tensors), n) if left else None
            for p, g, n, left in zip(self._pass_objs, group, self._passes, self._left)]
        # Every source's first read at once: the first batch waits for the slowest, not
        # for their sum.
        with ThreadPoolExecutor(len(buffers), thread_name_prefix="mixture-read") as pool:
            list(pool.map(lambda b: b and b.prime(), buffers))
        run_rows = self._run_rows(batch_size) if as_tensors else 1
        try:
            for run in runs(self.plan(batch_size or 1), run_rows):
                if len(run) > 1 and self._in_current_passes(run):
                    yield from self._read_run(run, buffers, group, generation)
                    continue
                for mb in run:
                    self.check_current(generation)
                    parts: list[list[Any]] = [[] for _ in self.views]
                    for i, segments in enumerate(mb.segments):
                        for pass_no, lo, hi in segments:
                            b = self._buffer(buffers, i, pass_no, group[i], as_tensors)
                            parts[i] += b.take(hi - lo, time.monotonic)
                            cost, wait = b.booked()
                            self._deliver(i, hi - lo, cost, wait)
                    if batch_size is None:
                        self._stepped(1, batches=0)
                        yield mixed_items(parts, mb.sources)[0]
                    else:
                        out = mixed_batch(parts, mb.sources, collate_fn)
                        self._stepped(len(mb.sources), batches=1)
                        yield out
            self.finished(generation)
        finally:
            for buf in buffers:
                if buf is not None:
                    buf.close()
            self.close()

    def _buffer(self, buffers: list[SourceBuffer | None], i: int, pass_no: int, group: int,
                as_tensors: bool) -> SourceBuffer:
        """Source ``i``'s buffer of pass ``pass_no``, entering that pass if it is new."""
        self._enter_pass(i, pass_no)
        b = buffers[i]
        if b is None or b.pass_no != pass_no:
            if b is not None:
                b.close()
            b = buffers[i] = SourceBuffer(self._pass_objs[i].read_batches(
                group, as_tensors=as_tensors), pass_no)
        return b

    def _run_rows(self, batch_size: int | None) -> int:
        """Samples of consecutive batches to assemble at once: ``RUN_BYTES`` of rows (one
        batch when rows are wide, or of unknown width)."""
        widths = [w for v in self.views if (w := v._reads.sizing.row_bytes) is not None]
        if batch_size is None or len(widths) < len(self.views):
            return 1
        return max(batch_size, RUN_BYTES // max(1, *widths))

    def _in_current_passes(self, run: list[MixBatch]) -> bool:
        return all(segments[0][0] == self._passes[i] for mb in run
                   for i, segments in enumerate(mb.segments) if segments)

    def _read_run(self, run: list[MixBatch], buffers: list[SourceBuffer | None],
                  group: list[int], generation: int) -> Iterator[Any]:
        """The batches of ``run`` (every source in its current pass throughout), their rows
        taken and put in step order at once, each committed as it is handed over."""
        self.check_current(generation)
        counts = [[sum(hi - lo for _, lo, hi in mb.segments[i]) for mb in run]
                  for i in range(len(self.views))]
        parts: list[list[Any]] = [[] for _ in self.views]
        booked: list[tuple[ReadCost, float]] = [(NO_COST, 0.0)] * len(self.views)
        for i, n in enumerate(counts):
            if sum(n):
                b = self._buffer(buffers, i, self._passes[i], group[i], True)
                parts[i] = b.take(sum(n), time.monotonic)
                booked[i] = b.booked()
        for k, out in enumerate(mixed_run(parts, counts, [mb.sources for mb in run])):
            self.check_current(generation)
            for i, n in enumerate(counts):
                if n[k]:
                    self._deliver(i, n[k], *booked[i])
                    booked[i] = (NO_COST, 0.0)
            self._stepped(len(run[k].sources), batches=1)
            yield out

    def check_current(self, generation: int) -> None:
        """Refuse an iterator of an older ``generation``."""
        if generation != self._generation:
            raise RuntimeError("this iterator was superseded by load_state_dict() or "
                               "set_epoch(); create a new iterator to continue")

    def finished(self, generation: int) -> None:
        """The iterator of ``generation`` read its plan to the end (the epoch ended, unless
        a newer iterator took over). A state loaded at its epoch's end yields nothing once,
        then the next iteration starts the next epoch, as a view does."""
        self._ended = generation == self._generation
        if self._ended:
            self._loaded = False

    def commit(self, mb: MixBatch, cost: ReadCost, wait_s: float) -> None:
        """Count a batch read elsewhere (a DataLoader worker) as delivered, now."""
        for i, segments in enumerate(mb.segments):
            for pass_no, lo, hi in segments:
                self._enter_pass(i, pass_no)
                self._deliver(i, hi - lo, cost, wait_s)
                cost, wait_s = NO_COST, 0.0
        self._stepped(len(mb.sources), batches=1)

    def commit_document(self, i: int, pass_no: int, cost: ReadCost, wait_s: float) -> None:
        """Count one sample of source ``i``'s pass ``pass_no``, read elsewhere, as delivered
        now: a packed mixture's loader commits documents one by one as the packer takes
        them, as the trainer's own reading does."""
        self._enter_pass(i, pass_no)
        self._deliver(i, 1, cost, wait_s)
        self._stepped(1, batches=0)

    def commit_packed_batch(self) -> None:
        """A batch of packed blocks was handed over: a step (its documents were not)."""
        self._global_step += 1
        self._on_batch()

    def close(self) -> None:
        """End the sources' passes of this iteration."""
        for p in self._pass_objs:
            p.close()
        self._pass_objs = []

    def _deliver(self, i: int, n: int, cost: ReadCost, wait_s: float) -> None:
        self._pass_objs[i].deliver(n, cost, 0, wait_s, batches=0)
        self._left[i] -= n

    def _stepped(self, n: int, *, batches: int) -> None:
        """``n`` steps were delivered. A source whose pass is now delivered moves on at once
        (all_exhausted), so a state taken here already names its next pass."""
        self._step += n
        self._global_step += batches
        self._loaded = False
        if self.stop == "all_exhausted" and self._step < self._end:
            for i, left in enumerate(self._left):
                if left == 0:
                    self._enter_pass(i, self._passes[i] + 1)
        if batches:
            self._on_batch()

    def _enter_pass(self, i: int, pass_no: int) -> None:
        if pass_no == self._passes[i]:
            return
        view = self.views[i]
        self._passes[i] = pass_no
        self._whole[i] = True
        logger.info("mixture source %d was read whole on rank %d; starting its pass %d",
                    i, self.rank, pass_no)
        self._pass_objs[i].close()
        view.set_epoch(pass_no)
        self._pass_objs[i] = view.begin_pass(None)
        self._left[i] = len(view)
