"""One rank's packed blocks in the reference's order (pure numpy, no I/O).

The reference emits one block per owned split per cycle, splits in ascending order, until
every split has emitted ``blocks_per_epoch / num_splits`` blocks. Block ``t`` of the rank's
sequence is therefore block ``t // n`` of its ``(t % n)``-th split, and the only thing that
couples the splits is that order: each split packs its own documents.

:class:`RankPacker` is fed each split's documents (in permutation order, from any read
order) and hands out the next blocks in rank order, with the exact state after them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from .packing import Cut, PackConfig, SplitPacker, SplitProgress, join_documents

NOT_ALIGNED = ("Packed checkpoint is not aligned across the splits owned by this iterator "
               "(their blocks_emitted_per_split differ); merge every rank's state with "
               "merge_state_dicts() and load the merged state before resuming")


Last: TypeAlias = "tuple[Cut, int] | SplitProgress"  # a split's last block delivered, or its state


def progress_of(last: Last) -> SplitProgress:
    """The split's exact state after ``last``."""
    if isinstance(last, SplitProgress):
        return last
    cut, j = last
    return cut.progress_after(j)


def counts_of(last: Last) -> tuple[int, int, int]:
    """The split's ``SplitProgress.counts()`` after ``last`` (without building its state)."""
    if isinstance(last, SplitProgress):
        return last.counts()
    cut, j = last
    return cut.counts_after(j)


def emitted_of(last: Last) -> int:
    """The split's blocks emitted after ``last`` (without building its state)."""
    if isinstance(last, SplitProgress):
        return last.emitted
    cut, j = last
    return cut.first_emitted + j


@dataclass
class _Queued:
    """A cut whose blocks from ``next`` on are not delivered yet."""

    cut: Cut
    next: int = 0
    end: int = field(init=False)  # len(cut), kept: it is read for every batch

    def __post_init__(self) -> None:
        self.end = len(self.cut)


@dataclass
class Blocks:
    """Consecutive blocks of one rank's sequence: ``[k, L]`` int64 arrays."""

    input_ids: np.ndarray
    doc_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


