"""Read requests and results: which rows of a rank's remaining sequence one read covers, what
came back, what it cost, and how large successive reads grow (sized by bytes, bounded in rows)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

FIRST_READ_ROWS = 4096
# Byte sizes: Lance serves a take of wide rows fastest at a few tens of MB (much larger
# takes of 64 KB rows lose bytes/s), and 65,536 narrow rows (the row-count default) are
# ~18 MB. The benchmark's wide-row case (python -m jobs.bench) checks these.
FIRST_READ_BYTES = 4 << 20
READ_TARGET_BYTES = 16 << 20
# A Ray Data read task costs the trainer tens of ms of CPU (the executor's scheduling, the
# block's handover) whatever its size, so the Ray reader reads more per task, for more peak
# RSS; the local reader gains nothing from larger reads.
RAY_READ_TARGET_BYTES = 64 << 20
PREFETCH_BUDGET_BYTES = 128 << 20


@dataclass(frozen=True)
class ReadCost:
    """What reading some rows cost: Arrow bytes, read and transform seconds."""

    nbytes: int = 0
    fetch_s: float = 0.0
    transform_s: float = 0.0

    def __add__(self, other: ReadCost) -> ReadCost:
        return ReadCost(self.nbytes + other.nbytes, self.fetch_s + other.fetch_s,
                        self.transform_s + other.transform_s)


NO_COST = ReadCost()


@dataclass(frozen=True)
class ChunkRequest:
    """The rows of samples ``spans`` (``(lo, hi)`` ranges of a rank's remaining sequence,
    ascending), read with one take. Several spans when a DataLoader worker packs the
    batches it makes (every k-th one) into one read."""

    spans: tuple[tuple[int, int], ...]
    row_ids: np.ndarray
    splits: np.ndarray | None = None  # each row's split, for packed reads (read/documents)


@dataclass
class ChunkResult:
    """The rows of one request, in request order: a ``pyarrow.RecordBatch``, ``Columns``
    (tensors) or a list of transformed items."""

    seq: int
    payload: Any
    cost: ReadCost = NO_COST

    def __len__(self) -> int:
        return len(self.payload)



def span_results(spans: Sequence[tuple[int, int]], payload: Any, cost: ReadCost = NO_COST
                 ) -> list[ChunkResult]:
    """One result per span, cut from the rows read for all of them (in span order); the
    read's cost is booked with the first."""
    if len(spans) == 1:
        return [ChunkResult(spans[0][0], payload, cost)]
    out: list[ChunkResult] = []
    offset = 0
    for lo, hi in spans:
        out.append(ChunkResult(lo, payload[offset : offset + hi - lo], NO_COST if out else cost))
        offset += hi - lo
    return out



@dataclass(frozen=True)
class ReadSizing:
    """How many rows each read takes: a byte target from the rows' width, bounded in rows.

    ``row_bytes`` is the estimated Arrow size of one row of the columns read (None when it
    cannot be known, e.g. a remote table: reads are then sized by ``max_rows`` alone).
    ``budget_bytes`` bounds what a reader holds in flight: reads submitted or done but not
    yet handed to the consumer. Every process reading one stream must use the same sizing
    (DataLoader workers take every k-th read), so it is fixed when the view is built.
    """

    max_rows: int
    row_bytes: int | None = None
    target_bytes: int = READ_TARGET_BYTES
    budget_bytes: int = PREFETCH_BUDGET_BYTES
    budget_given: bool = False  # the user set budget_bytes (a cap on the Ray reader's memory)
    # The stream's share of its consumer's first batch: a mixture's source reads only its
    # share of what one table's first read would be.
    first_share: float = 1.0

    def _rows(self, nbytes: int, cap: int) -> int:
        if self.row_bytes is None:
            return cap
        return max(1, min(cap, nbytes // max(self.row_bytes, 1)))

    @property
    def steady_rows(self) -> int:
        """Rows of a full-size read."""
        return self._rows(self.target_bytes, self.max_rows)

    @property
    def batch_rows(self) -> int:
        """Most rows a read may grow to so that one batch is not split over two reads: an
        eighth over a full read, so a batch a little over the byte target (256 rows of
        64 KB plus their ids) is still one read."""
        return self.steady_rows + self.steady_rows // 8

    @property
    def first_rows(self) -> int:
        """Rows of the first read: small, so the first batch comes quickly."""
        return max(1, math.ceil(self._first_whole * self.first_share))

    @property
    def _first_whole(self) -> int:
        return self._rows(FIRST_READ_BYTES, min(self.steady_rows, FIRST_READ_ROWS))

    def nbytes(self, rows: int) -> int:
        """Estimated bytes of ``rows`` rows (0 when the width is unknown)."""
        return rows * (self.row_bytes or 0)

    def sizes(self) -> Iterator[int]:
        """Rows of successive reads: from ``first_rows`` doubling to ``steady_rows``. The
        first batch waits only for a small read; the steady state gets large reads, which
        Lance serves much faster per row (a take has a fixed cost, and denser row ids share
        pages) and Ray Data schedules with less overhead per row."""
        yield self.first_rows
        size, top = self._first_whole, self.steady_rows
        if size > self.first_rows:  # a stream's share of a first read: then a whole one
            yield size
        while True:
            size = min(2 * size, top)
            yield size


def read_sizes(chunk_rows: int) -> Iterator[int]:
    """Rows of successive reads sized by rows alone (width unknown): see ``ReadSizing``."""
    return ReadSizing(chunk_rows).sizes()
