"""A :class:`~lance_ray.view.mixture.MixtureDataset` attached to a mixture coordinator.

Each source's view attaches to that source's own coordinator (``Coordinator.create`` over a
mixture makes one per source), which builds the source's plan once per pass and serves each
view only its own splits, and whose resize marks the view stale. The mixture's progress is
one object, so it goes to the mixture coordinator, not to the sources' coordinators: the
rank sends its whole mixture state (what ``state_dict()`` returns) at global steps every
rank reaches (every ``every_batches`` steps, each phase's end, each new epoch and each
checkpoint), and the coordinator seals a step once every rank sent it, by
``merge_state_dicts`` of those states: the checkpoint route's own merge.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

from ..coordinator.client import (
    DEFAULT_NAMESPACE,
    CoordinatorPlans,
    find_coordinator,
    find_in_process,
    make_durable,
)
from ..coordinator.mixture import PENDING_STEPS
from ..plan.sources import ray_is_up
from ..state.mixture import MixtureRun
from ..state.reporting import ReportPolicy
from ..topology import Topology

if TYPE_CHECKING:
    from .dataset import StreamingDataset

# What a mixture's views refuse: a mixture's transform must not drop rows, and packing
# belongs to the coordinator's run.
REFUSED = ("on_transform_error", "fill_value", "pack_sequences", "eos_id", "pad_id",
           "blocks_per_epoch", "pack_position_ids", "pack_cu_seqlens")


def _ray() -> Any:
    import ray

    return ray


class SourcePlans(CoordinatorPlans):
    """The plan source of one source's view in an attached mixture: its part of each pass's
    plan, and the stale check, come from the source's coordinator. Its progress is part of
    the mixture's (reported by the mixture), so the view reports nothing itself, and a new
    pass (``set_epoch``) stays the view's own: ranks enter passes at their own pace."""

    wants_reports = False

    @classmethod
    def of(cls, attached: CoordinatorPlans) -> SourcePlans:
        """The same attachment (handle, address, generation watch) without the reports."""
        plans = cls(attached.handle, attached.policy, attached.address)
        plans._watch, plans._world_size = attached._watch, attached._world_size
        return plans

    def report(self, report: Any, *, final: bool = False) -> None:
        return None

    def flush(self, *, wait: bool = True) -> None:
        return None

    def set_epoch(self, epoch: int) -> None:
        return None


