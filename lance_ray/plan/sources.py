"""Where a view gets its part of the plan, and where its progress goes.

``LocalPlans`` builds the plan in the view's own process (like the reference);
``RayTaskPlans`` builds it in a Ray task (when Ray is up), so the trainer holds only its
own splits;
``coordinator.client.CoordinatorPlans`` asks the coordinator actor, which builds it
once per epoch.
Local and Ray-task sources build the next epoch's plan in the background as soon as an
epoch's plan is handed over, so no epoch after the first waits for its plan.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from ..state import ledger as lg
from .background import BackgroundPlans
from .index import build_index_plan
from .splits import PlanSpec, SplitPlan, build_plan, check_epoch_seed
from .table import TableRef

# Plans of fewer rows build in the view's process even with ``reader="ray"``: their builder
# peaks under ~80 MB, and a Ray task for them can cost more than the plan (a worker start on
# a busy node takes seconds; such a plan builds in-process in a fraction of one).
REMOTE_PLAN_MIN_ROWS = 1_000_000


class PlanSource(Protocol):
    wants_reports: bool  # whether ``report`` does anything (it costs a progress computation)

    def part(self, spec: PlanSpec, owned: Sequence[int]) -> SplitPlan:
        """The plan of ``owned`` splits for ``spec`` (its ``identity()`` is the whole plan's)."""
        ...

    def report(self, report: lg.RankReport, *, final: bool = False) -> None:
        """Record a rank's committed progress on its own splits after a global step
        (``final``: the rank's epoch ends there). May be sent later, coalesced."""
        ...

    def flush(self) -> None:
        """Return once every report made so far is recorded (before a checkpoint)."""
        ...

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``."""
        ...

    def pack_budget(self, epoch: int) -> int | None:
        """A packed run's ``blocks_per_epoch`` of ``epoch`` when this source decides it
        (None: the view resolves its own)."""
        ...

    def check_current(self) -> None:
        """Raise ``StaleReport`` if the plan this view reads was replaced (a coordinator's
        resize); called before each delivery, so it is cheap."""
        ...

    def ahead(self, spec: PlanSpec, owned: Sequence[int]) -> None:
        """The view handed over its first batch of ``spec``: start building the next
        epoch's plan of ``owned``, if this source builds plans ahead."""
        ...


PartKey = tuple[PlanSpec, tuple[int, ...]]


class LocalPlans:
    """Builds the full plan in this process and keeps only the owned splits."""

    wants_reports = False

    def __init__(self, table: TableRef, rows_after_filter: int):
        self.table, self.rows_after_filter = table, rows_after_filter
        self.plans: BackgroundPlans[PartKey, SplitPlan] = \
            BackgroundPlans(self._build, name="view plan")

    def part(self, spec: PlanSpec, owned: Sequence[int]) -> SplitPlan:
        return self.plans.get((spec, tuple(owned)))

    def ahead(self, spec: PlanSpec, owned: Sequence[int]) -> None:
        # Started at the first handover, not with the epoch's plan: a build of a large
        # table's plan is seconds of CPU, which the first batch's reads would otherwise
        # share (a mixture, one build per source).
        upcoming = next_epoch(spec)
        if upcoming is not None and self.table.plans_ahead:
            self.plans.prefetch((upcoming, tuple(owned)))

    def _build(self, key: PartKey) -> SplitPlan:
        return build_part(self.table, self.rows_after_filter, key[0], key[1])

    def __getstate__(self) -> dict[str, Any]:
        # Builds in flight stay with this process (a DataLoader worker needs none).
        return {"table": self.table, "rows_after_filter": self.rows_after_filter}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["table"], state["rows_after_filter"])  # type: ignore[misc]

    def report(self, report: lg.RankReport, *, final: bool = False) -> None:
        return None

    def flush(self) -> None:
        return None

    def set_epoch(self, epoch: int) -> None:
        return None

    def pack_budget(self, epoch: int) -> int | None:
        return None

    def check_current(self) -> None:
        return None


class RayTaskPlans(LocalPlans):
    """Builds the plan in a Ray task on this node and receives only the owned splits.

    The permutation builder's peak memory (tens of bytes per row) then never
    lands in the trainer process, whose footprint stays flat as the table grows. Small plans
    (``REMOTE_PLAN_MIN_ROWS``) and index plans (O(num_splits)) build in-process: a task
    would cost more than the plan.
    """

    def _build(self, key: PartKey) -> SplitPlan:
        spec, owned = key
        if spec.plan == "index" or self.rows_after_filter < REMOTE_PLAN_MIN_ROWS:
            return super()._build(key)
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                              soft=True)
        # num_cpus=0: a short task that must not wait behind the read tasks filling the CPUs.
        task = ray.remote(build_part).options(num_cpus=0, scheduling_strategy=here)
        return ray.get(task.remote(self.table, self.rows_after_filter, spec, list(owned)))


def next_epoch(spec: PlanSpec) -> PlanSpec | None:
    """The spec of the epoch after ``spec``'s, or None if its seed would not be valid."""
    try:
        check_epoch_seed(spec.shuffle_seed, spec.epoch + 1)
    except ValueError:
        return None
    return spec.for_epoch(spec.epoch + 1)


def plan_for(table: TableRef, spec: PlanSpec, rows_after_filter: int) -> SplitPlan:
    """The whole plan of ``spec`` in the mode it names."""
    if spec.plan == "index":
        return build_index_plan(table.open_lance(), spec)
    return build_plan(table.open_lancedb(), spec, rows_after_filter)


def build_part(table: TableRef, rows_after_filter: int, spec: PlanSpec,
               owned: Sequence[int]) -> SplitPlan:
    """The plan of the contiguous ``owned`` splits (it keeps the whole plan's identity)."""
    full = plan_for(table, spec, rows_after_filter)
    part = full.splits(owned[0], len(owned))
    if part.row_ids is not None and len(owned) < spec.num_splits:
        part = replace(part, row_ids=part.row_ids.copy())  # a view keeps all splits alive
    return part


def ray_is_up() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()
