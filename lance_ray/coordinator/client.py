"""The client side of the coordinator's wire protocol: how a view finds a coordinator actor,
gets its part of the plan, watches for resizes and reports its progress (the server side is
``actor``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..plan.generation import GenerationWatch, publish
from ..plan.sources import ray_is_up
from ..plan.splits import PlanSpec, SplitPlan
from ..plan.table import TableRef
from ..state import ledger as lg
from ..state.reporting import Reporter, ReportPolicy
from ..topology import Topology

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "lance_ray"


def refuse_sample_reads() -> None:
    """Refuse to read an attached view one sample at a time. A coordinator seals progress
    per global step, a batch that every rank sends; samples read one by one make no step,
    so it would never hear of them and a resize or restart would deliver them again."""
    raise RuntimeError(
        "this view is attached to a coordinator, which records progress per global step (a "
        "batch): samples read one by one (iter(view), or a torch DataLoader over it) would "
        "never reach it, and a resize or restart would deliver them again; read it with "
        "view.iter_batches(batch_size) or lance_ray.StreamingDataLoader(view, "
        "batch_size=...)")


def _ray() -> Any:
    """Ray, imported where a coordinator is used: a view without one (no cluster connected)
    never pays for importing it (seconds of a cold start)."""
    import ray

    return ray


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


def constructed(handle: Any, call: Any, name: str, namespace: str) -> Any:
    """``ray.get(call)``, the first call to the coordinator actor ``handle`` just made. Ray
    reports an error in its constructor as the actor's death: it is raised as the
    ``ValueError`` it was, once the actor is gone for good (it would otherwise restart, and
    fail, for as long as a handle lives) and its name is free for the next create."""
    ray = _ray()
    try:
        return ray.get(call)
    except ray.exceptions.RayActorError as e:
        if not getattr(e, "actor_init_failed", False):
            raise
        ray.kill(handle, no_restart=True)
        wait_name_free(name, namespace)
        said = [line for line in str(e).splitlines() if line.startswith("ValueError: ")]
        if said:
            raise ValueError(said[-1].removeprefix("ValueError: ")) from None
        raise


def make_durable(handle: Any, incarnation: str | None, resend: Callable[[], None]) -> str:
    """Have the coordinator actor ``handle`` make every report it recorded durable; returns
    the incarnation that did. Where that is not ``incarnation`` (the one that acknowledged
    the caller's reports; None: unknown), Ray restarted the actor in between: it recovered
    its last write, and reports acknowledged after that are gone, so ``resend`` sends them
    again (recording a report twice changes nothing) and the write is asked for again."""
    while True:
        now: str = _ray().get(handle.persist_recorded.remote())
        if incarnation is None or now == incarnation:
            return now
        logger.warning("the coordinator was restarted: sending this view's reports since its "
                       "last checkpoint again")
        incarnation = now
        resend()


def wait_name_free(name: str, namespace: str, timeout_s: float = 10.0) -> None:
    """Return once no actor is named ``name`` (a dead one's name is freed shortly after)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _ray().get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.05)
    logger.warning("the name of dead coordinator %r is still taken after %.0f s", name,
                   timeout_s)


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
        # The coordinator actor's incarnation that last made this view's reports durable
        # (or that it attached to): another one means Ray restarted it in between.
        self._incarnation: str | None = None

    @property
    def handle(self) -> Any:
        """The coordinator's actor handle (found by name where the view was unpickled)."""
        if self._handle is None:
            assert self.address is not None, "a CoordinatorPlans has a handle or an address"
            self._handle = find_in_process(self.address, "its plan or progress")
            self._reporter = Reporter(_ActorChannel(self._handle), self.policy)
            self._reporter.generation = None if self._watch is None else self._watch.generation
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
        state, generation, name, self._incarnation = ray.get(
            self.handle.attach.remote(topology, node))
        self._reporter.generation = generation  # its reports name it (see report_batch)
        publish(name, generation)  # never lowers it: a resize since attach stays visible
        self._watch = GenerationWatch(name, generation)
        self._world_size = topology.world_size
        return state

    def check_current(self) -> None:
        watch = self._watch
        seen = None if watch is None else watch.newer()
        if watch is not None and seen is not None:
            raise lg.StaleReport(
                f"the coordinator was resized since this view of world size "
                f"{self._world_size} attached, or a checkpoint was restored (generation "
                f"{seen}, the view's {watch.generation}): this view is stale and stops here, "
                "before handing out another batch; create the views of the new world size "
                "(Coordinator.view / StreamingDataset.from_coordinator)")

    def part(self, spec: PlanSpec, owned: Sequence[int]) -> SplitPlan:
        return _ray().get(self.handle.plan_part.remote(spec.epoch, owned[0], len(owned)))

    def ahead(self, spec: PlanSpec, owned: Sequence[int]) -> None:
        return None  # the coordinator builds its next plan ahead itself

    def report(self, report: lg.RankReport, *, final: bool = False) -> None:
        if self._handle is None:
            self.handle  # noqa: B018 -- found now, with its reporter
        self._reporter.add(report, final=final)

    def flush(self, *, wait: bool = True) -> None:
        """Send the buffered reports; with ``wait``, until every report is recorded and
        durable (a checkpoint's; nothing to do before the handle is found: nothing was
        reported)."""
        if self._handle is None:
            return
        self._reporter.flush(wait=wait)
        if not wait:
            return
        sent = self._reporter.sent  # what the write below holds (all acknowledged)
        self._incarnation = make_durable(self._handle, self._incarnation, self._reporter.resend)
        self._reporter.confirm(sent)

    def set_epoch(self, epoch: int) -> None:
        self.check_current()  # a stale view never moves the live views' epoch
        self.flush(wait=True)  # the old epoch's last steps seal before it ends
        generation = None if self._watch is None else self._watch.generation
        _ray().get(self.handle.set_epoch.remote(epoch, generation))

    def __getstate__(self) -> dict[str, Any]:
        # With an address the handle travels as its name (see find_in_process).
        return {"handle": None if self.address else self._handle, "address": self.address,
                "policy": self.policy, "watch": self._watch, "world_size": self._world_size,
                "incarnation": self._incarnation}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["handle"], state["policy"],  # type: ignore[misc]
                      state.get("address"))
        self._watch, self._world_size = state.get("watch"), state.get("world_size")
        self._incarnation = state.get("incarnation")
        self._reporter.generation = None if self._watch is None else self._watch.generation
