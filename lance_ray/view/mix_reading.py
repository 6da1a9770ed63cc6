"""How a :class:`~lance_ray.view.mixture.MixtureDataset` reads: it plans its batches (which
samples of which source pass), reads each source's pass in order, and commits each batch's
samples to their sources' views when it hands the batch over (here, or in the trainer's
process when DataLoader workers read).

A mixin of ``MixtureDataset`` (it uses the mixture's views, schedule and progress).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..read.requests import NO_COST, ReadCost
from ..stream.mixing import Schedule
from .iteration import CONCURRENT, Lease
from .mix_batches import MixBatch, SourceBuffer, mixed_batch, mixed_items, plan_batches

if TYPE_CHECKING:
    from .dataset import StreamingDataset
    from .reading import Pass

logger = logging.getLogger("lance_ray.view.mixture")


class MixtureReading:
    """Reading and committing, for :class:`~lance_ray.view.mixture.MixtureDataset`."""

    _views: list[StreamingDataset]
    _schedule: Schedule
    _stop: str
    _rank: int
    _epoch: int
    _step: int
    _end: int
    _global_step: int
    _left: list[int]
    _passes: list[int]
    _whole: list[bool]
    _ended: bool
    _loaded: bool
    _generation: int
    _lease: weakref.ref[Iterator[Any]] | None
    _pass_objs: list[Pass]

    def set_epoch(self, epoch: int) -> None:  # provided by MixtureDataset
        raise NotImplementedError

    def _roll_over(self) -> None:
        """Iterating an epoch this view read to its end starts the next one."""
        if self._step >= self._end and self._loaded:
            logger.info("rank %d has no samples left in mixture epoch %d; call set_epoch(%d) "
                        "to start the next one", self._rank, self._epoch, self._epoch + 1)
        elif self._ended or (self._step >= self._end and self._step > 0):
            logger.info("mixture epoch %d is exhausted on rank %d; starting epoch %d",
                        self._epoch, self._rank, self._epoch + 1)
            self.set_epoch(self._epoch + 1)

    def _begin(self, lease: Lease | None = None) -> tuple[int, list[Pass]]:
        """A new iteration (``lease``: its iterator): its generation, and a pass over each
        source's current pass. A second live iterator is refused, as a view refuses it."""
        active = self._lease() if self._lease is not None else None
        if active is not None and getattr(active, "gi_frame", None) is not None and (
                not lease or active is not lease[0]()):
            raise RuntimeError(CONCURRENT.replace("StreamingDataset", "MixtureDataset"))
        self._lease = lease[0] if lease else None
        self._roll_over()
        self._pass_objs = [v.begin_pass(None) for v in self._views]
        return self._generation, self._pass_objs

    def _plan(self, batch_size: int) -> Iterator[MixBatch]:
        """The batches from the current step to the phase's end."""
        return plan_batches(self._schedule, self._step, self._end, batch_size, self._left,
                            [len(v) for v in self._views], self._passes)

    def _run(self, lease: Lease, batch_size: int | None,
             collate_fn: Callable[[list[Any]], Any] | None) -> Iterator[Any]:
        generation, _ = self._begin(lease)
        as_tensors = batch_size is not None and collate_fn is None
        # Each source's reads are cut into batches of the mixture's size: a mixture batch then
        # takes from one (rarely two) of them, whatever the source's share.
        group = [batch_size or v._reads.sizing.first_rows for v in self._views]
        buffers: list[SourceBuffer | None] = [
            SourceBuffer(p.read_batches(g, as_tensors=as_tensors), n) if left else None
            for p, g, n, left in zip(self._pass_objs, group, self._passes, self._left)]
        # Every source's first read at once: the first batch waits for the slowest, not
        # for their sum.
        with ThreadPoolExecutor(len(buffers), thread_name_prefix="mixture-read") as pool:
            list(pool.map(lambda b: b and b.prime(), buffers))
        try:
            for mb in self._plan(batch_size or 1):
                self._check_current(generation)
                parts: list[list[Any]] = [[] for _ in self._views]
                for i, segments in enumerate(mb.segments):
                    for pass_no, lo, hi in segments:
                        self._enter_pass(i, pass_no)
                        b = buffers[i]
                        if b is None or b.pass_no != pass_no:
                            if b is not None:
                                b.close()
                            b = buffers[i] = SourceBuffer(self._pass_objs[i].read_batches(
                                group[i], as_tensors=as_tensors), pass_no)
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
            self._ended = generation == self._generation
        finally:
            for buf in buffers:
                if buf is not None:
                    buf.close()
            self._close_passes()

    def _check_current(self, generation: int) -> None:
        if generation != self._generation:
            raise RuntimeError("this iterator was superseded by load_state_dict() or "
                               "set_epoch(); create a new iterator to continue")

    def _commit_batch(self, mb: MixBatch, cost: ReadCost, wait_s: float) -> None:
        """Count a batch read elsewhere (a DataLoader worker) as delivered, now."""
        for i, segments in enumerate(mb.segments):
            for pass_no, lo, hi in segments:
                self._enter_pass(i, pass_no)
                self._deliver(i, hi - lo, cost, wait_s)
                cost, wait_s = NO_COST, 0.0
        self._stepped(len(mb.sources), batches=1)

    def _close_passes(self) -> None:
        for p in getattr(self, "_pass_objs", []):
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
        if self._stop == "all_exhausted" and self._step < self._end:
            for i, left in enumerate(self._left):
                if left == 0:
                    self._enter_pass(i, self._passes[i] + 1)
        if batches:
            self._report_step()

    def _report_step(self) -> None:  # provided by MixtureDataset
        raise NotImplementedError

    def _enter_pass(self, i: int, pass_no: int) -> None:
        if pass_no == self._passes[i]:
            return
        view = self._views[i]
        self._passes[i] = pass_no
        self._whole[i] = True
        logger.info("mixture source %d was read whole on rank %d; starting its pass %d",
                    i, self._rank, pass_no)
        self._pass_objs[i].close()
        view.set_epoch(pass_no)
        self._pass_objs[i] = view.begin_pass(None)
        self._left[i] = len(view)
