"""Exactly-once proofs: compare what was consumed with what the epoch holds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CoverageReport:
    """How a run's consumed samples compare with the epoch's planned samples."""

    planned: int
    before: int
    after: int
    duplicates: int
    lost: int
    unexpected: int
    steps_compared: int = 0
    steps_matching: int = 0

    @property
    def exactly_once(self) -> bool:
        return self.duplicates == 0 and self.lost == 0 and self.unexpected == 0

    @property
    def steps_identical(self) -> bool:
        return self.steps_compared == self.steps_matching


def coverage(planned: Iterable[int], before: Iterable[int], after: Iterable[int]) -> CoverageReport:
    """Count duplicates, losses and strangers in ``before + after`` against ``planned``."""
    planned_set = set(planned)
    seen = Counter(before)
    n_before = sum(seen.values())
    seen.update(after)
    n_after = sum(seen.values()) - n_before
    return CoverageReport(
        planned=len(planned_set),
        before=n_before,
        after=n_after,
        duplicates=sum(c - 1 for c in seen.values() if c > 1),
        lost=len(planned_set - seen.keys()),
        unexpected=len(seen.keys() - planned_set),
    )


def compare_steps(report: CoverageReport, reference: Sequence[Iterable[int]],
                  observed: Sequence[Iterable[int]]) -> CoverageReport:
    """Add how many global steps hold the same sample set as the reference run's."""
    matching = sum(set(a) == set(b) for a, b in zip(reference, observed))
    return replace(report, steps_compared=max(len(reference), len(observed)),
                   steps_matching=matching)
