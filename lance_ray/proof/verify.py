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
    steps_trained: int = 0  # global steps observed (fewer than compared: a run not over)

    @property
    def exactly_once(self) -> bool:
        return self.duplicates == 0 and self.lost == 0 and self.unexpected == 0

    @property
    def steps_identical(self) -> bool:
        return self.steps_compared == self.steps_matching


def coverage(planned: Iterable[int], before: Iterable[int], after: Iterable[int]) -> CoverageReport:
    """Count duplicates, losses and strangers in ``before + after`` against ``planned``.

    ``planned`` is a multiset: an id planned ``k`` times (e.g. the content id of identical
    all-padding blocks) must be seen ``k`` times; each extra sighting is a duplicate and
    each missing one a loss.
    """
    want = Counter(planned)
    seen = Counter(before)
    n_before = sum(seen.values())
    seen.update(after)
    n_after = sum(seen.values()) - n_before
    return CoverageReport(
        planned=sum(want.values()),
        before=n_before,
        after=n_after,
        duplicates=sum(max(0, c - want.get(i, 1)) for i, c in seen.items()),
        lost=sum(max(0, k - seen.get(i, 0)) for i, k in want.items()),
        unexpected=len(seen.keys() - want.keys()),
    )


def compare_steps(report: CoverageReport, reference: Sequence[Iterable[int]],
                  observed: Sequence[Iterable[int]]) -> CoverageReport:
    """Add how many global steps hold the same samples (as multisets) as the reference's."""
    matching = sum(Counter(a) == Counter(b) for a, b in zip(reference, observed))
    return replace(report, steps_compared=max(len(reference), len(observed)),
                   steps_matching=matching, steps_trained=len(observed))
