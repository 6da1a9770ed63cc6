"""The coordinator: a named Ray actor holding the split plan and the merged progress.

It builds each epoch's plan once and serves every view only its own splits; it seals the
progress of a global step once every rank has reported it, so a checkpoint is one
consistent object; it persists its progress atomically (JSON: the sealed step and the
reports of steps not sealed yet, which their ranks never send again) so that a restarted
actor loses at most the last ``PERSIST_EVERY_S`` of reports and never a checkpoint's; and
``resize`` redistributes the splits over a new world size.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict
from typing import Any

from .. import storage
from ..plan.background import BackgroundPlans
from ..plan.generation import file_name, publish_on_nodes, remove_on_nodes
from ..plan.pack_args import PackOptions
from ..plan.sources import next_epoch, plan_for
from ..plan.splits import PlanSpec, SplitPlan, check_epoch_seed
from ..plan.table import TableRef, table_commit
from ..state import format as st
from ..state import ledger as lg
from ..state.packed import parse_packed_state
from ..state.reporting import ReportPolicy
from ..topology import Topology
from .incarnation import actor_id, restarted_by_ray
from .packing import PackedRun
from .run_file import check_saved_config, ledger_path, run_config, run_identity
from .throttle import Throttled

logger = logging.getLogger(__name__)

PERSIST_FORMAT = 1
PLANS_CACHED = 2  # epochs whose plan stays in memory (current and next)
# Seals are written at most this often (the last one at most this late): with many ranks
# out of phase nearly every report call seals a step, and a write can cost milliseconds
# (more on object storage). A checkpoint (state_dict) and kill() write at once.
PERSIST_EVERY_S = 0.2


class CoordinatorActor:
    """The actor body. Use :class:`Coordinator` to create or find one."""

    def __init__(self, name: str, table: TableRef, spec: dict[str, Any], rows: int,
                 world_size: int, storage_path: str,
                 storage_retry: storage.RetryPolicy | None = None,
                 report_policy: dict[str, Any] | None = None,
                 packing: dict[str, Any] | None = None):
        self._name = name
        self._report_policy = ReportPolicy(**(report_policy or {}))
        self._table, self._commit = table, table_commit(table)
        self._spec = PlanSpec(**spec)
        self._rows = rows
        self._packed = None if packing is None else \
            PackedRun(PackOptions(**packing), self._spec.num_splits)
        self._built: tuple[lg.Sealed, dict[str, Any]] | None = None  # the last packed state
        # I/O: one JSON object under a path or URI, with the table's storage options.
        self._dir = storage.join(storage_path, name)
        self._path = ledger_path(storage_path, name)
        self._io: dict[str, Any] = {"storage_options": table.storage_options,
                                    "retry": storage_retry}
        self._lock = threading.RLock()
        self._plans: BackgroundPlans[int, SplitPlan] = BackgroundPlans(
            lambda e: plan_for(table, self._spec.for_epoch(e), rows), keep=PLANS_CACHED,
            name=f"coordinator {name}: the plan of epoch")
        self._history = lg.History()  # sealed steps kept for state_dict(step=...)
        self._rank_progress: dict[int, tuple[int, int]] = {}  # rank -> (step, rows)
        self._seal_times: deque[tuple[float, int]] = deque(maxlen=64)
        self._write_progress = Throttled(lambda: self._persist(durable=False), PERSIST_EVERY_S,
                                     self._lock)
        # Reports recorded, and how many of them the last durable write held: a view's
        # checkpoint waits for one that holds its own, and one write serves many views.
        self._recorded = self._durable = 0
        # Resizes so far, the nodes whose views must hear of the next one, and whether views
        # of the current world size reported since the last resize or restore (then a view
        # of another size is stale, not a new group). Persisted: an actor restarted by Ray
        # serves the same views; a new job's actor takes only the generation back.
        self._generation = 0
        self._nodes: set[str] = set()
        self._views_live = False
        self._generation_file = file_name(actor_id())
        self._incarnation = uuid.uuid4().hex  # a new one at each (re)start of the actor
        self._restored_to: lg.Sealed | None = None  # the progress the last restore set
        self._ledger = self._recover() or lg.Ledger(self._spec.num_splits, world_size,
                                                    self._spec.epoch,
                                                    packed=self._packed is not None)
        self._persist(durable=True)

    # ----------------------------------------------------------------- durability

    def _config(self) -> dict[str, Any]:
        return run_config(self._table, self._spec, self.packing(), self._commit)

    def identity(self) -> dict[str, Any]:
        """What ``Coordinator.create`` must ask for to attach to this live actor."""
        return run_identity(self._table, self._spec, self.packing(), self._commit)

    def _recover(self) -> lg.Ledger | None:
        if not storage.exists(self._path, **self._io):
            return None
        saved = storage.read_json(self._path, **self._io)
        check_saved_config(saved.get("config") if saved.get("format_version") == PERSIST_FORMAT
                           else {}, self._config(), self._path, self._name)
        ledger = lg.ledger_from_json(saved["ledger"], packed=self._packed is not None)
        if self._packed is not None:
            self._packed.load_json(saved["packed"], lambda name: storage.read_json(
                storage.join(self._dir, name), **self._io))
        if ledger.sealed is not None:
            self._history.add(ledger.sealed)
        self._generation = saved.get("generation", 0)
        if restarted_by_ray():
            self._nodes = set(saved.get("nodes", []))
            self._views_live = saved.get("views_live", False)
        else:  # a new job: the reports of the dead job's steps never seal, nor bind its views
            ledger.clear_pending()
        logger.info("coordinator %s recovered epoch %d, sealed step %s from %s", self._name,
                    ledger.epoch, ledger.sealed and ledger.sealed.step, self._path)
        return ledger

    def _persist(self, *, durable: bool) -> None:
        """Write the ledger (throttled: ``_write_progress``); ``durable`` adds an fsync, for
        states handed out as checkpoints."""
        if durable:
            self._durable = self._recorded
        storage.write_json_atomic(self._path, {
            "format_version": PERSIST_FORMAT,
            "config": self._config(),
            "ledger": lg.ledger_json(self._ledger),
            **({"packed": self._packed.to_json()} if self._packed is not None else {}),
            "generation": self._generation,
            "nodes": sorted(self._nodes),
            "views_live": self._views_live,
        }, fsync=durable, **self._io)

    def persist(self) -> None:
        """Write the sealed progress now, durably (before a planned stop)."""
        with self._lock:
            self._persist(durable=True)

    def retire(self) -> None:
        """The run is over (``Coordinator.kill``): write its progress durably, and delete
        its generation files on the nodes of the views it knows."""
        with self._lock:
            self._persist(durable=True)
            nodes = set(self._nodes)
        remove_on_nodes(self._generation_file, nodes)

    def persist_recorded(self) -> str:
        """Make every report recorded so far durable (a view's checkpoint: its
        ``state_dict()`` returns after this); one write serves every view whose reports
        arrived before it. Returns this incarnation of the actor: where it is not the one
        that acknowledged the view's reports, they may have died with the last one."""
        held = self._recorded  # the caller's reports were recorded before it asked
        with self._lock:
            if self._durable < held:
                self._persist(durable=True)
        return self._incarnation

    # ----------------------------------------------------------------- plan

    def describe(self) -> tuple[TableRef, PlanSpec]:
        with self._lock:
            return self._table, self._spec.for_epoch(self._ledger.epoch)

    def rows(self) -> int:
        """The table's rows after the filter (a mixture's state names each source's)."""
        return self._rows

    def _plan(self, epoch: int) -> SplitPlan:
        """Epoch ``epoch``'s plan; the next epoch's then starts building in the background."""
        plan = self._plans.get(epoch)
        if next_epoch(self._spec.for_epoch(epoch)) is not None:
            self._plans.prefetch(epoch + 1)
        return plan

    def _identity(self, epoch: int) -> st.PlanIdentity:
        """What a state of ``epoch`` must agree with."""
        return self._plan(epoch).identity(self._commit)

    def plan_part(self, epoch: int, first: int, count: int) -> SplitPlan:
        return self._plan(epoch).splits(first, count)

    def packing(self) -> PackOptions | None:
        """The run's packing arguments (None: rows are not packed)."""
        return None if self._packed is None else self._packed.options

    def pack_budget(self, epoch: int) -> int:
        """``blocks_per_epoch`` of ``epoch`` (``"auto"`` is counted once, here)."""
        assert self._packed is not None
        return self._packed.budget(self._table, self._plan(epoch))

    def _state(self, sealed: lg.Sealed) -> dict[str, Any]:
        if self._packed is not None:
            if self._built is None or self._built[0] != sealed:  # every view starts from it
                self._built = (sealed, self._packed.state(
                    self._table, self._plan(sealed.epoch), self._identity(sealed.epoch), sealed))
            return self._built[1]
        return st.make_state(self._identity(sealed.epoch), list(sealed.samples),
                             list(sealed.positions), world_size=sealed.world_size, rank=None,
                             global_step=sealed.step)

    # ----------------------------------------------------------------- progress

    def attach(self, topology: Topology, node_id: str | None = None
               ) -> tuple[dict[str, Any], int, str, str]:
        """A new view's start: its state (see :meth:`start`), the generation it belongs to,
        the name of the file that publishes the generation on node ``node_id``, and this
        incarnation (see :meth:`persist_recorded`)."""
        with self._lock:
            state = self.start(topology)
            if node_id is not None and node_id not in self._nodes:
                self._nodes.add(node_id)
                self._write_progress.request()
            return state, self._generation, self._generation_file, self._incarnation

    def start(self, topology: Topology) -> dict[str, Any]:
        """The state a new view of ``topology`` starts from (resizing if needed)."""
        rank, world_size = topology.rank, topology.world_size
        with self._lock:
            if world_size != self._ledger.world_size:
                if self._views_live:
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
            lg.check_generation(self._ledger, batch, self._generation)
            sealed = lg.record_batch(self._ledger, batch)
            self._recorded += 1
            self._views_live = True
            self._write_progress.request()  # pending steps too: their ranks never resend them
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
            return sealed[-1].step

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The merged state of the latest sealed step (or of ``step``), made durable first."""
        with self._lock:
            sealed = self._ledger.start() if step is None else \
                self._history.get(self._ledger.epoch, step)
            self._persist(durable=True)
            return self._state(sealed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make ``state`` (a merged checkpoint of this plan) the starting point of all views.
        Views attached before it stop at their next batch, as after a resize (see _restore)."""
        with self._lock:
            sealed = self._restored(state)
            new_generation = self._restore(sealed)
            generation, nodes = self._generation, set(self._nodes)
        if new_generation:  # outside the lock, but before returning (as resize does)
            publish_on_nodes(self._generation_file, generation, nodes)

    def _restored(self, state: dict[str, Any]) -> lg.Sealed:
        """The progress ``state`` holds, checked against this run (lock held)."""
        if self._packed is not None:
            parse_packed_state(state)  # a valid epoch before its plan is built
            plan = self._plan(state["epoch"])
            sealed, base = self._packed.restored(
                state, self._table, plan, plan.identity(self._commit), self._ledger.world_size)
            if not lg.starts_from(self._ledger, sealed):
                # The same checkpoint again keeps its base: the steps sealed since, still
                # kept for state_dict(step=...), are rebuilt from it.
                self._packed.base = base
                self._save_base()
            return sealed
        st.parse_state(state)  # its structure, and a valid epoch, before the plan is built
        progress = st.parse_state(state, self._plan(epoch := state["epoch"]).split_len)
        st.check_compatible(state, self._identity(epoch))
        if not progress.is_complete:
            raise ValueError("the coordinator needs a merged state covering every split; "
                             "merge the ranks' states with merge_state_dicts() first")
        if not progress.exact_everywhere:  # a lancedb state names no rank: cannot tell
            logger.warning(
                "loading a lancedb.streaming state as every rank's progress: if it is one "
                "rank's own (its other splits only lower bounds), the samples above them "
                "come again; merge the ranks' states with merge_state_dicts() first")
        return lg.Sealed(epoch, progress.global_step or 0, self._ledger.world_size,
                         tuple(progress.samples), tuple(progress.positions))

    def _save_base(self) -> None:
        """Write a packed run's base to its own file, before the ledger that names it."""
        assert self._packed is not None
        name = self._packed.base_name()
        if name is not None and name != self._packed.base_file:  # every rank restores it
            storage.write_json_atomic(storage.join(self._dir, name), self._packed.base_json(),
                                      fsync=True, **self._io)
        self._packed.base_file = name

    def _restore(self, sealed: lg.Sealed) -> bool:
        """Start from ``sealed``; whether that began a generation (views attached before
        are stale): a first restore does, even to the ledger's own progress (a dead group's
        views may report past it), not the same again with nothing sealed since (each rank)."""
        changed = lg.restore(self._ledger, sealed)
        if changed:
            self._history.restart(sealed)
        new = changed or self._restored_to != lg.progress_key(sealed)
        self._generation += new
        self._restored_to = lg.progress_key(sealed)
        self._built = None  # a packed state's buffers also depend on the restored base
        self._rank_progress.clear()  # the views before the restore are gone
        self._views_live = False
        self._persist(durable=True)
        return new

    def initial_state(self) -> dict[str, Any]:
        """Zero progress at the epoch the coordinator was created for."""
        return self._state(self._ledger.zero(self._spec.epoch))

    def resize(self, world_size: int) -> dict[str, Any]:
        """Redistribute the splits over ``world_size`` ranks from the latest sealed step; the
        views of the old size stop at their next batch (the new generation is published on
        their nodes before this returns)."""
        with self._lock:
            sealed = lg.resize(self._ledger, world_size)
            self._rank_progress.clear()
            self._views_live = False
            self._generation += 1
            self._persist(durable=True)
            generation, nodes, state = self._generation, set(self._nodes), self._state(sealed)
        # Outside the lock (reports and new views go on meanwhile), but before returning.
        publish_on_nodes(self._generation_file, generation, nodes)
        return state

    def set_epoch(self, epoch: int, generation: int | None = None) -> None:
        """Move the run to ``epoch``; ``generation``: the asking view's, refused when a
        resize has made that view stale (it would move the live views' epoch under them)."""
        check_epoch_seed(self._spec.shuffle_seed, epoch)  # before anything changes
        with self._lock:
            if generation is not None and generation != self._generation:
                raise lg.StaleReport(
                    f"set_epoch({epoch}) from a view of generation {generation}, but the "
                    f"coordinator was resized since (generation {self._generation}): that "
                    "view is stale; set the epoch on the views of the new world size")
            if epoch != self._ledger.epoch:
                lg.advance_epoch(self._ledger, epoch)
                if self._packed is not None:
                    self._packed.reset()
                    self._save_base()
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
                **({} if self._packed is None else {"packed": self._packed.status(start)}),
            }
