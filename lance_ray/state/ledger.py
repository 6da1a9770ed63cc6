"""The coordinator's bookkeeping, as pure functions over plain data.

Ranks report their committed progress at global steps, usually several steps in one
:class:`ReportBatch` (views coalesce their reports). A step is *sealed* once every rank of
the current world size has reported it; the sealed progress of a step is the merge of the
ranks' reports (each split's progress comes from its owner), i.e. exactly what
``merge_state_dicts`` of the ranks' own states at that step would give. Only sealed
progress is ever handed out as a checkpoint or a starting point, so a checkpoint is always
one consistent object.

In packed mode (``Ledger.packed``) each split's progress also holds its blocks emitted and
the length of its pack buffer (-1: none yet); the buffer's tokens are not sent: they are the
tail of the split's stream, which the coordinator reads back when it builds a state.

Cost: a pending step keeps one merged row of progress that each report writes its own
splits into, so recording a rank's step is O(its splits) and sealing a step is
O(num_splits); nothing is ever re-merged. Memory: at most ``PENDING_WINDOW`` pending steps,
each two lists of ``num_splits`` integers (packed: four) and a set of the ranks that reported
it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

from ..topology import splits_per_rank

# Pending steps older than this many steps behind the newest reported step are dropped: a
# rank that far behind is dead or restarting, and its old steps can no longer seal. Views
# hold back at most a few coalesced batches, far fewer steps than this.
PENDING_WINDOW = 256

T = TypeVar("T")


@dataclass(frozen=True)
class RankReport:
    """One rank's committed progress on its own splits at a global step."""

    rank: int
    world_size: int
    epoch: int
    step: int
    samples: tuple[int, ...]  # for the rank's owned splits, in split order
    positions: tuple[int, ...]
    blocks: tuple[int, ...] = ()  # packed mode: blocks emitted, per owned split
    buffered: tuple[int, ...] = ()  # packed mode: tokens in each buffer, -1: no buffer


def columns_of(samples: T, positions: T, blocks: T, buffered: T) -> tuple[T, ...]:
    """The progress columns that are sent and sealed: samples and positions, plus blocks and
    buffered in packed mode (rows leave them empty)."""
    return (samples, positions, blocks, buffered) if blocks else (samples, positions)


@dataclass(frozen=True)
class ReportBatch:
    """One rank's committed progress at several global steps (one coalesced report).

    ``samples[i]`` and ``positions[i]`` (packed mode: also ``blocks[i]`` and
    ``buffered[i]``) are the progress of the rank's owned splits, in split order, after step
    ``steps[i]``.
    """

    rank: int
    world_size: int
    epoch: int
    steps: Sequence[int]
    samples: Sequence[Sequence[int]]
    positions: Sequence[Sequence[int]]
    blocks: Sequence[Sequence[int]] = ()
    buffered: Sequence[Sequence[int]] = ()
    # The coordinator generation the sending view attached to (None: not known): a report
    # of an older one comes from a view that a resize or restore made stale.
    generation: int | None = field(default=None, kw_only=True)

    @classmethod
    def of(cls, report: RankReport) -> ReportBatch:
        return cls(report.rank, report.world_size, report.epoch, (report.step,),
                   *([c] for c in columns_of(report.samples, report.positions,
                                             report.blocks, report.buffered)))

    def progress(self) -> Iterator[tuple[int, tuple[Sequence[int], ...]]]:
        """``(step, its per-split progress lists)`` for each step, in the order sent."""
        columns = columns_of(self.samples, self.positions, self.blocks, self.buffered)
        for i, step in enumerate(self.steps):
            yield step, tuple(c[i] for c in columns)


@dataclass(frozen=True)
class Sealed:
    """Merged progress of every split at a sealed global step."""

    epoch: int
    step: int
    world_size: int
    samples: tuple[int, ...]
    positions: tuple[int, ...]
    blocks: tuple[int, ...] = ()  # packed mode only
    buffered: tuple[int, ...] = ()

    def columns(self) -> tuple[tuple[int, ...], ...]:
        """The per-split progress lists (two, or four in packed mode)."""
        return columns_of(self.samples, self.positions, self.blocks, self.buffered)


@dataclass
class StepTally:
    """A pending step: the merge so far of the reports received for it (one list of
    ``num_splits`` integers per progress column)."""

    columns: list[list[int]]
    ranks: set[int] = field(default_factory=set)


@dataclass
class Ledger:
    """Everything the coordinator must remember (and persist) about progress."""

    num_splits: int
    world_size: int
    epoch: int = 0
    sealed: Sealed | None = None
    pending: dict[int, StepTally] = field(default_factory=dict)
    newest: int = 0  # the newest step with a tally since pending was last cleared
    packed: bool = False  # progress includes blocks emitted and buffer lengths

    @property
    def width(self) -> int:
        """Progress columns per split: samples and positions (packed: blocks, buffered)."""
        return 4 if self.packed else 2

    def zero(self, epoch: int) -> Sealed:
        """No progress in ``epoch`` (packed: no split has a buffer)."""
        zeros = (0,) * self.num_splits
        extra = (zeros, (-1,) * self.num_splits) if self.packed else ()
        return Sealed(epoch, 0, self.world_size, zeros, zeros, *extra)

    def start(self) -> Sealed:
        """Where views of the current epoch start: the latest sealed step, or zero."""
        if self.sealed is not None and self.sealed.epoch == self.epoch:
            return self.sealed
        return self.zero(self.epoch)

    def clear_pending(self) -> None:
        self.pending.clear()
        self.newest = 0


