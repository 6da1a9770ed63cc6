"""The Ray Data reader: planned reads as an order-preserving Ray Data pipeline.

A custom ``Datasource`` turns each read request into one read task; the user's transform
runs as a ``map_batches`` stage in Ray tasks (its items travel as tensor columns where they
have that form, see ``items``); the streaming executor gives prefetch, and read tasks can
run on any node of the cluster. The output (an ordered stream of ``ChunkResult``) is the same
as ``local.LocalReader``'s.

Reads grow to the view's read size (``requests.ReadSizing``: a byte target, bounded in rows),
so each read task yields one block under the target, with its size in the block metadata.
A transformed pass starts with a small read in this process, which measures the
transform's cost and output per row: the consumer then transforms about a second's worth of
rows itself while the pipeline starts, and the rest are cut into tasks sized from the
cluster (``scale``: spread over the task slots, a bounded amount of work each, a few tasks'
output per slot in flight within the object store). How far the pipeline runs ahead of the
consumer is bounded by ``run_ahead`` (in place of Ray Data's resource reservation), and
blocks received are held within the same budget. (Capping the pipeline's object store
memory through Ray Data's resource limits was tried and made the first batch much slower.)
For the tensor batch path each read is converted to ``convert.Columns`` once, off the
consumer's thread; plain tensor reads arrive in Lance's row order with their stream
positions, and that one conversion copy gathers them into plan order. What runs in the
tasks themselves is in ``ray_tasks``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import sys
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from ..plan.table import TableRef
from .ahead import Held, Started, ahead
from .convert import to_columns
from .documents import DocumentReads
from .items import ItemColumns, from_arrow
from .local import LocalReader
from .malloc import keep_freed_buffers
from .ray_tasks import (
    COST_COLUMNS,
    INTERNAL_BYTES,
    INTERNAL_COLUMNS,
    SEQ_COLUMN,
    TransformStage,
    datasource_cls,
)
from .requests import (
    NO_COST,
    ChunkRequest,
    ChunkResult,
    ReadCost,
    ReadSizing,
    span_results,
)
from .run_ahead import RunAhead, bound_pipeline
from .scale import (
    RETRY_OPTIONS,
    Capacity,
    NodeWatch,
    TaskShape,
    capacity,
    consumer_outputs,
    nodes_short,
    rechunked,
    run_ahead_budget,
    split_rows,
    task_options,
    task_shape,
)
from .take import one_batch
from .transform import TransformPolicy

logger = logging.getLogger(__name__)

# The reads a pipeline's consumer makes itself while Ray Data starts (``local_head``): at
# most these bytes and, with a transform, about this much of the consumer's time (a warm
# pipeline can take seconds to its first block).
LOCAL_HEAD_BYTES = 32 << 20
LOCAL_HEAD_SECONDS = 1.0
# Rows of the first read of a transformed pass, made in this process to time the transform:
# few, since the consumer waits for them (a whole read of a slow transform was seconds of
# the consumer's time before any task ran).
TIMING_ROWS = 64


class RayDataReader:
    """Reads chunks through an order-preserving Ray Data streaming pipeline.

    With ``as_tensors`` (and no transform) each arriving block is converted to ``Columns``
    on a background thread, so the consumer only slices.
    """

    def __init__(self, table: TableRef, columns: list[str] | None,
                 transform: TransformPolicy | None, *, as_tensors: bool = False,
                 prefetch_batches: int = 2, ray_remote_args: dict[str, Any] | None = None,
                 transform_tasks: int | None = None, sizing: ReadSizing | None = None,
                 documents: DocumentReads | None = None):
        self.table, self.columns, self.transform = table, columns, transform
        self.documents = documents
        self.as_tensors = as_tensors
        self.sizing = sizing
        self.held = Held()  # blocks received, being converted or waiting for the consumer
        self.prefetch_batches = prefetch_batches
        self.ray_remote_args = dict(ray_remote_args or {})
        self.transform_tasks = transform_tasks
        self._shape: TaskShape | None = None  # a transformed pass's tasks (``_split``)
        self._bound: RunAhead | None = None  # the pipeline's run-ahead (``dataset``)

    def dataset(self, requests: list[ChunkRequest]) -> Any:
        """The lazy Ray ``Dataset`` that yields ``requests`` in order."""
        import ray.data

        source = datasource_cls()(self.table, self.columns, requests, self.sizing,
                                   self.documents, self._sorted_rows())
        named, retries = task_options(self.ray_remote_args)
        with warnings.catch_warnings():
            # Ray 2.60 names no parameter for a task's retries; its ray_remote_args
            # (deprecated for the options it names) still takes them.
            warnings.filterwarnings("ignore", "`ray_remote_args` is deprecated")
            ds = ray.data.read_datasource(source, override_num_blocks=max(1, len(requests)),
                                          ray_remote_args=dict(retries), **named)
            if self.transform is not None:
                from ray.data import TaskPoolStrategy

                # The same remote args as the reads: the stage fuses with them into one
                # task, placed where ray_remote_args say (e.g. on CPU-only nodes).
                ds = ds.map_batches(TransformStage(self.transform), batch_format="pyarrow",
                                    batch_size=None, zero_copy_batch=True,
                                    compute=TaskPoolStrategy(size=self.transform_tasks),
                                    **named, **retries)
        # Order is the product: never let Ray reorder blocks for throughput.
        ds.context.execution_options.preserve_order = True
        self._bound = self._run_ahead(requests)
        if self._bound is not None:
            bound_pipeline(ds.context, self._bound)
        return ds

    def _sorted_rows(self) -> int | None:
        """The most bytes of a block that a read task may ship in Lance's order (None: none
        may): only when the consumer converts rows to tensors (the reorder then costs
        nothing: the conversion's one copy gathers), for plain reads (a transform sees its
        rows in plan order), and only blocks small enough that Ray Data never slices them (a
        slice would scatter the positions). The task checks its block's real size: an
        estimate from the bytes on disk can be far off for values that compress well."""
        if not self.as_tensors or self.transform is not None or self.documents is not None:
            return None
        from ray.data import DataContext

        most = DataContext.get_current().target_max_block_size
        return sys.maxsize if most is None else int(most)

    def _run_ahead(self, requests: list[ChunkRequest]) -> RunAhead | None:
        """The pipeline's bound (``run_ahead``), by ``scale``'s one rule: a transformed
        pass's from its task shape; a plain pass's from its largest read. None when the
        rows' width is unknown (a remote table): Ray Data's own reservation then bounds
        it."""
        if self._shape is not None:
            return RunAhead(self._shape.budget, self._shape.task_bytes)
        sizing = self.sizing
        if sizing is None or sizing.row_bytes is None or not requests:
            return None
        task_bytes = max(sizing.nbytes(len(r.row_ids)) for r in requests)
        budget = run_ahead_budget(task_bytes, capacity(self.ray_remote_args),
                                  sizing.budget_bytes if sizing.budget_given else None,
                                  consumer_outputs(self.prefetch_batches))
        return RunAhead(budget, task_bytes)

    def _chunk(self, block: pa.Table) -> list[ChunkResult]:
        seq = block.column(SEQ_COLUMN).to_numpy()
        order = None  # rows shipped in Lance's order (``_sorted_rows``): gathered by position
        if len(seq) > 1 and not bool(np.all(seq[1:] > seq[:-1])):
            order = np.argsort(seq, kind="stable")
            seq = seq[order]
        cuts = np.flatnonzero(np.diff(seq) != 1) + 1
        spans = [(int(seq[a]), int(seq[b - 1]) + 1)
                 for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(seq)])]
        nbytes, fetch_s, transform_s = (block.column(c).to_numpy().sum() for c in COST_COLUMNS)
        started = time.perf_counter()
        payload: Any
        data = block.drop_columns(list(INTERNAL_COLUMNS))
        if self.as_tensors and self.transform is None:
            payload = to_columns(data, order)
        else:
            if order is not None:
                data = data.take(pa.array(order))
            payload = one_batch(data) if self.transform is None else from_arrow(data)
        convert_s = time.perf_counter() - started
        return span_results(spans, payload, ReadCost(int(nbytes), float(fetch_s),
                                                     float(transform_s) + convert_s))

    def iter_chunks(self, requests: Iterator[ChunkRequest]) -> Iterator[ChunkResult]:
        keep_freed_buffers()  # the consumer's copies out of the object store
        chunks = self._with_local_head(list(requests))
        _close_at_exit(chunks)
        return chunks

    def local_head(self, reqs: list[ChunkRequest]) -> int:
        """How many of the first requests are read in this process while the pipeline
        starts: Ray Data's first block can take seconds, a local read a fraction of one. At
        most ``LOCAL_HEAD_BYTES`` and half the requests (the rest always goes through Ray, the
        reader asked for); none when ``ray_remote_args`` say where the work must run, or
        when the rows' width is unknown (a remote table), which leaves the bytes unbounded.
        (A transformed pass's head is sized in rows by the transform's cost, ``_split``.)"""
        sizing = self.sizing
        placed = set(self.ray_remote_args) - set(RETRY_OPTIONS)
        if placed or sizing is None or sizing.row_bytes is None:
            return 0
        total, most = 0, len(reqs) // 2
        for k, request in enumerate(reqs[:most]):
            total += sizing.nbytes(len(request.row_ids))
            if total > LOCAL_HEAD_BYTES:
                return k
        return most

    def _with_local_head(self, reqs: list[ChunkRequest]) -> Iterator[ChunkResult]:
        _connect_on_this_thread()
        local = LocalReader(self.table, self.columns, self.transform,
                            as_tensors=self.as_tensors, prefetch=self.prefetch_batches,
                            transform_threads=self.transform_tasks, sizing=self.sizing,
                            documents=self.documents)
        first, head, tasks = self._split(local, reqs)
        rest = Started(self._iter_chunks(tasks))  # the pipeline starts now
        try:
            yield from first
            if head:
                yield from local.iter_chunks(iter(head))
            yield from rest
        finally:
            rest.close()

    def _split(self, local: LocalReader, reqs: list[ChunkRequest]
               ) -> tuple[list[ChunkResult], list[ChunkRequest], list[ChunkRequest]]:
        """How a pass is read: the results of a first read made to time the transform (none
        without one), the requests the local head reads, and the pipeline's tasks."""
        sizing = self.sizing
        if self.transform is None or self.documents is not None or sizing is None \
                or sizing.row_bytes is None:
            k = self.local_head(reqs)
            return [], reqs[:k], reqs[k:]
        first: list[ChunkResult] = []
        head: list[ChunkRequest] = []
        seconds_per_row: float | None = None
        out_per_row: int | None = None
        if self.local_head(reqs):
            # A transform's cost is known once it ran: a small first read, now, says how
            # many rows this process can transform while the pipeline starts, and how many
            # rows make one task's worth of work.
            timing, reqs = split_rows(reqs, TIMING_ROWS)
            first = list(local.iter_chunks(iter(timing)))
            cost = sum((r.cost for r in first), NO_COST)
            rows = sum(len(r.row_ids) for r in timing)
            # The transform's cost alone: a take's fixed cost is paid once per task.
            seconds_per_row = cost.transform_s / rows
            out = [r.payload.nbytes for r in first if isinstance(r.payload, ItemColumns)]
            # A task's block also carries each row's position and cost (INTERNAL_BYTES).
            out_per_row = sum(out) // rows + INTERNAL_BYTES if len(out) == len(first) else None
            per_row = (cost.fetch_s + cost.transform_s) / rows
            most = min(int(LOCAL_HEAD_SECONDS / max(per_row, 1e-9)),
                       LOCAL_HEAD_BYTES // max(sizing.row_bytes, out_per_row or 0, 1),
                       sum(len(r.row_ids) for r in reqs) // 2)
            head, reqs = split_rows(reqs, most)
        cap = capacity(self.ray_remote_args)
        if self.transform_tasks:
            cap = Capacity(min(cap.slots, self.transform_tasks), cap.store_bytes)
        shape = task_shape(sum(len(r.row_ids) for r in reqs), cap,
                           seconds_per_row=seconds_per_row, in_row_bytes=sizing.row_bytes,
                           out_row_bytes=out_per_row, read_bytes=sizing.target_bytes,
                           most_rows=max((len(r.row_ids) for r in reqs), default=1),
                           budget_cap=sizing.budget_bytes if sizing.budget_given else None,
                           consumer=consumer_outputs(self.prefetch_batches))
        if shape.short is not None:
            logger.warning("lance_ray: %s", shape.short)
        logger.info("lance_ray Ray reader: %d task slots, tasks of %d rows (%.3f s/row "
                    "measured), %d MiB of output in flight at most", cap.slots, shape.rows,
                    seconds_per_row or 0.0, shape.budget >> 20)
        self._shape = shape
        return first, head, rechunked(reqs, shape.rows)

    def _iter_chunks(self, reqs: list[ChunkRequest]) -> Iterator[ChunkResult]:
        if not reqs:
            return
        # The iterator itself (iter_batches returns an iterable, which has no close()).
        blocks = iter(self.dataset(reqs).iter_batches(batch_size=None, batch_format="pyarrow",
                                                      prefetch_batches=self.prefetch_batches))
        # Blocks received are held within the pipeline's own bound.
        budget = None if self.sizing is None else self.sizing.budget_bytes
        if self._bound is not None:
            budget = self._bound.budget
        # ``ahead`` pulls the blocks on its own thread, so each is handed over once
        # converted, not when more blocks have arrived.
        chunks = ahead(self._chunk, (b for b in blocks if b.num_rows), self.prefetch_batches,
                       cost=lambda b: b.nbytes, budget=budget, held=self.held)
        watch = NodeWatch(lambda: nodes_short(self.ray_remote_args))
        try:
            for results in chunks:
                watch.arrived()
                yield from results
                watch.arrived()  # the consumer's own time is no stall
        except Exception as e:
            _note_crashes(e, self.ray_remote_args)
            raise
        finally:
            watch.close()
            # First ``ahead``: its close waits for a next(blocks) in progress, so no other
            # thread is inside the generator when it is closed here.
            chunks.close()
            close = getattr(blocks, "close", None)
            if close is not None:
                close()  # Ray Data's prefetch threads stop now, while Ray is still up


def _note_crashes(e: Exception, remote_args: dict[str, Any]) -> None:
    """Say, on ``e``, what a read task whose worker died on every try means and what to do."""
    import ray

    if isinstance(e, ray.exceptions.WorkerCrashedError):
        retries = task_options(remote_args)[1]["max_retries"]
        e.add_note(f"lance_ray: a read task's worker process died on every try (the first "
                   f"and {retries} retries): a transform that crashes its process on some "
                   "row (native code, sys.exit, out of memory), or nodes lost. The batches "
                   "before it were delivered and state_dict() resumes after them; retry more "
                   "with ray_remote_args={'max_retries': N} (-1: without end)")


def _connect_on_this_thread() -> None:
    """Connect to Ray (starting a local cluster if none is found, as Ray's own first call
    would) on the consumer's thread, before the pipeline starts on a thread of ours.

    A local cluster's processes die with the *thread* that started them (Linux's
    parent-death signal, which Ray sets, follows the thread): left to Ray Data's automatic
    start inside the pipeline's start thread, the cluster was killed when that thread ended,
    and the epoch hung for 60 s and exited with code 1.
    """
    import ray

    if not ray.is_initialized():
        ray.init()


_open_pipelines: weakref.WeakSet[Iterator[ChunkResult]] = weakref.WeakSet()


def _close_at_exit(chunks: Iterator[ChunkResult]) -> None:
    """Close ``chunks`` at interpreter exit if it is still open then.

    Registered after ``ray`` is imported, so it runs before Ray's own exit handler: an
    iterator the user left open stops while Ray is up, instead of its prefetch threads
    waiting forever on a shut-down cluster (the interpreter joins them before it exits).
    """
    _register_exit_hook()
    _open_pipelines.add(chunks)


@functools.cache
def _register_exit_hook() -> None:
    atexit.register(_close_open_pipelines)


def _close_open_pipelines() -> None:
    for chunks in list(_open_pipelines):
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
