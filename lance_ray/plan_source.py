"""Where a view gets its part of the plan, and where its progress goes.

``LocalPlans`` builds the plan in the view's own process (like the reference);
``coordinator.CoordinatorPlans`` asks the coordinator actor, which builds it once per epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .plan import PlanSpec, SplitPlan, build_plan
from .state import PlanIdentity
from .table import TableRef

DEFAULT_NAMESPACE = "lance_ray"


class PlanSource(Protocol):
    wants_reports: bool  # whether ``report`` does anything (it costs a progress computation)

    def part(self, spec: PlanSpec, owned: Sequence[int]) -> tuple[SplitPlan, PlanIdentity]:
        """The plan of ``owned`` splits for ``spec``, and the whole plan's identity."""
        ...

    def report(self, rank: int, world_size: int, epoch: int, step: int,
               samples: Sequence[int], positions: Sequence[int]) -> None:
        """Record a rank's committed progress on its own splits after global step ``step``."""
        ...

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``."""
        ...


class LocalPlans:
    """Builds the full plan in this process and keeps only the owned splits."""

    wants_reports = False

    def __init__(self, table: TableRef, rows_after_filter: int):
        self.table, self.rows_after_filter = table, rows_after_filter

    def part(self, spec: PlanSpec, owned: Sequence[int]) -> tuple[SplitPlan, PlanIdentity]:
        full = build_plan(self.table.open_lancedb(), spec, self.rows_after_filter)
        return full.splits(owned[0], len(owned)), PlanIdentity.of(full)

    def report(self, rank: int, world_size: int, epoch: int, step: int,
               samples: Sequence[int], positions: Sequence[int]) -> None:
        return None

    def set_epoch(self, epoch: int) -> None:
        return None
