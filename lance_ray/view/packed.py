"""Sequence packing in a view (``pack_sequences``): arguments, iteration, state.

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
from .iteration import timed
from .packed_takes import Snapshot, Take, group_size, take_group

if TYPE_CHECKING:
    from ..plan.sources import PlanSource
    from ..plan.splits import PlanSpec, SplitPlan
    from ..plan.table import TableRef
    from ..read.requests import ChunkResult, ReadCost
    from ..stream.cursor import Cursor
    from ..topology import Topology
    from .stats import Gauge, Meter

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


class PackedView:
    """Packed-mode reading and state, for :class:`~lance_ray.view.dataset.StreamingDataset`."""

    _packing: PackOptions | None = None
    _table: TableRef
    _plan: SplitPlan
    _plans: PlanSource
    _spec: PlanSpec
    _identity: st.PlanIdentity
    _owned: list[int]
    _rank: int
    _world_size: int
    _topology: Topology
    _reader_kind: str
    _prefetch_batches: int
    _cursor: Cursor
    _meter: Meter
    _gauge: Gauge
    _untracked: Any

    # Provided by StreamingDataset and Reading.
    _refuse_concurrent: Callable[[Any], None]
    _claim: Callable[[Any], Any]
    _check_generation: Callable[..., None]
    _where: Callable[[], str]
    _read_rows: Callable[..., Iterator[ChunkResult]]
    _new_cursor: Callable[..., None]
    set_epoch: Callable[[int], None]
    _on_handover: Callable[[Callable[[], None]], None]

    def _reset_packing(self) -> None:
        """Start the current plan's epoch from its first block (resolving ``"auto"``)."""
        o = self._packing
        if o is None:
            return
        s = self._spec.num_splits
        self._pack_totals: np.ndarray | None = None  # exact tokens of the owned splits
        budget = o.blocks_per_epoch
        if budget == "auto" and (decided := self._plans.pack_budget(self._spec.epoch)):
            budget = decided  # the coordinator counted the epoch's tokens once for all views
        if budget == "auto":
            started = time.monotonic()
            plan = self._plans.part(self._spec, range(s))
            totals = split_token_totals(self._table, plan, range(s), o.column,
                                        self._spec.filter, remote=self._remote_counts())
            budget = auto_budget(int(totals.sum()), o.block_len, s)
            self._pack_totals = totals[self._owned]
            say_auto_budget(budget, o.block_len, int(totals.sum()), plan.split_len * s,
                            self._spec, time.monotonic() - started)
        assert isinstance(budget, int)
        self._pack_budget = budget
        self._pack_config = PackConfig(o.block_len, o.eos_id, o.pad_id, budget // s)
        self._pack_base = [SplitProgress() for _ in range(s)]
        self._pack_live: tuple[tuple[int, ...], Snapshot] | None = None
        self._pack_ended = False

    def _remote_counts(self) -> bool:
        from ..plan.sources import ray_is_up

        return self._reader_kind == "ray" and ray_is_up()

    # ------------------------------------------------------------------ progress and state
    def _pack_progress(self) -> list[SplitProgress]:
        out = list(self._pack_base)
        if self._pack_live is not None:
            splits, snapshot = self._pack_live
            for split, last in zip(splits, snapshot):
                out[split] = progress_of(last)
        return out

    def _pack_emitted(self) -> list[int]:
        out = [p.emitted for p in self._pack_base]
        if self._pack_live is not None:
            for split, last in zip(*self._pack_live):
                out[split] = emitted_of(last)
        return out

    def _packed_len(self) -> int:
        return len(self._owned) * self._pack_config.blocks_per_split

    def _packed_remaining(self) -> int:
        emitted = self._pack_emitted()
        return self._packed_len() - sum(emitted[s] for s in self._owned)

    def _packed_state_dict(self) -> dict[str, Any]:
        if self._pack_live is not None and len(self._pack_live[0]) != len(self._owned):
            raise RuntimeError("this view packs one DataLoader worker's share of its rank's "
                               "splits; its progress does not determine the other workers'")
        emitted = self._pack_emitted()
        if len({emitted[s] for s in self._owned}) > 1:
            raise RuntimeError(
                "Packed StreamingDataset checkpointing is only safe at a complete logical "
                "step boundary, when every split assigned to this rank has emitted the same "
                f"block count. Consume more batches before calling state_dict() (use a batch "
                f"size that is a multiple of this rank's {len(self._owned)} splits)")
        ws = self._world_size
        return make_packed_state(self._identity, self._pack_config, self._pack_budget,
                                 self._pack_progress(), world_size=ws,
                                 rank=None if ws == 1 else self._rank,
                                 global_step=self._cursor.batches)

    def _packed_load_state_dict(self, state: dict[str, Any]) -> None:
        if not is_packed(state):
            raise ValueError("this state was taken without pack_sequences (it has no "
                             "pack_buffers) but this dataset packs sequences; load it into a "
                             "dataset constructed without pack_sequences")
        parsed = parse_packed_state(state, self._plan.split_len)
        st.check_compatible(state, self._identity)
        check_packing_matches(state, self._pack_config, self._pack_budget)
        st.check_loadable_on(parsed.owner, self._topology)
        if len({parsed.splits[k].emitted for k in self._owned}) > 1:
            raise ValueError(NOT_ALIGNED)
        zeros = [0] * self._spec.num_splits
        self._new_cursor(zeros, zeros, batches=parsed.owner.global_step or 0, origin=True)
        self._pack_base = list(parsed.splits)
        self._pack_live = None
        self._pack_ended = False

    # ------------------------------------------------------------------ reading
    def _packed_items(self, lease: list[weakref.ref[Iterator[Any]]]) -> Iterator[Any]:
        """``__iter__``: one block at a time, each committed as it is handed over."""
        for blocks in self._packed_run(lease[0], 1, batches=0):
            out = as_tensors(blocks, self._packing)  # type: ignore[arg-type]
            yield {k: v[0] if k not in ("cu_seqlens", "max_seqlen") else v
                   for k, v in out.items()}

    def _packed_batches(self, lease: list[weakref.ref[Iterator[Any]]], batch_size: int,
                        collate_fn: Callable[[list[Any]], Any] | None,
                        reads: PackedReads | None = None) -> Iterator[Any]:
        """``iter_batches``: ``batch_size`` blocks at a time (the last may be short); the
        reads come from ``reads`` (DataLoader workers) instead of the view's reader."""
        options = self._packing
        assert options is not None
        for blocks in self._packed_run(lease[0], batch_size, batches=1, reads=reads):
            if collate_fn is None:
                yield as_tensors(blocks, options)
            else:
                yield collate_fn([as_tensors(Blocks(blocks.input_ids[j:j + 1],
                                                    blocks.doc_ids[j:j + 1]), options)
                                  for j in range(len(blocks))])

    def _packed_begin(self, lease: weakref.ref[Iterator[Any]] | None
                      ) -> tuple[RankPacker, int]:
        self._refuse_concurrent(lease)
        if self._pack_ended:
            logger.info("epoch %d is exhausted on rank %d; starting epoch %d",
                        self._spec.epoch, self._rank, self._spec.epoch + 1)
            self.set_epoch(self._spec.epoch + 1)
        elif self._packed_remaining() == 0:
            logger.info("rank %d has no blocks left in epoch %d; call set_epoch(%d) to start "
                        "the next one", self._rank, self._spec.epoch, self._spec.epoch + 1)
        progress = self._pack_progress()
        self._pack_base, self._pack_live = progress, None
        splits = worker_share(self._owned, self._claim(lease))
        packer = RankPacker(self._pack_config, splits, [progress[s] for s in splits],
                            self._plan.split_len)
        return packer, self._cursor.generation

    def _packed_run(self, lease: weakref.ref[Iterator[Any]] | None, count: int, *,
                    batches: int, reads: PackedReads | None = None) -> Iterator[Blocks]:
        packer, generation = self._packed_begin(lease)
        splits = packer.splits
        consumed = [p.consumed for p in self._pack_base]
        rows = RankStream(splits, tuple(consumed[s] for s in splits),
                          tuple(consumed[s] for s in splits), self._plan.split_len)
        self._gauge.start(len(rows))
        documents = DocumentReads(self._pack_config.eos_id)
        if reads is None:
            chunks = self._read_rows(rows, documents=documents)
        else:  # other processes hold the whole stream (``reads`` counts what arrives)
            self._gauge.requested = self._gauge.total
            chunks = reads(rows, documents)

        group = group_size(count)

        def step(size: int) -> list[Take]:
            return take_group(packer, rows, chunks, size, group)

        # At most one group per batch left; the first empty group ends the epoch.
        takes = ahead(step, itertools.repeat(count, -(-len(packer) // count)),
                      max(1, -(-self._prefetch_batches // group)))
        try:
            for made, wait_s in timed(takes):
                if not made:
                    break
                for blocks, snapshot, cost in made:
                    self._on_handover(partial(self._packed_commit, generation, splits,
                                              snapshot, len(blocks), cost, wait_s, batches))
                    wait_s = 0.0
                    yield blocks
            self._on_handover(partial(self._packed_end, generation, packer))
        finally:
            # Stop the takes (waiting for one in progress: then no thread reads ``chunks``),
            # then the reads (a Ray Data pipeline) the budget no longer needs.
            for it in (takes, chunks):
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            if generation == self._cursor.generation:
                self._gauge.stop()

    def _packed_commit(self, generation: int, splits: tuple[int, ...], snapshot: Snapshot,
                       blocks: int, cost: ReadCost, wait_s: float, batches: int) -> None:
        """Commit one handed-over batch of ``blocks`` (the packers' ``snapshot`` after it)."""
        self._check_generation(generation, rows=not batches)
        self._pack_live = (splits, snapshot)
        self._cursor.commit(0, batches)
        if batches and self._plans.wants_reports:
            self._report_packed()
        self._gauge.taken = self._gauge.received
        self._gauge.delivered += blocks
        self._meter.record(blocks, cost, 0, wait_s, batches=batches, where=self._where)

    def _packed_end(self, generation: int, packer: RankPacker) -> None:
        if generation == self._cursor.generation:
            self._pack_ended = True
            self._report_left_out(packer)

    def _report_packed(self) -> None:
        """Send the coordinator this rank's packed progress after the step just committed."""
        if self._pack_live is not None and len(self._pack_live[0]) != len(self._owned):
            raise RuntimeError("a coordinator's packed view reports its whole rank's splits; "
                               "read it with iter_batches or StreamingDataLoader, not with "
                               "the workers of a plain DataLoader")
        # Counted without copying the buffers: this runs at every batch.
        live = dict(zip(*self._pack_live)) if self._pack_live is not None else {}
        consumed, emitted, buffered = zip(*(
            counts_of(live[s]) if s in live else self._pack_base[s].counts()
            for s in self._owned))
        self._plans.report(RankReport(self._rank, self._world_size, self._spec.epoch,
                                      self._cursor.batches, consumed, consumed, emitted,
                                      buffered),
                           final=all(e == self._pack_config.blocks_per_split for e in emitted))

    def _report_left_out(self, packer: RankPacker) -> None:
        """Count (in ``stats.tokens_left_out``) and log, once per epoch, the tokens of this
        rank's splits that the budget leaves out."""
        unread, held = packer.left_out()
        if unread:  # documents never read: their tokens come from an exact count
            totals = self._owned_totals(packer.splits)
            cap = self._pack_config.blocks_per_split * self._pack_config.block_len
            left = int(np.maximum(totals - cap, 0).sum())
        else:
            left = held
        self._meter.stats.tokens_left_out += left
        if left:
            logger.warning("epoch %d: the budget of %d blocks per split left out %d tokens of "
                           "rank %d's splits (raise blocks_per_epoch, or use 'auto')",
                           self._spec.epoch, self._pack_config.blocks_per_split, left,
                           self._rank)

    def _owned_totals(self, splits: Sequence[int]) -> np.ndarray:
        if self._pack_totals is None or len(splits) != len(self._owned):
            assert self._packing is not None
            return split_token_totals(self._table, self._plan, splits, self._packing.column,
                                      self._spec.filter, remote=self._remote_counts())
        return self._pack_totals
