"""Cutting a rank's stream into batches, and reading only the batches a process needs.

With DataLoader workers, worker ``w`` of ``k`` produces batches ``w, w+k, w+2k, ...`` of
the rank's one sequence (torch's in-order loader hands them out in exactly that order), so
the batches a trainer sees do not depend on ``num_workers``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..plan.splits import SplitPlan
from ..stream.order import RankStream
from .convert import Columns, concat
from .items import ItemColumns, as_items
from .requests import NO_COST, ChunkRequest, ChunkResult, ReadCost, ReadSizing
from .transform import delivered


@dataclass
class Batch:
    """Samples ``start .. start+size-1`` of the stream; ``index`` counts batches from 0."""

    index: int
    start: int
    size: int
    payload: Any  # Columns (tensors), a pyarrow.RecordBatch, or items (ItemColumns or a list)
    cost: ReadCost = NO_COST  # of the reads that arrived while this batch was completed


def selected_batches(total: int, batch_size: int, worker: int = 0, num_workers: int = 1
                     ) -> list[tuple[int, int, int]]:
    """``(index, start, stop)`` of the batches worker ``worker`` of ``num_workers`` makes."""
    out = []
    for index, lo in enumerate(range(0, total, batch_size)):
        if index % num_workers == worker:
            out.append((index, lo, min(lo + batch_size, total)))
    return out


def requests_for(plan: SplitPlan, stream: RankStream, ranges: list[tuple[int, int]],
                 sizing: ReadSizing, *, with_splits: bool = False) -> Iterator[ChunkRequest]:
    """Read requests covering ``ranges`` of the stream, in order, each of ``sizing.sizes()``
    rows (the last may be short); a request packs several ranges when they are short.
    ``with_splits``: each request carries its rows' splits (packed reads group by them).

    A range of at most ``sizing.batch_rows`` rows (a batch, when ``ranges`` are batches) is
    never split over two reads. A read that holds nothing yet grows to hold it; a full-size
    read grows to hold it within ``batch_rows``; otherwise the read ends early and the next
    one holds it (so the small first reads stay small). So such a batch is a view of one
    read, never a copy joining two (on 64 KB rows, where a batch of 256 is a full read,
    every batch used to join two).

    Lazy, one request at a time: the row ids of a whole epoch are never materialised at once.
    """
    sizes = sizing.sizes()
    spans: list[tuple[int, int]] = []
    room = planned = next(sizes)
    used = 0  # rows in ``spans``
    for lo, hi in ranges:
        if room < hi - lo <= sizing.batch_rows:
            if used and (planned < sizing.steady_rows or used + hi - lo > sizing.batch_rows):
                yield _request(plan, stream, spans, with_splits)
                spans, room, used = [], (planned := next(sizes)), 0
            room = max(room, hi - lo)
        while lo < hi:
            take = min(hi - lo, room)
            if spans and spans[-1][1] == lo:  # adjacent: one span
                spans[-1] = (spans[-1][0], lo + take)
            else:
                spans.append((lo, lo + take))
            lo, room, used = lo + take, room - take, used + take
            if room == 0:
                yield _request(plan, stream, spans, with_splits)
                spans, room, used = [], (planned := next(sizes)), 0
    if spans:
        yield _request(plan, stream, spans, with_splits)


def _request(plan: SplitPlan, stream: RankStream, spans: list[tuple[int, int]],
             with_splits: bool) -> ChunkRequest:
    parts, groups = [], []
    for lo, hi in spans:
        splits, positions = stream.slice(lo, hi)
        parts.append(plan.rows_at(splits, positions))
        groups.append(splits)
    return ChunkRequest(tuple(spans), np.concatenate(parts) if len(parts) > 1 else parts[0],
                        np.concatenate(groups).astype(np.int32) if with_splits else None)


def assemble(chunks: Iterator[ChunkResult], batches: list[tuple[int, int, int]]
             ) -> Iterator[Batch]:
    """Cut the ordered chunks into ``batches``; refuse any chunk that arrives out of order.

    The chunks must cover exactly the samples of ``batches``, in order.
    """
    pending = iter(batches)
    current = next(pending, None)
    parts: list[Any] = []
    filled = 0
    cost = NO_COST
    for chunk in chunks:
        due = None if current is None else current[1] + filled
        if chunk.seq != due:
            raise RuntimeError(
                f"reader delivered samples from {chunk.seq} where {due} was due; "
                "refusing to change the planned order"
            )
        payload = chunk.payload
        cost = cost + chunk.cost
        offset, n = 0, len(chunk)
        while offset < n:
            if current is None:
                raise RuntimeError("reader delivered more samples than were requested")
            index, lo, hi = current
            take = min(hi - lo - filled, n - offset)
            parts.append(payload[offset : offset + take])
            filled += take
            offset += take
            if filled == hi - lo:
                yield Batch(index, lo, hi - lo, _join(parts), cost)
                parts, filled, cost = [], 0, NO_COST
                current = next(pending, None)
                if offset < n and (current is None or current[1] != hi):
                    raise RuntimeError("a read chunk spans samples that were not requested")
    if current is not None:
        raise RuntimeError(f"reader stopped before batch {current[0]} was complete")


def _join(parts: list[Any]) -> Any:
    if all(isinstance(p, ItemColumns) for p in parts):
        joined = ItemColumns.concat(parts)
        if joined is not None:
            return joined
    if isinstance(parts[0], (list, ItemColumns)):  # items, some reads' perhaps as columns
        return [x for p in parts for x in as_items(p)]
    if isinstance(parts[0], Columns):
        return Columns.concat(parts)
    return concat(parts)


def collate(payload: Any, collate_fn: Callable[[list[Any]], Any] | None
            ) -> tuple[Any, int]:
    """One assembled batch as the trainer receives it, and how many samples were skipped.

    Arrow payloads only come with a ``collate_fn``: without one the reader already made
    ``Columns`` (tensors).
    """
    if isinstance(payload, list):
        kept, skipped = delivered(payload)
        if not kept:
            return [], skipped
        if collate_fn is None:
            from torch.utils.data import default_collate

            return default_collate(kept), skipped
        return collate_fn(kept), skipped
    if isinstance(payload, ItemColumns):  # no failed rows: nothing skipped
        return (payload.collated() if collate_fn is None else collate_fn(payload.items())), 0
    if isinstance(payload, Columns):
        return payload.batch(), 0
    assert collate_fn is not None, "Arrow payloads are read only for a collate_fn"
    return collate_fn(payload.to_pylist()), 0
