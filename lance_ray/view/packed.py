"""Packed mode (``pack_sequences``): the iteration object of a view that yields blocks.

The view reads its splits' remaining documents through the ordinary read path (the local or
the Ray Data reader, or StreamingDataLoader's workers; every unread row of the rank's splits
in round-robin order), and a :class:`~lance_ray.stream.packed_order.RankPacker` on one
background thread turns them into the reference's blocks (numpy over Arrow list offsets),
handed over in groups of batches (``packed_takes``). Each batch carries a snapshot of where
every split stands after it, which the consumer adopts when it receives that batch, so
``state_dict()`` counts exactly the blocks handed over, in the reference's packed format.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..plan.pack_args import PackOptions
from ..read.ahead import ahead
from ..read.documents import DocumentReads
from ..read.tokens import auto_budget, say_auto_budget, split_token_totals
from ..state import format as st
from ..state.ledger import RankReport
from ..state.packed import (
    PackConfig,
    SplitProgress,
    check_packing_matches,
    is_packed,
    make_packed_state,
    parse_packed_state,
)
from ..stream.order import RankStream
from ..stream.packed_order import (
    NOT_ALIGNED,
    Blocks,
    RankPacker,
    counts_of,
    emitted_of,
    progress_of,
)
from ..stream.packing import cu_seqlens_of, position_ids_of
from .compat import worker_share
from .core import ViewCore
from .iteration import Lease, timed
from .packed_takes import Snapshot, Take, group_size, take_group

if TYPE_CHECKING:
    from ..read.requests import ChunkResult, ReadCost

logger = logging.getLogger("lance_ray.dataset")
# Where a packed pass's reads come from when not from the view's own reader: the documents
# of ``rows`` read in order, arranged by ``DocumentReads`` (StreamingDataLoader's workers).
PackedReads = Callable[[RankStream, DocumentReads], Iterator["ChunkResult"]]


def as_tensors(blocks: Blocks, options: PackOptions) -> dict[str, Any]:
    """The batch form: ``[k, L]`` LongTensors, and (opt-in) ``position_ids`` and the
    flattened batch's ``cu_seqlens`` (int32) with its ``max_seqlen``."""
    out: dict[str, Any] = {"input_ids": torch.from_numpy(blocks.input_ids),
                           "doc_ids": torch.from_numpy(blocks.doc_ids)}
    if options.position_ids:
        out["position_ids"] = torch.from_numpy(position_ids_of(blocks.doc_ids))
    if options.cu_seqlens:
        cu = cu_seqlens_of(blocks.doc_ids)
        out["cu_seqlens"] = torch.from_numpy(cu)
        out["max_seqlen"] = int(np.diff(cu).max()) if len(cu) > 1 else 0
    return out


