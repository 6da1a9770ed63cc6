"""How far a Ray reader's pipeline may run ahead of its consumer, in bytes.

Ray Data's own bound is its per-operator resource reservation, and on a small cluster that
reservation runs short read tasks mostly one at a time (docs/transforms.md; ``python -m
jobs.bench.reservation`` compares the two). Without the reservation, though, Ray
Data admits every read task at once and the reads fill the object store ahead of a slow
trainer. So a pipeline here turns the reservation off and bounds itself with
``RunAheadPolicy`` instead: a read task is submitted only while the bytes of the tasks
running and of the blocks done and not yet released stay within a budget. Ray Data counts
a block until its last reference is gone, so the blocks the consumer holds count too; the
budget leaves room for them (``scale.consumer_outputs``). A submitted task cannot be taken
back, so a task counts from its submission, at its read's size or at the largest output
Ray Data has measured, whichever is larger.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

BUDGET_KEY = "lance_ray.run_ahead_bytes"
TASK_KEY = "lance_ray.read_task_bytes"


@dataclass(frozen=True)
class RunAhead:
    """What one pipeline may hold: ``budget`` bytes of tasks submitted or done and not yet
    taken, each task counted as at least ``task_bytes``."""

    budget: int
    task_bytes: int

    def admits(self, running: int, queued_bytes: int, measured_task_bytes: int) -> bool:
        """Whether one more task may be submitted now. When the pipeline holds nothing one
        always may (however large), so it can never stall on its own bound."""
        per_task = max(self.task_bytes, measured_task_bytes)
        idle = running == 0 and queued_bytes == 0
        return idle or queued_bytes + (running + 1) * per_task <= self.budget


def bound_pipeline(context: Any, bound: RunAhead) -> bool:
    """Configure a Ray ``DataContext`` (a dataset's own copy) to run without Ray Data's
    reservation and within ``bound``; False (the context untouched) when this Ray does not
    have the internals it needs."""
    try:
        from ray.data._internal.execution.backpressure_policy import (
            ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY,
            ConcurrencyCapBackpressurePolicy,
        )
    except ImportError:  # pragma: no cover - Ray is pinned; a future one may move these
        logger.info("this Ray has no backpressure policies to configure; keeping Ray Data's "
                    "resource reservation")
        return False
    context.op_resource_reservation_enabled = False
    context.set_config(ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY,
                       [ConcurrencyCapBackpressurePolicy, _policy_cls()])
    context.set_config(BUDGET_KEY, bound.budget)
    context.set_config(TASK_KEY, bound.task_bytes)
    return True


@functools.cache
def _policy_cls() -> type:
    """:class:`RunAheadPolicy`, defined on first use so that importing this module does not
    import Ray."""
    from ray.data._internal.execution.backpressure_policy.backpressure_policy import (
        BackpressurePolicy,
    )

    class RunAheadPolicy(BackpressurePolicy):
        """Ray Data backpressure from :class:`RunAhead`, for the operators of a pipeline
        whose context :func:`bound_pipeline` configured."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Read once: Ray Data asks every operator at each step of its scheduling loop.
            budget = self._data_context.get_config(BUDGET_KEY, None)
            self._bound = None if budget is None else RunAhead(
                budget, self._data_context.get_config(TASK_KEY, 0))

        @property
        def name(self) -> str:
            return "LanceRayRunAhead"

        def can_add_input(self, op: Any) -> bool:
            bound = self._bound
            if bound is None:
                return True
            metrics = op.metrics
            manager = self._resource_manager
            queued = manager.get_mem_op_outputs(op, include_ineligible_downstream=True)
            if not op.output_dependencies:  # the last stage: count the iterator's buffer
                queued += manager.get_external_consumer_bytes()
            return bound.admits(metrics.num_tasks_running, queued,
                                int(metrics.obj_store_mem_max_pending_output_per_task or 0))

    return RunAheadPolicy
