"""Cutting a mixture's batches from its sources' reads: one buffer per source, and the
interleave that puts the rows of one batch in schedule order, tagged with their source.

A batch of ``B`` mixture steps takes ``n_i`` consecutive samples of source ``i`` (the
schedule's counts); the rows are joined per source (views of the reads where possible), then
gathered once into the schedule's order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..read.batching import Batch
from ..read.convert import Columns, Ragged, gather_rows
from ..read.items import as_items
from ..read.requests import NO_COST, ReadCost
from ..stream.mixing import Schedule

if TYPE_CHECKING:
    from .dataset import StreamingDataset

SOURCE_KEY = "source"
# A batch column up to this size is joined before its one scatter (the copy is cheaper
# than a call per part); a larger one is scattered part by part.
JOIN_BYTES = 1 << 20
# Narrow rows: consecutive batches of up to this many bytes are assembled at once (one
# scatter, then a view per batch), as a batch's fixed cost would outweigh its rows' copy.
RUN_BYTES = 2 << 20


@dataclass
class MixBatch:
    """Batch ``index`` of an iteration: the source of each of its steps, and per source the
    ``(pass, lo, hi)`` samples it takes of that pass's stream (offsets from where the
    iteration found the pass; a later pass from its start)."""

    index: int
    sources: np.ndarray
    segments: list[list[tuple[int, int, int]]]


def plan_batches(schedule: Schedule, step: int, end: int, batch_size: int,
                 left: Sequence[int], pass_len: Sequence[int], passes: Sequence[int]
                 ) -> Iterator[MixBatch]:
    """The batches of steps ``step .. end-1``; source ``i`` has ``left[i]`` samples left of
    its pass ``passes[i]``, and a fresh pass has ``pass_len[i]``."""
    left, passes = list(left), list(passes)
    offset = [0] * len(left)
    index = 0
    while step < end:
        sources = schedule.sources(step, min(step + batch_size, end))
        segments: list[list[tuple[int, int, int]]] = []
        for i, c in enumerate(np.bincount(sources, minlength=len(left)).tolist()):
            mine = []
            while c:
                if left[i] == 0:  # all_exhausted: the source's next pass
                    passes[i], left[i], offset[i] = passes[i] + 1, pass_len[i], 0
                take = min(c, left[i])
                mine.append((passes[i], offset[i], offset[i] + take))
                offset[i] += take
                left[i] -= take
                c -= take
            segments.append(mine)
        yield MixBatch(index, sources, segments)
        index += 1
        step += len(sources)


def cut(parts: deque[Any], n: int, out: list[Any]) -> int:
    """Move up to ``n`` samples from the front of ``parts`` to ``out`` (the first part
    whole, or a slice of it); how many were moved."""
    part = parts[0]
    if len(part) <= n:
        out.append(parts.popleft())
        return len(part)
    out.append(part[:n])
    parts[0] = part[n:]
    return n


def runs(batches: Iterator[MixBatch], rows: int) -> Iterator[list[MixBatch]]:
    """``batches`` in runs of consecutive batches to assemble at once: growing from one
    batch (the first batch waits for no more reads than its own) by doubling to at most
    ``rows`` samples (a larger batch alone), each source in one pass throughout, and no
    batch that moves a source to its next pass (that one alone)."""
    run: list[MixBatch] = []
    size, cap, passes = 0, 1, dict[int, int]()
    for mb in batches:
        mine = {i: segments[0][0] for i, segments in enumerate(mb.segments) if segments}
        alone = any(len(segments) > 1 for segments in mb.segments)
        if run and (alone or size + len(mb.sources) > cap
                    or any(passes.get(i, p) != p for i, p in mine.items())):
            yield run
            run, cap, size, passes = [], min(rows, 2 * max(cap, size)), 0, {}
        run.append(mb)
        size += len(mb.sources)
        passes.update(mine)
        if alone:
            yield run
            run, cap, size, passes = [], min(rows, 2 * max(cap, size)), 0, {}
    if run:
        yield run


def mixed_run(parts: Sequence[list[Any]], counts: Sequence[Sequence[int]],
              sources: Sequence[np.ndarray]) -> list[Any]:
    """The batches of a run: ``parts[i]`` holds source ``i``'s samples of the whole run,
    ``counts[i][k]`` of them batch ``k``'s, whose steps' sources are ``sources[k]``. Tensor
    columns are put in step order once for the run and each batch is a view of its rows;
    other columns are assembled batch by batch."""
    import torch

    steps = np.concatenate(sources)
    flat = [p for ps in parts for p in ps]
    out = scattered(parts, steps) if all(isinstance(p, Columns) for p in flat) else None
    if out is None:
        queues = [deque(ps) for ps in parts]
        batches = []
        for k, src in enumerate(sources):
            mine: list[list[Any]] = [[] for _ in parts]
            for i, q in enumerate(queues):
                n = counts[i][k]
                while n:
                    n -= cut(q, n, mine[i])
            batches.append(mixed_batch(mine, src, None))
        return batches
    out[SOURCE_KEY] = torch.from_numpy(steps.astype(np.int64))
    batches, at = [], 0
    for src in sources:
        batches.append({name: v[at : at + len(src)] for name, v in out.items()})
        at += len(src)
    return batches


class SourceBuffer:
    """The read-ahead batches of one source's pass, taken from in order."""

    def __init__(self, batches: Iterator[Batch], pass_no: int = 0):
        self.pass_no = pass_no
        self._batches = batches
        self._parts: deque[Any] = deque()
        self.cost: ReadCost = NO_COST  # of the reads that arrived since the last take
        self.wait_s = 0.0

    def take(self, n: int, clock: Callable[[], float]) -> list[Any]:
        """The next ``n`` samples, as slices of the reads' payloads."""
        out: list[Any] = []
        while n:
            if not self._parts:
                started = clock()
                batch = next(self._batches, None)
                self.wait_s += clock() - started
                if batch is None:
                    raise RuntimeError("a mixture source ran out of samples its schedule "
                                       "still counted on; this is a bug in lance_ray")
                self.cost = self.cost + batch.cost
                self._parts.append(batch.payload)
            n -= cut(self._parts, n, out)
        return out

    def prime(self) -> None:
        """Wait for the first read now (callable from another thread, before any take)."""
        if not self._parts:
            batch = next(self._batches, None)
            if batch is not None:
                self.cost = self.cost + batch.cost
                self._parts.append(batch.payload)

    def booked(self) -> tuple[ReadCost, float]:
        """The cost and wait since the last call (booked with the batch that took them)."""
        cost, wait = self.cost, self.wait_s
        self.cost, self.wait_s = NO_COST, 0.0
        return cost, wait

    def close(self) -> None:
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()