class StaleReport(ValueError):
    """A report that does not belong to the coordinator's current world size or epoch."""


def record(ledger: Ledger, report: RankReport) -> Sealed | None:
    """Add one step's ``report``; returns the step it sealed, if it completed one."""
    sealed = record_batch(ledger, ReportBatch.of(report))
    return sealed[-1] if sealed else None


def record_batch(ledger: Ledger, batch: ReportBatch) -> list[Sealed]:
    """Add ``batch``; returns the steps it sealed, oldest first.

    Idempotent: repeating a report (a retry) changes nothing; a report that contradicts an
    earlier one for the same (rank, step) is refused (the batch's steps before it stay
    recorded: they are valid). The whole batch is checked before anything is recorded.
    """
    if not _current(ledger, batch):
        return []
    per_rank = splits_per_rank(ledger.num_splits, ledger.world_size)
    lo, hi = batch.rank * per_rank, (batch.rank + 1) * per_rank
    floor = ledger.sealed.step if ledger.sealed is not None and \
        ledger.sealed.epoch == ledger.epoch else -1
    newly: list[Sealed] = []
    for step, progress in batch.progress():
        if step <= floor:
            continue  # already sealed (a retry or a late duplicate)
        tally = ledger.pending.get(step)
        if tally is None:
            if step < ledger.newest - PENDING_WINDOW:
                continue  # that step was dropped: it can no longer seal
            tally = _open(ledger, step)
        if batch.rank in tally.ranks:
            if any(c[lo:hi] != list(p) for c, p in zip(tally.columns, progress)):
                raise ValueError(
                    f"rank {batch.rank} reported two different progresses for step {step}"
                )
            continue
        for column, values in zip(tally.columns, progress):
            column[lo:hi] = values
        tally.ranks.add(batch.rank)
        if len(tally.ranks) == ledger.world_size:
            newly.append(_seal(ledger, step))
            floor = step
    return newly


def check_generation(ledger: Ledger, batch: ReportBatch, generation: int) -> None:
    """Refuse ``batch`` from a view of another ``generation`` of the coordinator at the
    ledger's world size: a checkpoint was restored since that view attached, and its reports
    would seal steps of the abandoned progress (a view of another world size is refused by
    :func:`record_batch`)."""
    if batch.generation not in (None, generation) and batch.world_size == ledger.world_size:
        raise StaleReport(
            f"report from rank {batch.rank} of a view of generation {batch.generation}, but a "
            f"checkpoint was restored since (generation {generation}): that view is stale; "
            "restart it from the coordinator")


def _current(ledger: Ledger, batch: ReportBatch) -> bool:
    """Whether ``batch`` belongs to the current epoch; raises if it is malformed or stale."""
    if batch.world_size != ledger.world_size:
        raise StaleReport(
            f"report from rank {batch.rank} of world size {batch.world_size}, but the run "
            f"was resized to {ledger.world_size}; restart this view from the coordinator"
        )
    if batch.epoch < ledger.epoch:
        return False  # a slow rank finishing an epoch the others already left
    if batch.epoch > ledger.epoch:
        raise StaleReport(
            f"report for epoch {batch.epoch} but the coordinator is on epoch "
            f"{ledger.epoch}; move to a new epoch with set_epoch() first"
        )
    if not 0 <= batch.rank < ledger.world_size:
        raise ValueError(f"rank {batch.rank} is not in [0, {ledger.world_size})")
    columns = [batch.samples, batch.positions, *((batch.blocks, batch.buffered)
                                                  if ledger.packed else ())]
    if any(len(c) != len(batch.steps) for c in columns) or \
            (not ledger.packed and (batch.blocks or batch.buffered)):
        what = "sample, position, block and buffer" if ledger.packed else "sample and position"
        raise ValueError(
            f"rank {batch.rank} sent {len(batch.steps)} steps with {len(batch.samples)} "
            f"sample, {len(batch.positions)} position, {len(batch.blocks)} block and "
            f"{len(batch.buffered)} buffer lists; send one {what} list per step"
        )
    per_rank = splits_per_rank(ledger.num_splits, ledger.world_size)
    for column in columns:
        for values in column:
            if len(values) != per_rank:
                raise ValueError(f"rank {batch.rank} reported {len(values)} splits, "
                                 f"but owns {per_rank}")
    return True


