"""The coordinator's side of sequence packing: the run's packing arguments, each epoch's
budget, and the packed states it builds from sealed progress.

Views report per split the documents consumed, the blocks emitted and their buffer's length
(:mod:`lance_ray.state.ledger`); a state handed out carries the buffers' tokens, read back
from the table (:mod:`lance_ray.stream.rebuild`), in the reference's packed format, so a
coordinator's checkpoint loads in ``lancedb.streaming`` and in views of any world size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..plan.pack_args import PackOptions
from ..plan.splits import SplitPlan
from ..plan.table import TableRef
from ..read.take import take_in_order
from ..read.tokens import auto_budget, say_auto_budget, split_token_totals
from ..state import format as st
from ..state import ledger as lg
from ..state.packed import (
    PackConfig,
    SplitProgress,
    check_packing_matches,
    make_packed_state,
    parse_packed_state,
)
from ..stream.packed_order import NOT_ALIGNED
from ..stream.packing import documents
from ..stream.rebuild import FIRST_READ, rebuild_buffer

logger = logging.getLogger(__name__)

Documents = tuple[np.ndarray, np.ndarray]  # (values, offsets), as ``packing.documents``


@dataclass
class PackedRun:
    """Packing arguments of a coordinator's run and where each split's stream starts."""

    options: PackOptions
    num_splits: int
    base: list[SplitProgress] = field(default_factory=list)  # the epoch's starting buffers
    budgets: dict[int, int] = field(default_factory=dict)  # epoch -> blocks_per_epoch
    base_file: str | None = None  # where the base was persisted (``base_name``)
    # Views ask for an epoch's budget at once (the actor answers several calls at a time):
    # one of them counts, the others wait for its number.
    counting: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.base:
            self.reset()

    def reset(self) -> None:
        """A new epoch: every stream starts empty."""
        self.base = [SplitProgress() for _ in range(self.num_splits)]

    def budget(self, table: TableRef, plan: SplitPlan) -> int:
        """``blocks_per_epoch`` of ``plan``'s epoch (``"auto"``: an exact count, once)."""
        epoch = plan.spec.epoch
        if isinstance(self.options.blocks_per_epoch, int):
            return self.options.blocks_per_epoch
        with self.counting:
            if epoch not in self.budgets:
                self._count(table, plan)
            return self.budgets[epoch]

    def _count(self, table: TableRef, plan: SplitPlan) -> None:
        o, epoch = self.options, plan.spec.epoch
        started = time.monotonic()
        totals = split_token_totals(table, plan, range(self.num_splits), o.column,
                                    plan.spec.filter, remote=True)
        self.budgets = {e: b for e, b in self.budgets.items() if e >= epoch - 1}
        self.budgets[epoch] = auto_budget(int(totals.sum()), o.block_len, self.num_splits)
        say_auto_budget(self.budgets[epoch], o.block_len, int(totals.sum()),
                        plan.split_len * self.num_splits, plan.spec, time.monotonic() - started)

    def status(self, sealed: lg.Sealed) -> dict[str, Any]:
        """Blocks of ``sealed`` and of the epoch (None while an ``"auto"`` count is due)."""
        budget = self.options.blocks_per_epoch
        return {"block_len": self.options.block_len, "sealed_blocks": sum(sealed.blocks),
                "epoch_blocks": budget if isinstance(budget, int)
                else self.budgets.get(sealed.epoch)}

    def _config(self, budget: int) -> PackConfig:
        o = self.options
        return PackConfig(o.block_len, o.eos_id, o.pad_id, budget // self.num_splits)

    def state(self, table: TableRef, plan: SplitPlan, identity: st.PlanIdentity,
              sealed: lg.Sealed) -> dict[str, Any]:
        """The merged packed state of ``sealed`` (of the plan ``identity`` describes), its
        buffers read back from ``table``."""
        column = self.options.column

        def read(ranges: dict[int, tuple[int, int]]) -> dict[int, Documents]:
            """The documents of each split's ``(lo, hi)``, in one read for all splits."""
            if not ranges:
                return {}
            rows = [plan.rows(k, np.arange(lo, hi, dtype=np.int64))
                    for k, (lo, hi) in ranges.items()]
            got = take_in_order(table, np.concatenate(rows), [column])
            values, offsets = documents(got.column(column))
            out, at = {}, 0
            for k, part in zip(ranges, rows):
                lo, hi = offsets[at], offsets[at + len(part)]
                out[k] = (values[lo:hi], offsets[at:at + len(part) + 1] - lo)
                at += len(part)
            return out

        # Each split's last few documents in one read (a buffer usually lies in the last
        # one), so a state of a thousand splits is one read, not a thousand.
        first = {k: (max(b.consumed, n - FIRST_READ), n) for k, (b, n, length) in
                 enumerate(zip(self.base, sealed.samples, sealed.buffered))
                 if length > 0 and n > b.consumed}
        prefetched = read(first)

        def reader(split: int) -> Any:
            def read_split(lo: int, hi: int) -> Documents:
                if first.get(split) == (lo, hi):
                    return prefetched[split]
                return read({split: (lo, hi)})[split]
            return read_split

        splits = [rebuild_buffer(self.base[k], sealed.samples[k], sealed.blocks[k],
                                 sealed.buffered[k], reader(k), self.options.eos_id)
                  for k in range(self.num_splits)]
        budget = self.budget(table, plan)
        return make_packed_state(identity, self._config(budget), budget, splits,
                                 world_size=sealed.world_size, rank=None,
                                 global_step=sealed.step)

    def restored(self, state: dict[str, Any], table: TableRef, plan: SplitPlan,
                 identity: st.PlanIdentity, world_size: int) -> tuple[lg.Sealed, list[Any]]:
        """The sealed progress of the packed checkpoint ``state`` and the base its buffers
        make (kept as the epoch's starting point: later buffers may reach back into them);
        nothing changes here."""
        parsed = parse_packed_state(state, plan.split_len)
        st.check_compatible(state, identity)
        budget = self.budget(table, plan)
        check_packing_matches(state, self._config(budget), budget)
        if not parsed.owner.is_complete:
            raise ValueError("the coordinator needs a merged state covering every split; "
                             "merge the ranks' states with merge_state_dicts() first")
        if len(set(parsed.emitted)) > 1:
            # A lancedb state names no rank, so one rank's unmerged state passes the check
            # above; its splits' block counts differ, which no global step leaves.
            raise ValueError(NOT_ALIGNED)
        consumed = tuple(s.consumed for s in parsed.splits)
        return lg.Sealed(plan.spec.epoch, parsed.owner.global_step or 0, world_size, consumed,
                         consumed, tuple(parsed.emitted),
                         tuple(s.counts()[2] for s in parsed.splits)), list(parsed.splits)

    # Persistence. The base holds tokens (up to a block or more per split), so it is kept in
    # a file of its own, named by its content and written once per restore, not with every
    # seal the ledger writes; the ledger names the file (written first, so a crash between
    # the two leaves the ledger naming the previous one).

    def base_json(self) -> list[dict[str, Any]]:
        return [{"consumed": s.consumed, "emitted": s.emitted, "buffer": s.buffer()}
                for s in self.base]

    def base_name(self) -> str | None:
        """The base's file name (None: every stream starts empty, no file is needed)."""
        if all(s.key() == SplitProgress().key() for s in self.base):
            return None
        digest = hashlib.sha256(json.dumps(self.base_json()).encode()).hexdigest()[:20]
        return f"packed-base-{digest}.json"

    def to_json(self) -> dict[str, Any]:
        return {"base_file": self.base_file,
                "budgets": {str(e): b for e, b in self.budgets.items()}}

    def load_json(self, saved: dict[str, Any], read: Callable[[str], Any]) -> None:
        """Restore from ``to_json``'s output; ``read(name)`` loads a base file."""
        def progress(d: dict[str, Any]) -> SplitProgress:
            buf = d["buffer"]
            if buf is None:
                return SplitProgress(d["consumed"], d["emitted"])
            return SplitProgress(d["consumed"], d["emitted"], np.array(buf["tokens"], np.int64),
                                 np.array(buf["starts"], np.int64))

        self.base_file = saved["base_file"]
        if self.base_file is None:
            self.reset()
        else:
            self.base = [progress(d) for d in read(self.base_file)]
        self.budgets = {int(e): b for e, b in saved["budgets"].items()}
