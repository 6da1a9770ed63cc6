"""The coordinator's bookkeeping, as pure functions over plain data.

Ranks report their committed progress at global steps. A step is *sealed* once every rank
of the current world size has reported it; the sealed progress of a step is the merge of the
ranks' reports (each split's progress comes from its owner), i.e. exactly what
``merge_state_dicts`` of the ranks' own states at that step would give. Only sealed
progress is ever handed out as a checkpoint or a starting point, so a checkpoint is always
one consistent object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .plan import rank_splits, splits_per_rank

# Pending steps older than this many steps behind the newest report are dropped: a rank
# that far behind is dead or restarting, and its old steps can no longer seal.
PENDING_WINDOW = 64


@dataclass(frozen=True)
class RankReport:
    """One rank's committed progress on its own splits at a global step."""

    rank: int
    world_size: int
    epoch: int
    step: int
    samples: tuple[int, ...]  # for the rank's owned splits, in split order
    positions: tuple[int, ...]


@dataclass(frozen=True)
class Sealed:
    """Merged progress of every split at a sealed global step."""

    epoch: int
    step: int
    world_size: int
    samples: tuple[int, ...]
    positions: tuple[int, ...]


@dataclass
class Ledger:
    """Everything the coordinator must remember (and persist) about progress."""

    num_splits: int
    world_size: int
    epoch: int = 0
    sealed: Sealed | None = None
    pending: dict[int, dict[int, RankReport]] = field(default_factory=dict)

    def start(self) -> Sealed:
        """Where views of the current epoch start: the latest sealed step, or zero."""
        if self.sealed is not None and self.sealed.epoch == self.epoch:
            return self.sealed
        zeros = (0,) * self.num_splits
        return Sealed(self.epoch, 0, self.world_size, zeros, zeros)


class StaleReport(ValueError):
    """A report that does not belong to the coordinator's current world size or epoch."""


def record(ledger: Ledger, report: RankReport) -> Sealed | None:
    """Add ``report``; returns the newly sealed step, if this report completed one.

    Idempotent: repeating a report (a retry) changes nothing; a report that contradicts
    an earlier one for the same (rank, step) is refused.
    """
    if report.world_size != ledger.world_size:
        raise StaleReport(
            f"report from rank {report.rank} of world size {report.world_size}, but the run "
            f"was resized to {ledger.world_size}; restart this view from the coordinator"
        )
    if report.epoch < ledger.epoch:
        return None  # a slow rank finishing an epoch the others already left
    if report.epoch > ledger.epoch:
        raise StaleReport(
            f"report for epoch {report.epoch} but the coordinator is on epoch "
            f"{ledger.epoch}; move to a new epoch with set_epoch() first"
        )
    if not 0 <= report.rank < ledger.world_size:
        raise ValueError(f"rank {report.rank} is not in [0, {ledger.world_size})")
    if len(report.samples) != splits_per_rank(ledger.num_splits, ledger.world_size):
        raise ValueError(f"rank {report.rank} reported {len(report.samples)} splits")
    sealed = ledger.sealed
    if sealed is not None and sealed.epoch == report.epoch and report.step <= sealed.step:
        return None  # already sealed (a retry or a late duplicate)
    reports = ledger.pending.setdefault(report.step, {})
    previous = reports.get(report.rank)
    if previous is not None and previous != report:
        raise ValueError(
            f"rank {report.rank} reported two different progresses for step {report.step}"
        )
    reports[report.rank] = report
    newest = max(ledger.pending)
    for old in [s for s in ledger.pending if s < newest - PENDING_WINDOW]:
        del ledger.pending[old]
    if len(reports) < ledger.world_size:
        return None
    return _seal(ledger, report.step)


def _seal(ledger: Ledger, step: int) -> Sealed:
    reports = ledger.pending.pop(step)
    samples = [0] * ledger.num_splits
    positions = [0] * ledger.num_splits
    for r in reports.values():
        for k, split in enumerate(rank_splits(r.rank, ledger.world_size, ledger.num_splits)):
            samples[split], positions[split] = r.samples[k], r.positions[k]
    ledger.sealed = Sealed(ledger.epoch, step, ledger.world_size, tuple(samples), tuple(positions))
    for older in [s for s in ledger.pending if s < step]:
        del ledger.pending[older]
    return ledger.sealed


def resize(ledger: Ledger, world_size: int) -> Sealed:
    """Move to ``world_size``: views restart from the latest sealed step, pending is dropped."""
    splits_per_rank(ledger.num_splits, world_size)
    ledger.world_size = world_size
    ledger.pending.clear()
    return ledger.start()


def advance_epoch(ledger: Ledger, epoch: int) -> None:
    """Start ``epoch``: progress restarts at zero for every split."""
    if epoch < ledger.epoch:
        raise ValueError(f"cannot go back from epoch {ledger.epoch} to {epoch}")
    if epoch != ledger.epoch:
        ledger.epoch = epoch
        ledger.pending.clear()


def restore(ledger: Ledger, sealed: Sealed) -> None:
    """Make ``sealed`` (e.g. from a checkpoint) the starting point, dropping pending reports.

    Restoring the progress the ledger already starts from is a no-op, so every rank of a
    restarted group may restore the same checkpoint without wiping the others' reports.
    """
    current = ledger.start()
    if (current.epoch, current.step, current.samples, current.positions) == (
        sealed.epoch, sealed.step, sealed.samples, sealed.positions
    ):
        return
    ledger.epoch = sealed.epoch
    ledger.sealed = sealed
    ledger.pending.clear()
