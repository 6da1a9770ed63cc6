"""A packed view's reads turned into batches of blocks, on its one take thread.

Each call of :func:`take_group` hands over several consecutive batches at once: a batch of
blocks is a few small copies, so handing each over on its own (a thread hand-off, a lock, a
wake-up) cost more than making it, and one group's blocks are copied in a few runs per
split. A group ends before a batch that needs another read, so batches already made never
wait behind a read.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..read.documents import split_runs
from ..read.requests import NO_COST, ChunkResult, ReadCost
from ..stream.order import RankStream
from ..stream.packed_order import Blocks, Last, RankPacker

# A group holds about this many blocks (with iter_batches(8): 8 batches per hand-off).
GROUP_BLOCKS = 64
Snapshot = list[Last]
Take = tuple[Blocks, Snapshot, ReadCost]


def feed_chunk(packer: RankPacker, rows: RankStream, chunk: ChunkResult) -> None:
    """Hand a read of ``rows`` (interleaved splits, arranged by split in the read task) to
    the packer, split by split."""
    splits, positions = rows.slice(chunk.seq, chunk.seq + len(chunk))
    order = np.argsort(splits, kind="stable")  # the read's own grouping (documents.arrange)
    splits, positions = splits[order], positions[order]
    local = {split: i for i, split in enumerate(packer.splits)}
    for run in split_runs(chunk.payload):
        if not np.all(splits[run.lo:run.hi] == run.split):
            raise RuntimeError(f"a packed read of rows {chunk.seq}.. came back grouped "
                               "differently from its request; refusing to pack it")
        packer.feed_joined(local[run.split], positions[run.lo:run.hi], run.stream, run.starts)


def group_size(batch_blocks: int) -> int:
    """Batches of ``batch_blocks`` blocks per group."""
    return max(1, GROUP_BLOCKS // max(batch_blocks, 1))


def take_group(packer: RankPacker, rows: RankStream, chunks: Iterator[ChunkResult],
               size: int, group: int) -> list[Take]:
    """Up to ``group`` next batches of ``size`` blocks, each with the state after it and
    the cost of the reads it needed; empty once the packer has no blocks left."""
    cost = NO_COST
    while len(packer):
        ready = 0  # batches that need no more reads
        while (ready < group and ready * size < len(packer)
               and packer.wants((ready + 1) * size) is None):
            ready += 1
        if ready:
            return [(blocks, snapshot, cost if b == 0 else NO_COST) for b, (blocks, snapshot)
                    in enumerate(packer.take_batches(size, ready))]
        chunk = next(chunks)
        feed_chunk(packer, rows, chunk)
        cost = cost + chunk.cost
    return []
