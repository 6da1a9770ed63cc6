"""The coordinator: a named Ray actor holding the split plan and the merged progress.

It builds each epoch's plan once and serves every view only its own splits; it seals the
progress of a global step once every rank has reported it, so a checkpoint is one
consistent object; it persists sealed progress atomically (JSON) so that a restarted actor
loses at most the last ``PERSIST_EVERY_S`` of seals and never a checkpoint's; and ``resize``
redistributes the splits over a new world size.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import asdict
from typing import Any

import ray

from .. import storage
from ..plan.background import BackgroundPlans
from ..plan.remote import is_remote_table
from ..plan.resolve import resolve_plan
from ..plan.sources import DEFAULT_NAMESPACE, find_coordinator, next_epoch, plan_for
from ..plan.splits import PlanSpec, SplitPlan
from ..plan.table import (
    StorageOptionsFactory,
    TableRef,
    release_lease,
    take_lease,
)
from ..state import format as st
from ..state import ledger as lg
from ..state.reporting import ReportPolicy
from ..topology import Topology, splits_per_rank
from ..view.dataset import StreamingDataset
from .throttle import Throttled

logger = logging.getLogger(__name__)

PERSIST_FORMAT = 1
PLANS_CACHED = 2  # epochs whose plan stays in memory (current and next)
# Seals are written at most this often (the last one at most this late): with many ranks
# out of phase nearly every report call seals a step, and a write can cost milliseconds
# (more on object storage). A checkpoint (state_dict) and kill() write at once.
PERSIST_EVERY_S = 0.2


def _sealed_to_json(s: lg.Sealed | None) -> dict | None:
    return None if s is None else {**asdict(s), "samples": list(s.samples),
                                   "positions": list(s.positions)}


def _sealed_from_json(d: dict | None) -> lg.Sealed | None:
    if d is None:
        return None
    return lg.Sealed(d["epoch"], d["step"], d["world_size"], tuple(d["samples"]),
                     tuple(d["positions"]))


class CoordinatorActor:
    """The actor body. Use :class:`Coordinator` to create or find one."""

    def __init__(self, name: str, table: TableRef, spec: dict[str, Any], rows: int,
                 world_size: int, storage_path: str,
                 storage_retry: storage.RetryPolicy | None = None,
                 report_policy: dict[str, Any] | None = None):
        self._name = name
        self._report_policy = ReportPolicy(**(report_policy or {}))
        self._table = table
        self._spec = PlanSpec(**spec)
        self._rows = rows
        # I/O: one JSON object under a path or URI, with the table's storage options.
        self._path = storage.join(storage_path, name, "coordinator.json")
        self._io: dict[str, Any] = {"storage_options": table.storage_options,
                                    "retry": storage_retry}
        self._lock = threading.RLock()
        self._plans: BackgroundPlans[int, SplitPlan] = BackgroundPlans(
            lambda e: plan_for(table, self._spec.for_epoch(e), rows), keep=PLANS_CACHED,
            name=f"coordinator {name}: the plan of epoch")
        self._history = lg.History()  # sealed steps kept for state_dict(step=...)
        self._rank_progress: dict[int, tuple[int, int]] = {}  # rank -> (step, rows)
        self._seal_times: deque[tuple[float, int]] = deque(maxlen=64)
        self._write_seal = Throttled(lambda: self._persist(durable=False), PERSIST_EVERY_S,
                                     self._lock)
        self._ledger = self._recover() or lg.Ledger(self._spec.num_splits, world_size,
                                                    self._spec.epoch)
        self._persist(durable=True)

    # ----------------------------------------------------------------- durability

    def _config(self) -> dict[str, Any]:
        return {"uri": self._table.uri, "spec": {**self._spec.config(), "epoch": 0}}

    def _recover(self) -> lg.Ledger | None:
        if not storage.exists(self._path, **self._io):
            return None
        saved = storage.read_json(self._path, **self._io)
        if saved.get("format_version") != PERSIST_FORMAT or saved.get("config") != self._config():
            raise ValueError(
                f"{self._path} holds coordinator {self._name!r} of a different table or plan; "
                "use another coordinator name or storage_path"
            )
        led = saved["ledger"]
        ledger = lg.Ledger(led["num_splits"], led["world_size"], led["epoch"],
                           _sealed_from_json(led["sealed"]))
        if ledger.sealed is not None:
            self._history.add(ledger.sealed)
        logger.info("coordinator %s recovered epoch %d, sealed step %s from %s", self._name,
                    ledger.epoch, ledger.sealed and ledger.sealed.step, self._path)
        return ledger

    def _persist(self, *, durable: bool) -> None:
        """Write the ledger (seals through ``_write_seal``); ``durable`` adds an fsync, for
        states handed out as checkpoints."""
        led = self._ledger
        storage.write_json_atomic(self._path, {
            "format_version": PERSIST_FORMAT,
            "config": self._config(),
            "ledger": {"num_splits": led.num_splits, "world_size": led.world_size,
                       "epoch": led.epoch, "sealed": _sealed_to_json(led.sealed)},
        }, fsync=durable, **self._io)

    def persist(self) -> None:
        """Write the sealed progress now, durably (before a planned stop)."""
        with self._lock:
            self._persist(durable=True)

    # ----------------------------------------------------------------- plan

    def describe(self) -> tuple[TableRef, PlanSpec]:
        with self._lock:
            return self._table, self._spec.for_epoch(self._ledger.epoch)

    def _plan(self, epoch: int) -> SplitPlan:
        """Epoch ``epoch``'s plan; the next epoch's then starts building in the background."""
        plan = self._plans.get(epoch)
        if next_epoch(self._spec.for_epoch(epoch)) is not None:
            self._plans.prefetch(epoch + 1)
        return plan

    def plan_part(self, epoch: int, first: int, count: int) -> SplitPlan:
        return self._plan(epoch).splits(first, count)

    def _state(self, sealed: lg.Sealed) -> dict[str, Any]:
        return st.make_state(self._plan(sealed.epoch).identity(), list(sealed.samples),
                             list(sealed.positions), world_size=sealed.world_size, rank=None,
                             global_step=sealed.step)

    # ----------------------------------------------------------------- progress

    def start(self, topology: Topology) -> dict[str, Any]:
        """The state a new view of ``topology`` starts from (resizing if needed)."""
        rank, world_size = topology.rank, topology.world_size
        with self._lock:
            if world_size != self._ledger.world_size:
                if self._rank_progress:
                    # Live views of the current size have reported since the last restore:
                    # this view is stale (or early); silently resizing would strand them.
                    raise ValueError(
                        f"views of world size {self._ledger.world_size} are live; a view of "
                        f"world size {world_size} may start only after resize({world_size}) "
                        "or after restoring a checkpoint (load_state_dict)"
                    )
                logger.info("coordinator %s: views of world size %d arrived; resizing from %d",
                            self._name, world_size, self._ledger.world_size)
                self.resize(world_size)
            if not 0 <= rank < world_size:
                raise ValueError(f"rank ({rank}) must be in [0, {world_size})")
            return self._state(self._ledger.start())

    def report_policy(self) -> dict[str, Any]:
        """When views send their progress (see :mod:`lance_ray.state.reporting`)."""
        return asdict(self._report_policy)

    def report_batch(self, batch: lg.ReportBatch) -> int | None:
        """Record a rank's progress at several steps (a coalesced report); returns the
        newest step it sealed, if any."""
        rank, epoch, steps, samples = batch.rank, batch.epoch, batch.steps, batch.samples
        with self._lock:
            sealed = lg.record_batch(self._ledger, batch)
            if steps and epoch == self._ledger.epoch:
                newest = max(range(len(steps)), key=steps.__getitem__)
                if steps[newest] > self._rank_progress.get(rank, (-1, 0))[0]:  # may overtake
                    self._rank_progress[rank] = (steps[newest], sum(samples[newest]))
            if not sealed:
                return None
            now = time.monotonic()
            for s in sealed:
                self._history.add(s)
                self._seal_times.append((now, sum(s.samples)))
            self._write_seal.request()
            return sealed[-1].step

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The merged state of the latest sealed step (or of ``step``), made durable first."""
        with self._lock:
            sealed = self._ledger.start() if step is None else \
                self._history.get(self._ledger.epoch, step)
            self._persist(durable=True)
            return self._state(sealed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make ``state`` (a merged checkpoint of this plan) the starting point of all views."""
        progress = st.parse_state(state)
        with self._lock:
            epoch = state["epoch"]
            st.check_compatible(state, self._plan(epoch).identity())
            if not progress.is_complete:
                raise ValueError(
                    "the coordinator needs a merged state covering every split; merge the "
                    "ranks' states with merge_state_dicts() first"
                )
            lg.restore(self._ledger, lg.Sealed(epoch, progress.global_step or 0,
                                               self._ledger.world_size, progress.samples,
                                               progress.positions))
            self._rank_progress.clear()  # the views before the restore are gone
            self._persist(durable=True)

    def initial_state(self) -> dict[str, Any]:
        """Zero progress at the epoch the coordinator was created for."""
        zeros = (0,) * self._spec.num_splits
        return self._state(lg.Sealed(self._spec.epoch, 0, self._ledger.world_size, zeros, zeros))

    def resize(self, world_size: int) -> dict[str, Any]:
        with self._lock:
            sealed = lg.resize(self._ledger, world_size)
            self._rank_progress.clear()
            self._persist(durable=True)
            return self._state(sealed)

    def set_epoch(self, epoch: int) -> None:
        with self._lock:
            if epoch != self._ledger.epoch:
                lg.advance_epoch(self._ledger, epoch)
                self._rank_progress.clear()
                self._persist(durable=True)

    def status(self) -> dict[str, Any]:
        with self._lock:
            led = self._ledger
            rate = 0.0
            if len(self._seal_times) >= 2:
                (t0, r0), (t1, r1) = self._seal_times[0], self._seal_times[-1]
                rate = (r1 - r0) / (t1 - t0) if t1 > t0 else 0.0
            start = led.start()
            return {
                "name": self._name, "epoch": led.epoch, "world_size": led.world_size,
                "num_splits": led.num_splits, "sealed_step": start.step,
                "sealed_rows": sum(start.samples),
                "epoch_rows": None if (p := self._plans.ready(led.epoch)) is None
                else p.split_len * led.num_splits,
                "rows_per_s": rate,
                "ranks": {r: {"step": s, "rows": n} for r, (s, n) in
                          sorted(self._rank_progress.items())},
                "pending_steps": sorted(led.pending),
                "plans_ready": [e for e in (led.epoch, led.epoch + 1) if self._plans.ready(e)],
                "report_policy": asdict(self._report_policy),
                "table_version": self._table.version,
                "pid": os.getpid(),
            }


_ACTOR_OPTIONS = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": -1,
                  "max_concurrency": 4}


class Coordinator:
    """Driver-side handle of a coordinator actor."""

    def __init__(self, handle: Any, name: str, namespace: str):
        self.handle, self.name, self.namespace = handle, name, namespace

    @classmethod
    def create(
        cls,
        table: Any,
        name: str,
        *,
        storage_path: str,
        world_size: int,
        num_splits: int | None = None,
        shuffle: bool = True,
        shuffle_seed: int | None = 0,
        epoch: int = 0,
        shuffle_clump_size: int | None = None,
        filter: str | None = None,
        table_version: int | None = None,
        storage_options: StorageOptionsFactory | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        detached: bool = False,
        lease_version: bool = True,
        plan: str = "lancedb",
        storage_retry: storage.RetryPolicy | None = None,
        report_policy: ReportPolicy | None = None,
    ) -> Coordinator:
        """Create the coordinator ``name`` (or attach to the live one of that name).

        Call this from the job driver (or pass ``detached=True`` so it outlives the job),
        never from a train worker: a non-detached actor dies with its creator.
        ``storage_path`` (a shared path or an ``s3://``/``gs://``/``az://`` URI) must be
        reachable from every node; sealed progress is kept there (``storage_retry``: how long
        writes retry while the store is down before failing).
        Keep the returned handle alive while the run needs the actor: a non-detached actor
        is stopped when its last handle goes away. With ``lease_version`` the pinned table
        version is tagged so that version cleanup cannot remove it while the run needs it;
        :meth:`release_version` drops the tag when the run is over. ``plan`` is the plan
        mode, as in ``StreamingDataset`` (``"index"`` past lancedb's builder limit).
        ``report_policy`` says how often views send their progress (default: every 100
        batches or 0.5 s, 2 s at 1,024 ranks, and at every checkpoint and epoch end); the
        status lags each rank by about that much.
        """
        if is_remote_table(table):
            raise ValueError(
                "the coordinator needs a Lance dataset (a local or object-store table), not a "
                "remote LanceDB table: read it with StreamingDataset(table, "
                "connection_factory=...) on every rank instead"
            )
        if not detached and ray.get_runtime_context().get_actor_id() is not None:
            raise RuntimeError(
                "create the coordinator in the job driver (or with detached=True), not inside "
                "an actor or train worker: it would die with that worker"
            )
        num_splits = world_size if num_splits is None else num_splits
        splits_per_rank(num_splits, world_size)
        storage.resolve(storage_path, storage_options)  # an unknown scheme fails here
        resolved = resolve_plan(table, num_splits=num_splits, shuffle=shuffle,
                                shuffle_seed=shuffle_seed, epoch=epoch,
                                shuffle_clump_size=shuffle_clump_size, filter=filter, plan=plan,
                                table_version=table_version, storage_options=storage_options)
        ref, spec, rows = resolved.table, resolved.spec, resolved.rows
        if lease_version:
            take_lease(ref, name)
        options = {**_ACTOR_OPTIONS, "name": name, "namespace": namespace,
                   "get_if_exists": True, "lifetime": "detached" if detached else None}
        handle: Any = ray.remote(CoordinatorActor).options(**options).remote(
            name, ref, asdict(spec), rows, world_size, storage.absolute(storage_path),
            storage_retry, asdict(report_policy or ReportPolicy()))
        ray.get(handle.describe.remote())  # surface construction errors here
        return cls(handle, name, namespace)

    @classmethod
    def get(cls, name: str, namespace: str = DEFAULT_NAMESPACE) -> Coordinator:
        """Find the live coordinator ``name`` in ``namespace``."""
        return cls(find_coordinator(name, namespace), name, namespace)

    def view(self, rank: int, world_size: int, **kwargs: Any) -> Any:
        """A ``StreamingDataset`` for ``(rank, world_size)`` attached to this coordinator."""
        return StreamingDataset.from_coordinator(self.name, rank=rank, world_size=world_size,
                                                 namespace=self.namespace, **kwargs)

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        return ray.get(self.handle.state_dict.remote(step))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ray.get(self.handle.load_state_dict.remote(state))

    def initial_state(self) -> dict[str, Any]:
        """The state of a run that starts from scratch (zero progress, creation epoch)."""
        return ray.get(self.handle.initial_state.remote())

    def resize(self, world_size: int) -> dict[str, Any]:
        """Redistribute the splits over ``world_size`` ranks from the latest sealed step."""
        return ray.get(self.handle.resize.remote(world_size))

    def set_epoch(self, epoch: int) -> None:
        ray.get(self.handle.set_epoch.remote(epoch))

    def status(self) -> dict[str, Any]:
        return ray.get(self.handle.status.remote())

    def release_version(self) -> None:
        """Drop the tag that pins the run's table version (when the run is over)."""
        table, _ = ray.get(self.handle.describe.remote())
        release_lease(table, self.name)

    def kill(self) -> None:
        """Stop the actor for good, first writing its sealed progress (which stays)."""
        try:
            ray.get(self.handle.persist.remote(), timeout=10)
        except Exception:  # already dead or unreachable: what it wrote before stays
            logger.warning("coordinator %s did not write its progress before being stopped",
                           self.name, exc_info=True)
        ray.kill(self.handle, no_restart=True)