def _open(ledger: Ledger, step: int) -> StepTally:
    """A new tally for ``step``, dropping the steps that fell out of the window."""
    tally = StepTally([[0] * ledger.num_splits for _ in range(ledger.width)])
    ledger.pending[step] = tally
    if step > ledger.newest:
        ledger.newest = step
        for old in [s for s in ledger.pending if s < step - PENDING_WINDOW]:
            del ledger.pending[old]
    return tally


def _seal(ledger: Ledger, step: int) -> Sealed:
    tally = ledger.pending.pop(step)
    ledger.sealed = Sealed(ledger.epoch, step, ledger.world_size,
                           *(tuple(c) for c in tally.columns))
    for older in [s for s in ledger.pending if s < step]:
        del ledger.pending[older]  # a newer step sealed: these are never handed out
    return ledger.sealed


@dataclass
class History:
    """The newest sealed steps (for ``state_dict(step=...)``): at most ``max_steps``, and
    fewer with many splits, so that they hold at most ``max_values`` integers."""

    max_steps: int = 1024
    max_values: int = 1 << 20
    steps: dict[tuple[int, int], Sealed] = field(default_factory=dict)  # oldest first

    def add(self, sealed: Sealed) -> None:
        self.steps[(sealed.epoch, sealed.step)] = sealed
        values = sum(len(c) for c in sealed.columns())
        keep = max(1, min(self.max_steps, self.max_values // (values or 1)))
        while len(self.steps) > keep:
            del self.steps[next(iter(self.steps))]

    def restart(self, sealed: Sealed) -> None:
        """Keep only ``sealed``: the steps kept before a restore belong to progress that was
        abandoned (or to another run), and ``state_dict(step=...)`` must not hand them out."""
        self.steps = {}
        self.add(sealed)

    def get(self, epoch: int, step: int) -> Sealed:
        sealed = self.steps.get((epoch, step))
        if sealed is None:
            have = sorted(s for e, s in self.steps if e == epoch)
            raise ValueError(
                f"step {step} of epoch {epoch} is not sealed or no longer kept; sealed steps "
                f"held: {have[:1] + have[-1:] if have else 'none'}"
            )
        return sealed


def ledger_json(ledger: Ledger) -> dict[str, Any]:
    """``ledger`` as plain JSON data, pending steps included: reports a restarted
    coordinator still needs (a rank whose report of a step was acknowledged never sends it
    again)."""
    return {"num_splits": ledger.num_splits, "world_size": ledger.world_size,
            "epoch": ledger.epoch, "sealed": ledger.sealed and asdict(ledger.sealed),
            "pending": {"newest": ledger.newest,
                        "steps": [[step, t.columns, sorted(t.ranks)]
                                  for step, t in sorted(ledger.pending.items())]}}


def ledger_from_json(saved: dict[str, Any], *, packed: bool) -> Ledger:
    """The ledger of :func:`ledger_json` (one written before pending steps were kept has
    none)."""
    d = saved["sealed"]
    sealed = None if d is None else Sealed(
        d["epoch"], d["step"], d["world_size"],
        *(tuple(d[k]) for k in ("samples", "positions", "blocks", "buffered") if k in d))
    ledger = Ledger(saved["num_splits"], saved["world_size"], saved["epoch"], sealed,
                    packed=packed)
    pending = saved.get("pending")
    if pending:
        ledger.newest = pending["newest"]
        ledger.pending = {step: StepTally([list(c) for c in columns], set(ranks))
                          for step, columns, ranks in pending["steps"]}
    return ledger


def resize(ledger: Ledger, world_size: int) -> Sealed:
    """Move to ``world_size``: views restart from the latest sealed step, pending is dropped."""
    splits_per_rank(ledger.num_splits, world_size)
    ledger.world_size = world_size
    ledger.clear_pending()
    return ledger.start()


def advance_epoch(ledger: Ledger, epoch: int) -> None:
    """Start ``epoch``: progress restarts at zero for every split."""
    if epoch < ledger.epoch:
        raise ValueError(f"cannot go back from epoch {ledger.epoch} to {epoch}")
    if epoch != ledger.epoch:
        ledger.epoch = epoch
        ledger.clear_pending()


def progress_key(sealed: Sealed) -> Sealed:
    """``sealed`` as progress alone: the world size it was sealed at aside (see
    :func:`restore`)."""
    return replace(sealed, world_size=0)


def starts_from(ledger: Ledger, sealed: Sealed) -> bool:
    """Whether the ledger's progress starts from ``sealed`` already (the world size it was
    sealed at aside: see :func:`restore`)."""
    return progress_key(ledger.start()) == progress_key(sealed)


def restore(ledger: Ledger, sealed: Sealed) -> bool:
    """Make ``sealed`` (e.g. from a checkpoint) the starting point, dropping pending reports;
    whether anything changed.

    Restoring the progress the ledger already starts from is a no-op, so every rank of a
    restarted group may restore the same checkpoint without wiping the others' reports.
    The world size a step was sealed at does not count: once the group's first rank has
    resized the ledger, its sealed step still names the old one.
    """
    if starts_from(ledger, sealed):
        return False
    ledger.epoch = sealed.epoch
    ledger.sealed = sealed
    ledger.clear_pending()
    return True