def interleave_order(sources: np.ndarray) -> np.ndarray:
    """For rows joined source by source (in source order), the row each step takes."""
    grouped = np.argsort(sources, kind="stable")
    order = np.empty_like(grouped)
    order[grouped] = np.arange(len(grouped))
    return order


def take_rows(cols: Columns, order: np.ndarray) -> dict[str, Any]:
    """Rows ``order`` of ``cols`` as a batch (``{column: tensor | ragged dict | list}``)."""
    import torch

    out: dict[str, Any] = {}
    index = torch.from_numpy(order)
    for name, v in cols.data.items():
        if isinstance(v, torch.Tensor):
            out[name] = v.index_select(0, index)
        elif isinstance(v, Ragged):
            offsets = v.offsets.numpy()
            starts, lengths = offsets[:-1][order], np.diff(offsets)[order]
            new = np.zeros(len(order) + 1, dtype=np.int64)
            np.cumsum(lengths, out=new[1:])
            values = gather_rows([v.values.numpy()], starts, lengths, new)
            out[name] = Ragged(torch.from_numpy(values), torch.from_numpy(new),
                               v.valid[index]).as_dict()
        else:
            out[name] = [v[i] for i in order.tolist()]
    return out


def tagged(item: Any, source: int) -> dict[str, Any]:
    """``item`` carrying its source's index; items must be dicts to carry it."""
    if not isinstance(item, dict):
        raise TypeError(
            f"a MixtureDataset item must be a dict to carry its 'source', got "
            f"{type(item).__name__}; make the transform return one dict per row")
    return {**item, SOURCE_KEY: source}