class PackedMode:
    """Packed mode: every split's packing progress (``SplitProgress``: rows consumed,
    blocks emitted, the buffered carry), the epoch's block budget, and the iterators and
    states made from them. The view's cursor keeps only the generation and the step."""

    packed = True

    def __init__(self, view: ViewCore, options: PackOptions):
        self.view, self.options = view, options

    def reset(self) -> None:
        """Start the current plan's epoch from its first block (resolving ``"auto"``)."""
        view, o = self.view, self.options
        spec = view._spec
        s = spec.num_splits
        self._totals: np.ndarray | None = None  # exact tokens of the owned splits
        budget = o.blocks_per_epoch
        if budget == "auto" and (decided := view._plans.pack_budget(spec.epoch)):
            budget = decided  # the coordinator counted the epoch's tokens once for all views
        if budget == "auto":
            started = time.monotonic()
            plan = view._plans.part(spec, range(s))
            totals = split_token_totals(view._table, plan, range(s), o.column,
                                        spec.filter, remote=self._remote_counts())
            budget = auto_budget(int(totals.sum()), o.block_len, s)
            self._totals = totals[view._owned]
            say_auto_budget(budget, o.block_len, int(totals.sum()), plan.split_len * s,
                            spec, time.monotonic() - started)
        assert isinstance(budget, int)
        self._budget = budget
        self._config = PackConfig(o.block_len, o.eos_id, o.pad_id, budget // s)
        self._base = [SplitProgress() for _ in range(s)]
        self._live: tuple[tuple[int, ...], Snapshot] | None = None
        self._ended = False

    def _remote_counts(self) -> bool:
        from ..plan.sources import ray_is_up

        return self.view._reads.kind == "ray" and ray_is_up()

    # ------------------------------------------------------------------ progress and state
    def _progress(self) -> list[SplitProgress]:
        out = list(self._base)
        if self._live is not None:
            splits, snapshot = self._live
            for split, last in zip(splits, snapshot):
                out[split] = progress_of(last)
        return out

    def emitted(self) -> list[int]:
        """Blocks each split has emitted (handed over) in this epoch."""
        out = [p.emitted for p in self._base]
        if self._live is not None:
            for split, last in zip(*self._live):
                out[split] = emitted_of(last)
        return out

    def __len__(self) -> int:
        return len(self.view._owned) * self._config.blocks_per_split

    @property
    def remaining(self) -> int:
        emitted = self.emitted()
        return len(self) - sum(emitted[s] for s in self.view._owned)

    @property
    def rolls_over(self) -> bool:
        return self._ended

    def state_dict(self) -> dict[str, Any]:
        """The view's state in the reference's packed format."""
        view = self.view
        if self._live is not None and len(self._live[0]) != len(view._owned):
            raise RuntimeError("this view packs one DataLoader worker's share of its rank's "
                               "splits; its progress does not determine the other workers'")
        emitted = self.emitted()
        if len({emitted[s] for s in view._owned}) > 1:
            raise RuntimeError(
                "Packed StreamingDataset checkpointing is only safe at a complete logical "
                "step boundary, when every split assigned to this rank has emitted the same "
                f"block count. Consume more batches before calling state_dict() (use a batch "
                f"size that is a multiple of this rank's {len(view._owned)} splits)")
        ws = view._world_size
        return make_packed_state(view._identity, self._config, self._budget,
                                 self._progress(), world_size=ws,
                                 rank=None if ws == 1 else view._rank,
                                 global_step=view._cursor.batches)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        view = self.view
        if not is_packed(state):
            raise ValueError(f"pack_sequences mismatch: checkpoint has None, dataset has "
                             f"{self._config.block_len}; this state was taken without "
                             "pack_sequences (it has no pack_buffers): load it into a "
                             "dataset constructed without pack_sequences")
        parsed = parse_packed_state(state, view._plan.split_len)
        st.check_compatible(state, view._identity)
        check_packing_matches(state, self._config, self._budget)
        st.check_loadable_on(parsed.owner, view._topology)
        if len({parsed.splits[k].emitted for k in view._owned}) > 1:
            raise ValueError(NOT_ALIGNED)
        zeros = [0] * view._spec.num_splits
        view._new_cursor(zeros, zeros, batches=parsed.owner.global_step or 0, origin=True)
        self._base = list(parsed.splits)
        self._live = None
        self._ended = False

    # ------------------------------------------------------------------ reading
    def items(self, lease: Lease) -> Iterator[Any]:
        """``__iter__``: one block at a time, each committed as it is handed over."""
        for blocks in self._run(lease[0], 1, batches=0):
            yield self._item(blocks, 0)

    def batches(self, lease: Lease, batch_size: int,
                collate_fn: Callable[[list[Any]], Any] | None,
                reads: PackedReads | None = None) -> Iterator[Any]:
        """``iter_batches``: ``batch_size`` blocks at a time (the last may be short); the
        reads come from ``reads`` (DataLoader workers) instead of the view's reader."""
        owned = len(self.view._owned)
        if self.view._plans.wants_reports and batch_size % owned:
            # The coordinator seals every global step: each must leave the splits at one
            # block count, or its states load on no other world size.
            raise ValueError(
                f"a packed view attached to a coordinator takes batches of a multiple of its "
                f"{owned} splits (a global batch that is a multiple of num_splits), got "
                f"{batch_size}")
        options = self.options
        for blocks in self._run(lease[0], batch_size, batches=1, reads=reads):
            if collate_fn is None:
                yield as_tensors(blocks, options)
            else:
                yield collate_fn([self._item(blocks, j) for j in range(len(blocks))])

    def _item(self, blocks: Blocks, j: int) -> dict[str, Any]:
        """Block ``j`` of ``blocks`` as ``__iter__`` yields it (and a ``collate_fn`` receives
        it): ``[L]`` tensors, without the batch dimension."""
        out = as_tensors(Blocks(blocks.input_ids[j:j + 1], blocks.doc_ids[j:j + 1]),
                         self.options)
        return {k: v[0] if k not in ("cu_seqlens", "max_seqlen") else v
                for k, v in out.items()}

    def read_share(self, rows: RankStream, worker: int, num_workers: int,
                   documents: DocumentReads) -> Iterator[ChunkResult]:
        """A DataLoader worker's reads of a pass's ``rows`` (``worker, worker +
        num_workers, ...``), its documents arranged by ``documents``."""
        view = self.view
        return view._reads.read_rows(view._plan, rows, worker, num_workers,
                                     documents=documents)

    def received(self, rows: int) -> None:
        """Count ``rows`` of the workers' reads arriving in the consuming process."""
        self.view._gauge.received += rows

    def _begin(self, lease: weakref.ref[Iterator[Any]] | None) -> tuple[RankPacker, int]:
        view = self.view
        view._refuse_concurrent(lease)
        spec = view._spec
        if self.rolls_over:
            logger.info("epoch %d is exhausted on rank %d; starting epoch %d",
                        spec.epoch, view._rank, spec.epoch + 1)
            view.set_epoch(spec.epoch + 1)
        elif self.remaining == 0:
            logger.info("rank %d has no blocks left in epoch %d; call set_epoch(%d) to start "
                        "the next one", view._rank, spec.epoch, spec.epoch + 1)
        progress = self._progress()
        self._base, self._live = progress, None
        splits = worker_share(view._owned, view._claim(lease))
        packer = RankPacker(self._config, splits, [progress[s] for s in splits],
                            view._plan.split_len)
        return packer, view._cursor.generation

    def _run(self, lease: weakref.ref[Iterator[Any]] | None, count: int, *,
             batches: int, reads: PackedReads | None = None) -> Iterator[Blocks]:
        view = self.view
        packer, generation = self._begin(lease)
        splits = packer.splits
        consumed = [p.consumed for p in self._base]
        rows = RankStream(splits, tuple(consumed[s] for s in splits),
                          tuple(consumed[s] for s in splits), view._plan.split_len)
        gauge = view._gauge
        gauge.start(len(rows))
        documents = DocumentReads(self._config.eos_id)
        if reads is None:
            chunks = view._reads.read_rows(view._plan, rows, documents=documents)
        else:  # other processes hold the whole stream (``reads`` counts what arrives)
            gauge.requested = gauge.total
            chunks = reads(rows, documents)

        group = group_size(count)

        def step(size: int) -> list[Take]:
            return take_group(packer, rows, chunks, size, group)

        # At most one group per batch left; the first empty group ends the epoch.
        takes = ahead(step, itertools.repeat(count, -(-len(packer) // count)),
                      max(1, -(-view._reads.prefetch // group)))
        try:
            for made, wait_s in timed(takes):
                if not made:
                    break
                for blocks, snapshot, cost in made:
                    view._on_handover(partial(self._commit, generation, splits,
                                              snapshot, len(blocks), cost, wait_s, batches))
                    wait_s = 0.0
                    yield blocks
            view._on_handover(partial(self._end, generation, packer))
        finally:
            # Stop the takes (waiting for one in progress: then no thread reads ``chunks``),
            # then the reads (a Ray Data pipeline) the budget no longer needs.
            for it in (takes, chunks):
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            if generation == view._cursor.generation:
                gauge.stop()

    def _commit(self, generation: int, splits: tuple[int, ...], snapshot: Snapshot,
                blocks: int, cost: ReadCost, wait_s: float, batches: int) -> None:
        """Commit one handed-over batch of ``blocks`` (the packers' ``snapshot`` after it)."""
        view = self.view
        view._check_generation(generation)
        self._live = (splits, snapshot)
        view._cursor.commit(0, batches)
        if batches and view._plans.wants_reports:
            self._report()
        view._gauge.taken = view._gauge.received
        # consumed_rows counts documents the packer took, as the reference's does
        view._gauge.delivered = sum(counts_of(last)[0] for last in snapshot) - sum(
            self._base[s].consumed for s in splits)
        view._meter.record(blocks, cost, 0, wait_s, batches=batches, where=view._where)

    def _end(self, generation: int, packer: RankPacker) -> None:
        if generation == self.view._cursor.generation:
            self._ended = True
            self._report_left_out(packer)

    def _report(self) -> None:
        """Send the coordinator this rank's packed progress after the step just committed."""
        view = self.view
        if self._live is not None and len(self._live[0]) != len(view._owned):
            raise RuntimeError("a coordinator's packed view reports its whole rank's splits; "
                               "read it with iter_batches or StreamingDataLoader, not with "
                               "the workers of a plain DataLoader")
        # Counted without copying the buffers: this runs at every batch.
        live = dict(zip(*self._live)) if self._live is not None else {}
        consumed, emitted, buffered = zip(*(
            counts_of(live[s]) if s in live else self._base[s].counts()
            for s in view._owned))
        view._plans.report(RankReport(view._rank, view._world_size, view._spec.epoch,
                                      view._cursor.batches, consumed, consumed, emitted,
                                      buffered),
                           final=all(e == self._config.blocks_per_split for e in emitted))

    def _report_left_out(self, packer: RankPacker) -> None:
        """Count (in ``stats.tokens_left_out``) and log, once per epoch, the tokens of this
        rank's splits that the budget leaves out."""
        view = self.view
        unread, held = packer.left_out()
        if unread:  # documents never read: their tokens come from an exact count
            totals = self._owned_totals(packer.splits)
            cap = self._config.blocks_per_split * self._config.block_len
            left = int(np.maximum(totals - cap, 0).sum())
        else:
            left = held
        view._meter.stats.tokens_left_out += left
        if left:
            logger.warning("epoch %d: the budget of %d blocks per split left out %d tokens of "
                           "rank %d's splits (raise blocks_per_epoch, or use 'auto')",
                           view._spec.epoch, self._config.blocks_per_split, left, view._rank)

    def _owned_totals(self, splits: Sequence[int]) -> np.ndarray:
        view = self.view
        if self._totals is None or len(splits) != len(view._owned):
            return split_token_totals(view._table, view._plan, splits, self.options.column,
                                      view._spec.filter, remote=self._remote_counts())
        return self._totals