class MixtureLink:
    """A mixture view's calls to its coordinator: where it starts, and its reports (fire
    and forget, at most ``max_in_flight`` unanswered; a checkpoint waits for all)."""

    def __init__(self, address: tuple[str, str], run: MixtureRun, policy: ReportPolicy,
                 handle: Any = None):
        self.address, self.run, self.policy = address, run, policy
        self._handle = handle  # found again where it is used (see find_in_process)
        self._in_flight: deque[Any] = deque()
        # States sent since the last checkpoint, and the coordinator's incarnation that made
        # the last one durable: one Ray restarted in between may have lost some it had
        # acknowledged, and they go again (recording a state twice changes nothing).
        self._unconfirmed: deque[dict[str, Any]] = deque(maxlen=PENDING_STEPS)
        self._incarnation: str | None = None

    @classmethod
    def connect(cls, name: str, namespace: str) -> MixtureLink:
        handle = find_coordinator(name, namespace)
        run = _ray().get(handle.describe.remote())
        if not isinstance(run, MixtureRun):
            raise ValueError(f"coordinator {name!r} reads one table, not a mixture: attach "
                             "with StreamingDataset.from_coordinator (or Coordinator.view)")
        return cls((name, namespace), run,
                   ReportPolicy(**_ray().get(handle.report_policy.remote())), handle)

    @property
    def handle(self) -> Any:
        if self._handle is None:
            self._handle = find_in_process(self.address, "the mixture's progress")
        return self._handle

    def start(self, topology: Topology) -> tuple[dict[str, Any] | None, int]:
        """The sealed state a new view starts from (None: the start of the epoch), and the
        epoch; a new world size resizes the run (and its sources) first."""
        state, epoch, self._incarnation = _ray().get(self.handle.attach.remote(topology))
        return state, epoch

    def due(self, global_step: int, at_end: bool) -> bool:
        """Whether the state after ``global_step`` is sent: a step every rank of a lockstep
        run reaches and sends, so that it can seal."""
        return at_end or global_step % self.policy.every_batches == 0

    def report(self, state: dict[str, Any], *, wait: bool = False) -> None:
        """Send this rank's ``state``; ``wait``: until every report so far is recorded."""
        ray = _ray()
        if not ray_is_up():  # an actor call would start a new local Ray
            raise RuntimeError("Ray is not connected: progress reports cannot reach the "
                               "coordinator (was ray.shutdown() called with a view live?)")
        while len(self._in_flight) >= self.policy.max_in_flight:
            ray.get(self._in_flight.popleft())  # back-pressure; raises a refused report
        self._in_flight.append(self.handle.report.remote(state))
        self._unconfirmed.append(state)
        if wait:  # a checkpoint: recorded, and durable
            self.flush()
            held = list(self._unconfirmed)  # what the write below holds (all recorded)
            self._incarnation = make_durable(
                self.handle, self._incarnation,
                lambda: ray.get([self.handle.report.remote(s) for s in held]))
            for state in held:  # (one another thread sent meanwhile stays unconfirmed)
                if self._unconfirmed and self._unconfirmed[0] is state:
                    self._unconfirmed.popleft()

    def flush(self) -> None:
        while self._in_flight:
            _ray().get(self._in_flight.popleft())

    def set_epoch(self, epoch: int) -> None:
        self.flush()
        _ray().get(self.handle.set_epoch.remote(epoch))

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "run": self.run, "policy": self.policy,
                "incarnation": self._incarnation}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["address"], state["run"], state["policy"])  # type: ignore[misc]
        self._incarnation = state.get("incarnation")


class Attached(NamedTuple):
    """What a mixture's view starts from: its sources' views, its coordinator's link, the
    sealed state (None: the start of the epoch) and the epoch."""

    views: list[StreamingDataset]
    link: MixtureLink
    state: dict[str, Any] | None
    epoch: int


def attach(name: str, *, rank: int, world_size: int, namespace: str = DEFAULT_NAMESPACE,
           **view_kwargs: Any) -> Attached:
    """What ``MixtureDataset.from_coordinator`` (see there) builds its view over."""
    from .dataset import StreamingDataset

    refused = sorted(set(REFUSED) & set(view_kwargs))
    if refused:
        raise ValueError(f"a mixture's view does not take {refused}: its transform must not "
                         "drop rows, and packing belongs to the run (Coordinator.create)")
    link = MixtureLink.connect(name, namespace)
    pack = link.run.pack
    # A packed run's sources read their token column, which the mixture packs.
    if pack is not None and (view_kwargs.get("transform") is not None or view_kwargs.setdefault(
            "columns", [pack["column"]]) != [pack["column"]]):
        raise ValueError(f"coordinator {name!r} packs the token column {pack['column']!r}: "
                         "its views take no columns or transform")
    topology = Topology(rank, world_size)
    state, epoch = link.start(topology)  # resizes the sources' coordinators if needed

    def view(source: str) -> StreamingDataset:
        v = StreamingDataset.from_coordinator(source, rank=rank, world_size=world_size,
                                              namespace=namespace, **view_kwargs)
        v._plans = SourcePlans.of(v._plans)  # type: ignore[arg-type]
        return v

    sources: Sequence[str] = link.run.sources
    with ThreadPoolExecutor(len(sources), thread_name_prefix="mixture-attach") as pool:
        views = list(pool.map(view, sources))
    return Attached(views, link, state, epoch)
