"""Where a view gets its part of the plan, and where its progress goes.

``LocalPlans`` builds the plan in the view's own process (like the reference);
``RayTaskPlans`` builds it in a Ray task (when Ray is up), so the trainer holds only its
own splits;
``CoordinatorPlans`` asks the coordinator actor, which builds it once per epoch.
Local and Ray-task sources build the next epoch's plan in the background as soon as an
epoch's plan is handed over, so no epoch after the first waits for its plan.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from ..state import ledger as lg
from ..state.reporting import Reporter, ReportPolicy
from ..topology import Topology
from .background import BackgroundPlans
from .generation import GenerationWatch, publish
from .index import build_index_plan
from .splits import PlanSpec, SplitPlan, build_plan, check_epoch_seed
from .table import TableRef

DEFAULT_NAMESPACE = "lance_ray"
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

    def check_current(self, *, rows: bool = False) -> None:
        """Raise ``StaleReport`` if the plan this view reads was replaced (a coordinator's
        resize); called before each delivery (``rows``: a per-sample one), so it is cheap."""
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
        part = self.plans.get((spec, tuple(owned)))
        upcoming = next_epoch(spec)
        if upcoming is not None and self.table.plans_ahead:
            self.plans.prefetch((upcoming, tuple(owned)))
        return part

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

    def check_current(self, *, rows: bool = False) -> None:
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


def _ray() -> Any:
    """Ray, imported where a coordinator is used: a view without one (no cluster connected)
    never pays for importing it (seconds of a cold start)."""
    import ray

    return ray


def ray_is_up() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def find_in_process(address: tuple[str, str], what: str) -> Any:
    """The handle of the coordinator at ``address`` (name, namespace), found again in this
    process. Handles travel as names: a DataLoader worker is not connected to Ray and
    cannot unpickle an actor handle, and it never needs one unless it calls the actor."""
    if not ray_is_up():
        raise RuntimeError(
            f"this process (a DataLoader worker?) needs the coordinator {address[0]!r} for "
            f"{what} but is not connected to Ray; read the view with num_workers=0")
    return find_coordinator(*address)


def find_coordinator(name: str, namespace: str) -> Any:
    """The handle of the live coordinator actor ``name`` in ``namespace``."""
    try:
        return _ray().get_actor(name, namespace=namespace)
    except ValueError as e:
        raise ValueError(
            f"no coordinator named {name!r} in namespace {namespace!r}; create it with "
            "Coordinator.create() in the job driver first"
        ) from e


class _ActorChannel:
    """Report batches go to the coordinator actor, fire and forget."""

    def __init__(self, handle: Any):
        self.handle = handle

    def send(self, batch: lg.ReportBatch) -> Any:
        # An actor call auto-starts Ray when it is down: the reports' background thread
        # must never start a new local Ray after the driver shut its own down.
        if not ray_is_up():
            raise RuntimeError("Ray is not connected: progress reports cannot reach the "
                               "coordinator (was ray.shutdown() called with a view live?)")
        return self.handle.report_batch.remote(batch)

    def finished(self, replies: list[Any]) -> list[Any]:
        return _ray().wait(replies, num_returns=len(replies), timeout=0)[0]

    def result(self, reply: Any) -> Any:
        return _ray().get(reply)


class CoordinatorPlans:
    """The ``PlanSource`` of a view attached to a coordinator.

    Progress reports are coalesced by a :class:`~lance_ray.state.reporting.Reporter` under the
    coordinator's report policy; a checkpoint (``flush``) and a new epoch first wait until
    the coordinator has every report sent so far.
    """

    wants_reports = True

    def __init__(self, handle: Any, policy: ReportPolicy | None = None,
                 address: tuple[str, str] | None = None):
        self._handle, self.address = handle, address  # (name, namespace)
        self.policy = policy or ReportPolicy()
        self._reporter = Reporter(_ActorChannel(handle), self.policy)
        self._watch: GenerationWatch | None = None  # set when the view attaches
        self._world_size: int | None = None

    @property
    def handle(self) -> Any:
        """The coordinator's actor handle (found by name where the view was unpickled)."""
        if self._handle is None:
            assert self.address is not None, "a CoordinatorPlans has a handle or an address"
            self._handle = find_in_process(self.address, "its plan or progress")
            self._reporter = Reporter(_ActorChannel(self._handle), self.policy)
        return self._handle

    @classmethod
    def connect(cls, name: str, namespace: str) -> CoordinatorPlans:
        handle = find_coordinator(name, namespace)
        return cls(handle, ReportPolicy(**_ray().get(handle.report_policy.remote())),
                   (name, namespace))

    def describe(self) -> tuple[TableRef, PlanSpec]:
        return _ray().get(self.handle.describe.remote())

    def packing(self) -> Any:
        """The run's ``PackOptions``, or None when it does not pack sequences."""
        return _ray().get(self.handle.packing.remote())

    def pack_budget(self, epoch: int) -> int | None:
        return _ray().get(self.handle.pack_budget.remote(epoch))

    def start(self, topology: Topology) -> dict[str, Any]:
        """The state a new view of ``topology`` starts from (the coordinator may resize);
        from now on the view watches the coordinator's generation on this node."""
        ray = _ray()
        node = ray.get_runtime_context().get_node_id()
        state, generation, name = ray.get(self.handle.attach.remote(topology, node))
        publish(name, generation)  # never lowers it: a resize since attach stays visible
        self._watch = GenerationWatch(name, generation)
        self._world_size = topology.world_size
        return state

    def check_current(self, *, rows: bool = False) -> None:
        watch = self._watch
        seen = None if watch is None else watch.newer(rows=rows)
        if watch is not None and seen is not None:
            raise lg.StaleReport(
                f"the coordinator was resized since this view of world size "
                f"{self._world_size} attached (generation {seen}, the view's "
                f"{watch.generation}): this view is stale and stops here, before "
                "handing out another batch; create the views of the new world size "
                "(Coordinator.view / StreamingDataset.from_coordinator)")

    def part(self, spec: PlanSpec, owned: Sequence[int]) -> SplitPlan:
        return _ray().get(self.handle.plan_part.remote(spec.epoch, owned[0], len(owned)))

    def report(self, report: lg.RankReport, *, final: bool = False) -> None:
        if self._handle is None:
            self.handle  # noqa: B018 -- found now, with its reporter
        self._reporter.add(report, final=final)

    def flush(self, *, wait: bool = True) -> None:
        """Send the buffered reports; with ``wait``, until every report is acknowledged
        (nothing to do before the handle is found: nothing was reported)."""
        if self._handle is not None:
            self._reporter.flush(wait=wait)

    def set_epoch(self, epoch: int) -> None:
        self.flush(wait=True)  # the old epoch's last steps seal before it ends
        _ray().get(self.handle.set_epoch.remote(epoch))

    def __getstate__(self) -> dict[str, Any]:
        # With an address the handle travels as its name (see find_in_process).
        return {"handle": None if self.address else self._handle, "address": self.address,
                "policy": self.policy, "watch": self._watch, "world_size": self._world_size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["handle"], state["policy"],  # type: ignore[misc]
                      state.get("address"))
        self._watch, self._world_size = state.get("watch"), state.get("world_size")
