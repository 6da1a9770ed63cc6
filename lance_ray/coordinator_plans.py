"""The plan source of a view attached to a coordinator: its plan part, its reports.

Kept apart from the actor (``coordinator.py``): this side runs in the trainer processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from . import ledger as lg
from . import state as st
from .plan import PlanSpec, SplitPlan
from .reporting import Reporter, ReportPolicy
from .table import TableRef


class _ActorChannel:
    """Report batches go to the coordinator actor, fire and forget."""

    def __init__(self, handle: Any):
        self.handle = handle

    def send(self, batch: lg.ReportBatch) -> Any:
        return self.handle.report_batch.remote(batch.rank, batch.world_size, batch.epoch,
                                               batch.steps, batch.samples, batch.positions)

    def finished(self, replies: list[Any]) -> list[Any]:
        return ray.wait(replies, num_returns=len(replies), timeout=0)[0]

    def result(self, reply: Any) -> Any:
        return ray.get(reply)


class CoordinatorPlans:
    """The ``PlanSource`` of a view attached to a coordinator.

    Progress reports are coalesced by a :class:`~lance_ray.reporting.Reporter` under the
    coordinator's report policy; a checkpoint (``flush``) and a new epoch first wait until
    the coordinator has every report sent so far.
    """

    wants_reports = True

    def __init__(self, handle: Any, policy: ReportPolicy | None = None):
        self.handle = handle
        self.policy = policy or ReportPolicy()
        self._reporter = Reporter(_ActorChannel(handle), self.policy)

    @classmethod
    def connect(cls, name: str, namespace: str) -> CoordinatorPlans:
        from .coordinator import Coordinator  # the actor's module imports this one's users

        handle = Coordinator.get(name, namespace).handle
        return cls(handle, ReportPolicy(**ray.get(handle.report_policy.remote())))

    def describe(self) -> tuple[TableRef, PlanSpec]:
        return ray.get(self.handle.describe.remote())

    def start(self, rank: int, world_size: int) -> dict[str, Any]:
        return ray.get(self.handle.start.remote(rank, world_size))

    def part(self, spec: PlanSpec, owned: Sequence[int]) -> tuple[SplitPlan, st.PlanIdentity]:
        return ray.get(self.handle.plan_part.remote(spec.epoch, owned[0], len(owned)))

    def report(self, rank: int, world_size: int, epoch: int, step: int,
               samples: Sequence[int], positions: Sequence[int], *, final: bool = False) -> None:
        self._reporter.add(rank, world_size, epoch, step, samples, positions, final=final)

    def flush(self, *, wait: bool = True) -> None:
        """Send the buffered reports; with ``wait``, until every report is acknowledged."""
        self._reporter.flush(wait=wait)

    def set_epoch(self, epoch: int) -> None:
        self._reporter.flush(wait=True)  # the old epoch's last steps seal before it ends
        ray.get(self.handle.set_epoch.remote(epoch))

    def __getstate__(self) -> dict[str, Any]:
        return {"handle": self.handle, "policy": self.policy}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["handle"], state["policy"])  # type: ignore[misc]