class RankPacker:
    """Packs ``splits`` (global ids, ascending) from their progress, in the reference's
    round-robin block order.

    Raises ``ValueError`` when the splits have emitted different block counts (a state
    taken mid-cycle, or one rank's state loaded on another topology without a merge).
    """

    def __init__(self, config: PackConfig, splits: Sequence[int],
                 progress: Sequence[SplitProgress], split_len: int):
        emitted = {p.emitted for p in progress}
        if len(emitted) > 1:
            raise ValueError(NOT_ALIGNED)
        self.config, self.splits, self.split_len = config, tuple(splits), split_len
        self.packers = [SplitPacker.resume(config, p) for p in progress]
        self.fed = [p.consumed for p in progress]  # next position to feed, per split
        for packer, position in zip(self.packers, self.fed):
            packer.exhausted = position >= split_len
        self.queues: list[deque[_Queued]] = [deque() for _ in self.splits]
        self.queued = [0] * len(self.splits)  # blocks in each split's queue
        self.last: list[Last] = list(progress)
        self.delivered = 0
        self.start_emitted = emitted.pop() if emitted else 0
        self.ignored_tokens = 0  # tokens of documents read after their split's budget

    def __len__(self) -> int:
        """Blocks left to deliver."""
        n = len(self.splits)
        return n * (self.config.blocks_per_split - self.start_emitted) - self.delivered

    @property
    def aligned(self) -> bool:
        """Every split has delivered as many blocks (a state may be taken now)."""
        return self.delivered % max(1, len(self.splits)) == 0

    def _counts(self, count: int) -> list[int]:
        """Blocks of each split among the next ``count`` of the rank's sequence."""
        n, t0 = len(self.splits), self.delivered
        if t0 % n == 0 and count % n == 0:  # whole cycles: the batch-size common case
            return [count // n] * n
        return [len(range(t0 + (i - t0) % n, t0 + count, n)) for i in range(n)]

    def wants(self, count: int) -> int | None:
        """The split (local index) that needs documents before the next ``count`` blocks
        can be taken, or None when they can; cuts blocks as they become ready."""
        for i, need in enumerate(self._counts(min(count, len(self)))):
            while self.queued[i] < need:
                packer = self.packers[i]
                if not packer.ready():
                    return i
                cut = packer.cut_ready(need - self.queued[i])
                self.queues[i].append(_Queued(cut))
                self.queued[i] += len(cut)
        return None

    def feed(self, i: int, positions: np.ndarray, values: np.ndarray,
             offsets: np.ndarray) -> None:
        """Split ``i``'s documents at permutation ``positions`` (consecutive from where its
        feeding stands)."""
        self.feed_joined(i, positions, *join_documents(values, offsets, self.config.eos_id))

    def feed_joined(self, i: int, positions: np.ndarray, tokens: np.ndarray,
                    starts: np.ndarray) -> None:
        """:meth:`feed` of documents already joined (``join_documents``'s output)."""
        if len(positions) == 0:
            return
        if positions[0] != self.fed[i] or positions[-1] != self.fed[i] + len(positions) - 1:
            raise RuntimeError(f"documents of split {self.splits[i]} arrived out of order "
                               f"(positions {positions[0]}.. after {self.fed[i]})")
        self.fed[i] += len(positions)
        packer = self.packers[i]
        if packer.budget_left == 0:
            self.ignored_tokens += len(tokens)
        else:
            packer.feed_joined(tokens, starts, last=self.fed[i] >= self.split_len)

    def take(self, count: int) -> Blocks:
        """The next ``count`` blocks (after ``wants(count)`` returned None)."""
        return self.take_batches(count, 1)[0][0]

    def take_batches(self, count: int, batches: int) -> list[tuple[Blocks, list[Last]]]:
        """The next ``batches`` batches of ``count`` blocks (the last may be short; after
        ``wants(count * batches)`` returned None), each with every split's last block after
        it (what ``last`` is after it). The batches are row slices of one array, so each
        split's blocks are copied in a few runs, not a few per batch."""
        total = min(count * batches, len(self))
        L, n, t0 = self.config.block_len, len(self.splits), self.delivered
        ids = np.empty((total, L), dtype=np.int64)
        docs = np.empty((total, L), dtype=np.int64)
        ends = [*range(count, total, count), total]
        after: list[list[Last]] = [[] for _ in ends]
        for i in range(n):
            first = (i - t0) % n  # the split's blocks are rows first, first + n, ...
            marks = [len(range(first, end, n)) for end in ends]  # its blocks by each end
            need, at, b = marks[-1], 0, 0
            mine_ids, mine_docs = ids[first::n], docs[first::n]  # views: one copy per token
            while b < len(marks) and marks[b] == 0:
                after[b].append(self.last[i])
                b += 1
            while at < need:
                q = self.queues[i][0]
                j = q.next
                use = min(need - at, q.end - j)
                mine_ids[at:at + use] = q.cut.input_ids[j:j + use]  # widens to int64
                np.cumsum(q.cut.doc_starts[j:j + use], axis=1, out=mine_docs[at:at + use])
                q.next, at = j + use, at + use
                while b < len(marks) and marks[b] <= at:
                    after[b].append((q.cut, q.next - (at - marks[b])))
                    b += 1
                self.last[i] = (q.cut, q.next)
                if q.next == q.end:
                    self.queues[i].popleft()
            self.queued[i] -= need
        self.delivered += total
        starts = [0, *ends[:-1]]
        return [(Blocks(ids[a:e], docs[a:e]), snapshot)
                for a, e, snapshot in zip(starts, ends, after)]

    def progress(self) -> list[SplitProgress]:
        """Each split's state after the blocks delivered so far."""
        return [progress_of(last) for last in self.last]

    def left_out(self) -> tuple[list[int], int]:
        """Once the budget is spent: splits (local indices) with documents never read, and
        the tokens known to be left out (held by packers or read after the budget)."""
        unread = [i for i, p in enumerate(self.packers) if self.fed[i] < self.split_len]
        held = sum(p.held for p in self.packers if p.budget_left == 0)
        return unread, held + self.ignored_tokens
