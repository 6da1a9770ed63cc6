"""The sample order when failed rows are dropped from their splits (``lancedb.streaming``'s
``on_transform_error="skip"`` semantics), as a pure interleaver over per-split queues.

Rows of the splits arrive in any order (reads in plan order); rows whose transform failed
are dropped. Output follows the reference exactly: splits that lag behind the most
advanced one (a checkpoint taken mid-cycle) catch up first, lowest sample count and then
lowest split first; then every cycle yields the next surviving row of every split in
ascending split order, and the epoch ends at the first cycle (or catch-up turn) for which a
split has no surviving row left. Progress per split: ``samples`` yielded and ``positions``
(one past the last yielded row's position), as in the reference's state.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any


class Interleaver:
    """Feed rows with :meth:`feed`; take the samples that are determined with :meth:`ready`.

    ``splits`` are global split ids (ascending); ``samples``/``positions`` their progress at
    the start; each split has rows ``positions[i] .. split_len - 1`` still to arrive.
    """

    def __init__(self, splits: Sequence[int], samples: Sequence[int], positions: Sequence[int],
                 split_len: int):
        self.splits = list(splits)
        self._local = {s: i for i, s in enumerate(self.splits)}
        self.samples = [int(x) for x in samples]
        self.positions = [int(x) for x in positions]
        self._unread = [split_len - p for p in self.positions]
        self._queues: list[deque[tuple[int, Any]]] = [deque() for _ in self.splits]
        top = max(self.samples, default=0)
        self._catch_up = [(c, i) for i, c in enumerate(self.samples) if c < top]
        heapq.heapify(self._catch_up)
        self._top = top
        self._cycle_next = 0  # next split (local index) of the current cycle
        self.finished = not self.splits
        self.dropped = 0

    def feed(self, split: int, position: int, item: Any, failed: bool) -> None:
        """Row ``position`` of ``split`` arrived; ``failed`` rows are dropped."""
        i = self._local[split]
        self._unread[i] -= 1
        if failed:
            self.dropped += 1
        else:
            self._queues[i].append((position, item))

    def _has(self, i: int) -> bool | None:
        """True: split i has a surviving row queued; False: none will come; None: unknown."""
        if self._queues[i]:
            return True
        return False if self._unread[i] == 0 else None

    def _take(self, i: int) -> tuple[int, int, Any]:
        position, item = self._queues[i].popleft()
        self.samples[i] += 1
        self.positions[i] = position + 1
        return self.splits[i], position, item

    def ready(self) -> Iterator[tuple[int, int, Any]]:
        """``(split, position, item)`` of every sample determined by the rows fed so far."""
        while not self.finished:
            if self._catch_up:
                count, i = self._catch_up[0]
                has = self._has(i)
                if has is None:
                    return
                if not has:
                    self.finished = True
                    return
                heapq.heappop(self._catch_up)
                if count + 1 < self._top:
                    heapq.heappush(self._catch_up, (count + 1, i))
                yield self._take(i)
                continue
            if self._cycle_next == 0:  # a cycle runs only if every split has a row for it
                states = [self._has(i) for i in range(len(self.splits))]
                if False in states:
                    self.finished = True
                    return
                if None in states:
                    return
            i = self._cycle_next
            self._cycle_next = (i + 1) % len(self.splits)
            yield self._take(i)
