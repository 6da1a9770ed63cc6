"""The order in which one rank yields its samples: a pure function of its progress.

A rank owns splits ``s_0 < s_1 < ... < s_{m-1}``, each ``split_len`` long, and has consumed
``c_i`` samples of split ``s_i``. Its remaining sequence is every (split, level) pair with
``c_i <= level < split_len``, ordered by level and then by split. For equal counts this is
the plain round-robin (one sample per split per cycle); for unequal counts (a checkpoint
taken mid-cycle) the lagging splits catch up first, exactly as lancedb.streaming does with
its (count, split) min-heap. Because the whole sequence is closed-form, any slice of it, and
the progress after any prefix of it, is computed without reading or replaying data.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segment:
    """``count`` samples from level ``lo`` on, cycling over the splits ``active`` (local
    indices, ascending): sample k of the segment is split ``active[k % len(active)]`` at
    level ``lo + k // len(active)``."""

    start: int  # index of the segment's first sample in the remaining sequence
    lo: int
    active: np.ndarray
    count: int


@dataclass(frozen=True)
class RankStream:
    """The remaining sample sequence of one rank (or any set of splits).

    ``samples[i]`` orders the sequence; ``positions[i]`` is where split i's next read
    starts (larger than ``samples[i]`` only when earlier rows were skipped).
    """

    splits: tuple[int, ...]
    samples: tuple[int, ...]
    positions: tuple[int, ...]
    split_len: int

    def __post_init__(self) -> None:
        if not (len(self.splits) == len(self.samples) == len(self.positions)):
            raise ValueError("splits, samples and positions must have the same length")

    def segments(self) -> list[Segment]:
        """The sequence as runs of levels with a constant set of active splits.

        Split i has rows up to level ``end_i = samples_i + (split_len - positions_i)``
        (earlier than ``split_len`` only if rows were skipped). Like the reference, the
        catch-up stops at the first lagging split with no row left, and round-robin cycles
        run only while every split still has a row.
        """
        if not self.splits:
            return []
        counts = np.asarray(self.samples, dtype=np.int64)
        ends = counts + self.split_len - np.asarray(self.positions, dtype=np.int64)
        top = int(counts.max())
        dry = min(((int(ends[i]), i) for i in range(len(counts))
                   if counts[i] < top and ends[i] < top), default=None)
        out: list[Segment] = []
        start = 0
        bounds = sorted({int(c) for c in counts if c < top} | {top})
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            active = np.flatnonzero(counts <= lo)
            if dry is not None and dry[0] < hi:
                before_dry = (dry[0] - lo) * len(active) + int(np.sum(active < dry[1]))
                out.append(Segment(start, lo, active, before_dry))
                return out
            out.append(Segment(start, lo, active, (hi - lo) * len(active)))
            start += out[-1].count
        end = int(ends.min())
        if end > top:
            out.append(Segment(start, top, np.arange(len(counts)), (end - top) * len(counts)))
        return out

    def __len__(self) -> int:
        return sum(seg.count for seg in self.segments())

    def slice(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Global split ids and read positions of samples ``start .. stop-1``."""
        split_parts: list[np.ndarray] = []
        pos_parts: list[np.ndarray] = []
        splits = np.asarray(self.splits, dtype=np.int64)
        base = np.asarray(self.positions, dtype=np.int64) - np.asarray(self.samples, dtype=np.int64)
        for seg in self.segments():
            lo = max(start, seg.start)
            hi = min(stop, seg.start + seg.count)
            if lo >= hi:
                continue
            k = np.arange(lo - seg.start, hi - seg.start, dtype=np.int64)
            width = len(seg.active)
            local = seg.active[k % width]
            level = seg.lo + k // width
            split_parts.append(splits[local])
            pos_parts.append(level + base[local])
        if not split_parts:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        return np.concatenate(split_parts), np.concatenate(pos_parts)

    def advanced(self, n: int) -> RankStream:
        """The stream left after consuming its first ``n`` samples."""
        if n < 0:
            raise ValueError(f"cannot advance by a negative count ({n})")
        taken = np.zeros(len(self.splits), dtype=np.int64)
        left = n
        for seg in self.segments():
            if left <= 0:
                break
            use = min(left, seg.count)
            width = len(seg.active)
            taken[seg.active] += use // width
            taken[seg.active[: use % width]] += 1
            left -= use
        if left > 0:
            raise ValueError(f"cannot advance by {n}: only {n - left} samples remain")
        return RankStream(
            self.splits,
            tuple(int(s + t) for s, t in zip(self.samples, taken)),
            tuple(int(p + t) for p, t in zip(self.positions, taken)),
            self.split_len,
        )

    def batches(self, batch_size: int) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` of consecutive batches covering the whole stream."""
        total = len(self)
        for lo in range(0, total, batch_size):
            yield lo, min(lo + batch_size, total)


def stream_for(
    splits: Sequence[int], samples: Sequence[int], positions: Sequence[int], split_len: int
) -> RankStream:
    """The stream of ``splits`` given the full per-split progress lists."""
    return RankStream(
        tuple(splits),
        tuple(int(samples[s]) for s in splits),
        tuple(int(positions[s]) for s in splits),
        split_len,
    )
