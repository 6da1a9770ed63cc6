"""Read requests and results: which rows of a rank's remaining sequence one read covers, what
came back, what it cost, and how large successive reads grow."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

FIRST_READ_ROWS = 4096


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



def read_sizes(chunk_rows: int) -> Iterator[int]:
    """Rows of successive reads: from ``FIRST_READ_ROWS`` doubling to ``chunk_rows``. The
    first batch waits only for a small read; the steady state gets large reads, which Lance
    serves much faster per row (a take has a fixed cost, and denser row ids share pages)
    and Ray Data schedules with less overhead per row."""
    size = min(chunk_rows, FIRST_READ_ROWS)
    while True:
        yield size
        size = min(2 * size, chunk_rows)
