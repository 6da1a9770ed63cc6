"""Where a view gets its part of the plan, and where its progress goes.

``LocalPlans`` builds the plan in the view's own process (like the reference);
``RayTaskPlans`` builds it in a Ray task (when Ray is up), so the trainer holds only its
own splits;
``coordinator_plans.CoordinatorPlans`` asks the coordinator actor, which builds it once per epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
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
               samples: Sequence[int], positions: Sequence[int], *, final: bool = False) -> None:
        """Record a rank's committed progress on its own splits after global step ``step``
        (``final``: the rank's epoch ends there). May be sent later, coalesced."""
        ...

    def flush(self) -> None:
        """Return once every report made so far is recorded (before a checkpoint)."""
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
        return build_part(self.table, self.rows_after_filter, spec, owned)

    def report(self, rank: int, world_size: int, epoch: int, step: int,
               samples: Sequence[int], positions: Sequence[int], *, final: bool = False) -> None:
        return None

    def flush(self) -> None:
        return None

    def set_epoch(self, epoch: int) -> None:
        return None


class RayTaskPlans(LocalPlans):
    """Builds the plan in a Ray task on this node and receives only the owned splits.

    The permutation builder's peak memory (about 80 bytes per row, measured) then never
    lands in the trainer process, whose footprint stays flat as the table grows.
    """

    def part(self, spec: PlanSpec, owned: Sequence[int]) -> tuple[SplitPlan, PlanIdentity]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                              soft=True)
        # num_cpus=0: a short task that must not wait behind the read tasks filling the CPUs.
        task = ray.remote(build_part).options(num_cpus=0, scheduling_strategy=here)
        return ray.get(task.remote(self.table, self.rows_after_filter, spec, list(owned)))


def build_part(table: TableRef, rows_after_filter: int, spec: PlanSpec,
               owned: Sequence[int]) -> tuple[SplitPlan, PlanIdentity]:
    """The plan of the contiguous ``owned`` splits, and the whole plan's identity."""
    full = build_plan(table.open_lancedb(), spec, rows_after_filter)
    part = full.splits(owned[0], len(owned))
    if len(owned) < spec.num_splits:  # a view would keep every other rank's splits alive
        part = replace(part, row_ids=part.row_ids.copy())
    return part, PlanIdentity.of(full)