def mixed_items(parts: Sequence[list[Any]], sources: np.ndarray) -> list[dict[str, Any]]:
    """Items of every source in schedule order, each tagged with its source."""
    its = [iter([x for p in ps for x in as_items(p)]) for ps in parts]
    return [tagged(next(its[s]), s) for s in sources.tolist()]


def scattered(parts: Sequence[list[Columns]], sources: np.ndarray) -> dict[str, Any] | None:
    """The rows of each source's ``Columns`` parts written to their steps' places, when
    every column is a tensor of one dtype across the parts; else None. A large column is
    written part by part (one copy); a small one is joined first and written with one call,
    since there the calls, not the bytes, are the cost."""
    import torch

    flat = [p for ps in parts for p in ps]  # source by source, as the places are grouped
    for part in flat:
        if part.data.keys() != flat[0].data.keys():
            raise ValueError(f"the sources deliver different columns {sorted(flat[0].data)} "
                             f"and {sorted(part.data)}; pass columns=[...] every source has")
    # Every source's places at once: the steps grouped by source, in order within each.
    places = torch.from_numpy(np.argsort(sources, kind="stable"))
    out: dict[str, Any] = {}
    for name, v in flat[0].data.items():
        cols = [p.data[name] for p in flat]
        if not all(isinstance(c, torch.Tensor) and c.dtype == v.dtype for c in cols):
            return None
        out[name] = col = torch.empty((len(sources), *v.shape[1:]), dtype=v.dtype)
        if len(cols) > 1 and col.nbytes <= JOIN_BYTES:
            col.index_copy_(0, places, torch.cat(cols))
            continue
        at = 0
        for c in cols:
            col.index_copy_(0, places[at : at + len(c)], c)
            at += len(c)
    return out


def mixed_batch(parts: Sequence[list[Any]], sources: np.ndarray,
                collate_fn: Callable[[list[Any]], Any] | None) -> Any:
    """One mixture batch from each source's slices, rows in schedule order."""
    import torch

    present = [ps for ps in parts if ps]
    if present and all(isinstance(p, Columns) for ps in present for p in ps):
        out = scattered(parts, sources)
        if out is None:  # ragged or list columns: join, then gather once
            joined = [Columns.concat(ps) for ps in present]
            names = {tuple(c.data) for c in joined}
            if len(names) > 1:
                raise ValueError(f"the sources deliver different columns {sorted(names)}; "
                                 "pass columns=[...] that every source has")
            out = take_rows(Columns.concat(joined), interleave_order(sources))
        out[SOURCE_KEY] = torch.from_numpy(np.ascontiguousarray(sources, dtype=np.int64))
        return out
    items = mixed_items(parts, sources)
    if collate_fn is not None:
        return collate_fn(items)
    from torch.utils.data import default_collate

    return default_collate(items)


def check_same_columns(views: Sequence[StreamingDataset]) -> None:
    """Refuse sources that read different columns or one column at different Arrow types:
    a batch column holds the rows of every source, and promoting one type to the other
    (``int32`` to ``int64``, integers to floats) would silently change what the model
    sees. A transform's items are collated as it returns them."""
    if views[0]._reads.transform is not None:
        return
    read = []
    for v in views:
        schema = v._table.schema()
        read.append({n: schema.field(n).type for n in v._reads.columns or schema.names})
    for i, cols in enumerate(read[1:], 1):
        if cols.keys() != read[0].keys():
            raise ValueError(f"sources 0 and {i} have different columns {sorted(read[0])} "
                             f"and {sorted(cols)}; pass columns=[...] that every source has")
        for name, kind in cols.items():
            if kind != read[0][name]:
                raise ValueError(
                    f"column {name!r} is {read[0][name]} in source 0 but {kind} in source "
                    f"{i}; a batch column holds one type: cast it in the tables, or in a "
                    "transform")
