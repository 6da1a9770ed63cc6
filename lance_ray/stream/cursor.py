"""Where one view stands in its epoch, and what one rank's progress says about the others.

Pure bookkeeping (no I/O): the progress a view started from, what it has delivered since,
and, for single-rank checkpoints, the progress every other process of the same layout has
when all of them delivered the same number of samples since a common complete start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .order import RankStream, stream_for

Progress = tuple[list[int], list[int]]  # (samples, positions) for every split


@dataclass
class Cursor:
    """A view's position: the progress it started from plus what it has delivered.

    ``splits`` are the splits the current iterator streams (the rank's own, or one
    DataLoader worker's share of them). ``origin`` is the latest progress known exactly
    for *every* split (an epoch's start, or a complete state that was loaded), and
    ``since_origin`` the samples this view delivered after it; ``None`` when unknown.
    """

    splits: tuple[int, ...]
    samples: list[int]
    positions: list[int]
    split_len: int
    consumed: int = 0  # samples delivered since ``samples``/``positions``
    batches: int = 0  # batches delivered since the start of the epoch, when known
    generation: int = 0  # bumped by every new iterator; stale iterators refuse to go on
    origin: Progress | None = None
    since_origin: int = 0
    ended: bool = False  # an iterator of this view read its stream to the end

    def stream(self) -> RankStream:
        return stream_for(self.splits, self.samples, self.positions, self.split_len)

    def progress(self) -> Progress:
        samples, positions = list(self.samples), list(self.positions)
        done = self.stream().advanced(self.consumed)
        for split, s, p in zip(done.splits, done.samples, done.positions):
            samples[split], positions[split] = s, p
        return samples, positions

    def rebase(self, splits: Sequence[int]) -> RankStream:
        """Fold delivered samples into the start point and stream ``splits`` from it."""
        self.samples, self.positions = self.progress()
        self.consumed = 0
        self.splits = tuple(splits)
        return self.stream()

    def commit(self, samples: int, batches: int = 0) -> None:
        self.consumed += samples
        self.since_origin += samples
        self.batches += batches

    def take(self, survivors: Sequence[tuple[int, int]]) -> None:
        """Deliver samples ``(split, position)`` in the survivor order (failed rows drop
        out of their splits, so progress is kept per split rather than closed-form)."""
        if self.consumed:
            self.samples, self.positions = self.progress()
            self.consumed = 0
        for split, position in survivors:
            self.samples[split] += 1
            self.positions[split] = position + 1
        self.since_origin += len(survivors)

    def lockstep_progress(self, num_splits: int) -> Progress | None:
        """Every split's progress, if it follows from this view's own (see below)."""
        if self.origin is None:
            return None
        return lockstep_progress(self.origin, self.splits, num_splits, self.split_len,
                                 self.since_origin)


def lockstep_progress(origin: Progress, unit: Sequence[int], num_splits: int, split_len: int,
                      delivered: int) -> Progress | None:
    """The progress of every split when each process of the layout delivered ``delivered``
    samples since ``origin``, or None when that does not determine it.

    The layout is the partition of the splits into contiguous blocks like ``unit`` (ranks,
    or the DataLoader workers of every rank). It determines every block's progress when
    every block has as many samples left after ``origin`` (then equal deliveries are equal
    batches), or when ``delivered`` is below every block's count (no block ran out early,
    so none can have delivered a different number in lockstep).
    """
    width = len(unit)
    if width == 0 or num_splits % width or tuple(unit) != tuple(
            range(unit[0], unit[0] + width)) or unit[0] % width:
        return None
    streams: list[RankStream] = [
        stream_for(range(lo, lo + width), origin[0], origin[1], split_len)
        for lo in range(0, num_splits, width)
    ]
    lengths = [len(s) for s in streams]
    if not (delivered < min(lengths) or (len(set(lengths)) == 1 and delivered <= lengths[0])):
        return None
    samples, positions = list(origin[0]), list(origin[1])
    for s in streams:
        done = s.advanced(delivered)
        for split, k, p in zip(done.splits, done.samples, done.positions):
            samples[split], positions[split] = k, p
    return samples, positions
