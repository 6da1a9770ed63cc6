"""Packed mode's reads: token documents grouped by split and joined with ``eos_id``, in the
read task.

Packing a split is sequential (a block may continue the previous read's last document), so
the blocks are cut in the consuming process; but every per-token step before the cut runs
where the read runs (a Ray Data task, or a local reader thread): putting the rows of a read
in split order and inserting one ``eos_id`` after each document. The consumer receives one
contiguous token run per split and only slices it. The tokens stay in the column's integer
type when ``eos_id`` fits in it (half the bytes through the object store for int32 ids):
the packer's one copy of them widens them to int64.

A read arranged here is an Arrow batch of one row per document: ``SPLIT_COLUMN`` (the
document's split) and ``TOKENS_COLUMN`` (its tokens and its ``eos_id``), the rows of
each split together, in the read's order within a split.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ..stream.packing import documents, join_documents, join_runs
from .convert import chunks_of
from .requests import ChunkRequest

SPLIT_COLUMN = "__lance_ray_split"
# Documents this long (mean tokens) or longer are copied one slice each, faster than Arrow's
# take of a list column for long documents; shorter ones go through the take, whose per-row
# cost is far below a Python loop's.
RUN_COPY_MIN_TOKENS = 32
TOKENS_COLUMN = "tokens"


@dataclass(frozen=True)
class SplitRun:
    """One split's documents of a read, joined: ``stream`` (an ``eos_id`` after each
    document) and each document's start in it; rows ``lo:hi`` of the split-ordered read."""

    split: int
    lo: int
    hi: int
    stream: np.ndarray
    starts: np.ndarray


@dataclass(frozen=True)
class DocumentReads:
    """How a packed view's reads are arranged (see the module docstring)."""

    eos_id: int

    def arrange(self, batch: pa.RecordBatch | pa.Table, inverse: np.ndarray | None,
                request: ChunkRequest) -> pa.RecordBatch:
        """The read ``batch`` of ``request`` (rows in address order; ``inverse`` puts them
        in request order, None when they are), as one row per document grouped by split."""
        splits = request.splits
        if splits is None or len(request.spans) != 1:
            # Rows regrouped by split no longer line up with several spans.
            raise ValueError("a packed read needs one span and its rows' splits "
                             "(requests_for(..., with_splits=True) over one range)")
        order = np.argsort(splits, kind="stable")
        rows = order if inverse is None else inverse[order]
        column = batch.column(0)
        # One read comes in chunks (one per fragment); long documents are copied straight
        # from theirs.
        chunks = [documents(c, widen=False) for c in chunks_of(column)]
        if sum(len(v) for v, _ in chunks) >= RUN_COPY_MIN_TOKENS * max(len(rows), 1):
            stream, starts = join_runs(chunks, rows, self.eos_id)
        else:
            if not np.array_equal(rows, np.arange(len(rows))):
                column = column.take(pa.array(rows))
            stream, starts = join_documents(*documents(column), self.eos_id)
        tokens = pa.LargeListArray.from_arrays(pa.array(np.append(starts, len(stream))),
                                               pa.array(stream))
        grouped = splits[order].astype(np.int32, copy=False)
        return pa.RecordBatch.from_arrays([pa.array(grouped), tokens],
                                          [SPLIT_COLUMN, TOKENS_COLUMN])


def split_runs(payload: pa.RecordBatch) -> Iterator[SplitRun]:
    """The runs of an arranged read, one per split, zero-copy views of its tokens."""
    splits = payload.column(SPLIT_COLUMN).to_numpy()
    tokens = payload.column(TOKENS_COLUMN)
    offsets = tokens.offsets.to_numpy()
    values = tokens.values.to_numpy()
    cuts = [0, *(np.flatnonzero(np.diff(splits)) + 1).tolist(), len(splits)]
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if hi > lo:
            first = offsets[lo]
            yield SplitRun(int(splits[lo]), lo, hi, values[first:offsets[hi]],
                           offsets[lo:hi] - first)
